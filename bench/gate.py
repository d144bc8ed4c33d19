"""The throughput gate (`python -m bench --gate`, `make bench-gate`): no engine change skips it.

Two parts, on one machine, in one run:

1. the raw mlx-lm engine and our worker side by side at each concurrency level,
   rounds interleaved (`bench.runner`), our worker with its default flags and
   kept running across levels as in production: ours' tok/s over the engine's;
2. the mixed run (`bench.mixed`): long prompts queued beside a running stream
   and a chat a second: the stream's longest pause and the chats' TTFT p50,
   over the step budget the worker was given (a step is what a stream waits
   for at most while prompts prefill).

Every threshold is a ratio of two figures of this run: machines differ by tens
of percent, so no absolute time would hold across them. Each is printed
against its bound, and the exit status is 1 when one falls short. It is a
benchmark, not a test: it says something only on the machine it is meant for
(a GPU), and CI has none.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.stats import LevelResult

# ours/engine tok/s at least this, by concurrency level (the last one for levels above).
THROUGHPUT = ((1, 1.0), (4, 0.95))
# The mixed run, in step budgets: the stream's longest pause, and the chats' TTFT p50.
STREAM_PAUSE_STEPS = 250 / 150
CHAT_TTFT_STEPS = 500 / 150
DEFAULT_LEVELS = (1, 4, 16, 64)
# Rounds per level, and timed requests a round at least (levels of few streams):
# a GPU VM's slow spells last seconds, so more, shorter rounds give each side
# more rounds outside them and pair rounds that ran closer together.
ROUNDS = 5
MIN_REQUESTS = 16
# Our worker's flags in the throughput part, before --worker-args (see bench.__main__._gate).
WORKER_ARGS = ("--speculative", "off")


@dataclass(frozen=True)
class Check:
    """One figure against its bound."""

    name: str
    value: float | None  # None: not measured (a system or phase failed)
    bound: float
    most: bool = False  # the bound is a ceiling, not a floor

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value <= self.bound if self.most else self.value >= self.bound

    def line(self) -> str:
        value = "not measured" if self.value is None else f"{self.value:.2f}"
        sign = "<=" if self.most else ">="
        verdict = "ok    " if self.met else "FAILED"
        return f"{verdict} {self.name}: {value} ({sign} {self.bound:.2f})"


def throughput_bound(concurrency: int) -> float:
    bound = THROUGHPUT[0][1]
    for level, value in THROUGHPUT:
        if concurrency >= level:
            bound = value
    return bound


def paired(ours: LevelResult, engine: LevelResult) -> float | None:
    """The median of ours/engine over rounds of the same number, which ran next
    to each other (`bench.runner`): each ratio taken in one state of the machine."""
    ratios = [o / e for o, e in zip(ours.round_tok_s, engine.round_tok_s, strict=False) if e > 0]
    return statistics.median(ratios) if ratios else None


def throughput_checks(results: list[LevelResult], levels: list[int]) -> list[Check]:
    """ours/engine tok/s at each level, each side's best round against the
    other's: on a shared machine whole rounds of either side run tens of
    percent slow, and pooling rounds compares how many of those each drew.
    The name also gives the pooled ratio and the rounds paired (`paired`):
    where they disagree, the machine's drift is larger than the gap measured."""
    by = {(r.system, r.concurrency): r for r in results}
    checks = []
    for c in levels:
        ours, engine = by.get(("ours", c)), by.get(("engine", c))
        ok = ours is not None and engine is not None and engine.tok_s > 0 and not ours.errors
        value = ours.best_tok_s / engine.best_tok_s if ok else None
        name = f"ours/engine tok/s at concurrency {c}, best rounds"
        if ok:
            pair = paired(ours, engine)
            name += f" (pooled {ours.tok_s / engine.tok_s:.2f}"
            name += f", rounds paired {pair:.2f})" if pair is not None else ")"
        checks.append(Check(name, value, throughput_bound(c)))
    return checks


def step_budget_seconds(worker_args: list[str]) -> float:
    """The step budget the mixed run's worker was given, read as the worker reads
    its flags (its default where they name none)."""
    from smg_mlx.cli import build_parser

    return build_parser().parse_args(["serve", "--demo", *worker_args]).step_budget_ms / 1000


def mixed_checks(result: dict, step_seconds: float) -> list[Check]:
    """The stream's longest pause and the chats' TTFT p50 during the mixed phase."""
    mixed = result["mixed"]

    def steps(seconds: float | None) -> float | None:
        return None if seconds is None else seconds / step_seconds

    # A pause or a TTFT beside long prompts that failed (too long for the model, say)
    # says nothing of how they run beside them: not measured.
    failed = result["long_errors"] or mixed["chats_failed"] or result["stream_ended_early"]
    return [
        Check("mixed: the stream's longest pause, in step budgets",
              None if failed else steps(mixed["stream_longest_gap_s"]), STREAM_PAUSE_STEPS,
              most=True),
        Check("mixed: chats' TTFT p50, in step budgets",
              None if failed else steps(mixed["chat_ttft_p50_s"]), CHAT_TTFT_STEPS, most=True),
    ]  # fmt: skip


def format_checks(checks: list[Check]) -> str:
    verdict = "passed" if all(c.met for c in checks) else "FAILED"
    return "\n".join([*(c.line() for c in checks), f"gate {verdict}"])
