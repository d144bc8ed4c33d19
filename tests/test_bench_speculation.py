"""The speculation bench tells each stream's pace apart: greedy and sampled."""

from __future__ import annotations

from bench.speculation import format_row, stream_rates, timed_first
from bench.stats import RequestRecord


def record(index: int, tokens: int, ttft: float, last: float, error: str | None = None):
    r = RequestRecord(ttft=ttft, tokens=tokens, last=last, error=error)
    r.index = index
    return r


def test_the_half_workload_reports_greedy_and_sampled_streams_apart():
    """In the half workload even requests are greedy, odd ones sampled: each
    stream's tokens a second after its first land in its own group, so the
    table says whether the sampled streams kept their pace while the greedy
    ones gained; failed requests and one-token answers count in neither."""
    records = [
        record(0, 129, 0.1, 0.1 + 128 / 400),  # 400 tokens a second
        record(1, 129, 0.1, 0.1 + 128 / 100),
        record(2, 129, 0.2, 0.2 + 128 / 200),
        record(3, 1, 0.1, 0.1),
        record(5, 129, 0.1, 0.2, error="finish 'abort' after 12 of 128 tokens"),
    ]
    rates = stream_rates(records, "half")
    assert {how: [round(r) for r in seen] for how, seen in rates.items()} == {
        "greedy": [400, 200], "sampled": [100]
    }
    assert [len(seen) for seen in stream_rates(records, "wrong").values()] == [0, 3]
    row = {
        "kind": "half", "concurrency": 4, "off_tok_s": 500.0, "on_tok_s": 600.0,
        "on_over_off": 1.2, "proposed": 10, "accepted": 9, "tokens_per_checking_pass": 5.0,
        "off_steps": 100, "on_steps": 80, "off_step_ms": 10.0, "on_step_ms": 12.0,
        "off_stepping_share": 0.9, "on_stepping_share": 0.9,
        "stream_on_over_off": {"greedy": 1.5, "sampled": 0.96},
    }  # fmt: skip
    assert format_row(row).endswith("; a greedy stream x1.50; a sampled stream x0.96")
    # Failed requests are said, by worker, with the first one's message.
    row["failed"] = {"off": [3, "RESOURCE_EXHAUSTED: no room"]}
    assert format_row(row).endswith(
        "; a sampled stream x0.96; 3 failed off, the first: RESOURCE_EXHAUSTED: no room"
    )


def test_each_worker_is_timed_first_at_every_other_level_and_round():
    """Of the two workers, the one timed second has measured slower: a run of
    one round times the off worker first at one level, the on worker at the
    next; within a level the rounds alternate."""
    assert [timed_first(level, 0) for level in range(4)] == [
        ("off", "on"), ("on", "off"), ("off", "on"), ("on", "off")
    ]
    assert [timed_first(1, r)[0] for r in range(3)] == ["on", "off", "on"]
