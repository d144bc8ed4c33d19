"""The throughput gate's verdict: each side's best round against the other's, with the
pooled and the rounds-paired ratios beside it (the machine's drift shows there)."""

from bench.gate import format_checks, throughput_checks
from bench.stats import LevelResult


def level(system: str, rounds: tuple[float, ...], errors: int = 0) -> LevelResult:
    tok_s = sum(rounds) / len(rounds)
    return LevelResult(system, 4, 32, errors, 2048, 2048 / tok_s, tok_s, 50.0, 60.0, 10.0, 15.0,
                       10.0, 1.0, round_tok_s=rounds)  # fmt: skip


def test_a_level_passes_on_best_rounds_and_names_the_pooled_and_paired_ratios():
    # The engine's first round ran in a fast spell of the machine; ours' rounds ran beside
    # its rounds of the same number.
    engine = level("engine", (400.0, 300.0, 300.0))
    ours = level("ours", (392.0, 290.0, 330.0))
    (check,) = throughput_checks([engine, ours], [4])
    assert check.met and check.value == 392 / 400
    assert "pooled 1.01" in check.name and "rounds paired 0.98" in check.name


def test_a_level_short_of_its_bound_or_with_errors_fails_the_gate():
    engine = level("engine", (400.0, 400.0))
    short = throughput_checks([engine, level("ours", (300.0, 360.0))], [4])
    failing = throughput_checks([engine, level("ours", (400.0, 400.0), errors=1)], [4])
    assert not short[0].met and format_checks(short).endswith("gate FAILED")
    assert failing[0].value is None and "not measured" in failing[0].line()
