"""The throughput gate's verdict: each side's best round against the other's, with the
pooled and the rounds-paired ratios beside it (the machine's drift shows there)."""

from pathlib import Path

import pytest

from bench.__main__ import build_parser
from bench.gate import format_checks, mixed_checks, throughput_checks
from bench.stats import LevelResult

from helpers import wait_until


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


def test_a_mixed_run_whose_long_prompts_failed_measures_nothing():
    # (Prompts longer than the model's context: each refused at once, the stream never paused.)
    mixed = {"stream_longest_gap_s": 0.01, "chat_ttft_p50_s": 0.02, "chats_failed": 0}
    result = {"mixed": mixed, "long_errors": ["INVALID_ARGUMENT"] * 4, "stream_ended_early": False}
    checks = mixed_checks(result, 0.15)
    assert [c.value for c in checks] == [None, None]
    assert format_checks(checks).endswith("gate FAILED")
    assert all(c.met for c in mixed_checks({**result, "long_errors": []}, 0.15))


def test_who_runs_first_alternates_from_level_to_level(monkeypatch, tmp_path):
    """A machine slowing over a level favours the system that runs first: each
    system takes the first slot of as many levels as the other."""
    from bench import runner
    from bench.workload import Workload

    ran = []

    def worker_round(name, opts, level, kept):
        ran.append((level.concurrency, name))
        return [], 1.0, {}

    monkeypatch.setattr(runner, "_worker_round", worker_round)
    monkeypatch.setattr(runner, "summarize", lambda *args: level("ours", (1.0,)))
    opts = runner.Options(["ours", "peer"], [1, 4, 16, 64], Workload(), tmp_path, tmp_path,
                          rounds=3)  # fmt: skip
    runner._run_levels(opts, None, {}, {})
    firsts = [next(name for c, name in ran if c == want) for want in opts.levels]
    assert firsts == ["ours", "peer", "ours", "peer"]
    assert [name for c, name in ran if c == 1] == ["ours", "peer", "peer", "ours", "ours", "peer"]


def test_a_short_gate_runs_one_round_of_the_short_workload(model_dir, monkeypatch, tmp_path):
    """`make bench-gate BENCH_ARGS=--short`, a quick check that it runs: one
    round of fewer requests, as --short gives every other run."""
    import bench.__main__ as bench_main

    seen = []

    def run_all(opts):
        seen.append(opts)
        return [], {}

    monkeypatch.setattr(bench_main, "run_all", run_all)
    argv = ["--gate", "--short", "--mixed", "0", "--model", str(model_dir),
            "--work-dir", str(tmp_path)]  # fmt: skip
    assert bench_main.main([*argv, "--out", str(tmp_path / "gate.json")]) == 1  # nothing ran
    (opts,) = seen
    assert opts.rounds == 1 and opts.workload.min_requests == 16


def test_a_chat_interval_of_no_time_is_refused(capsys):
    # (0 sent chats as fast as the loop ran: 183,947 of them, and the mixed run never ended.)
    for value in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--mixed", "1", "--chat-interval", value])
        assert "expected seconds above 0" in capsys.readouterr().err


def test_the_engines_round_waits_for_a_kept_worker_busy_with_work_of_its_own(tmp_path):
    """Systems run in turn: a worker that goes on working once idle (building attention
    shapes) would slow the engine's round beside it."""
    import sys
    import time

    from bench import runner
    from bench.workers import WorkerProcess, free_port

    if not Path("/proc/self/stat").exists():
        pytest.skip("reads CPU time from /proc")
    # Busy for 1.5 s of CPU, said once it is (a loaded host may take a while
    # to start Python, idle as it reads files: not the busy spell looked for).
    spinning = tmp_path / "spinning"
    busy_then_idle = (f"import time\nopen({str(spinning)!r}, 'w').close()\n"
                      "end = time.process_time() + 1.5\n"
                      "while time.process_time() < end: pass\ntime.sleep(60)")  # fmt: skip
    worker = WorkerProcess("ours", [sys.executable, "-c", busy_then_idle], free_port(),
                           tmp_path / "ours.log")  # fmt: skip
    try:
        assert wait_until(spinning.exists, 30)
        started = time.monotonic()
        runner._quiet({"ours": (worker, {})})
        assert worker.cpu_seconds() >= 1.4 and time.monotonic() - started < 30
    finally:
        worker.stop()
    # (timed from once it spins, as above: Python starting is not the spell looked for)
    spinning.unlink()
    always_busy = f"open({str(spinning)!r}, 'w').close()\nwhile True: pass"
    worker = WorkerProcess("ours", [sys.executable, "-c", always_busy], free_port(),
                           tmp_path / "busy.log")  # fmt: skip
    try:
        assert wait_until(spinning.exists, 30)
        assert not worker.wait_quiet(1.0)
    finally:
        worker.stop()
