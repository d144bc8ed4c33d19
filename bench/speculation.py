"""Speculative decoding on and off (`python -m bench --speculation`).

Our worker twice on the same model, `--speculative off` and `--speculative
auto` (or what `--speculation-setting` names), in interleaved rounds at each
concurrency level, for three workloads. Random weights decide nothing about
how often proposals are right, so each workload gets its acceptance from how
the bench's random models behave, and the table reports what was measured:

- right: greedy. These models' greedy output repeats one token, so once a
  stream has said it twice, prompt lookup proposes it again, and is right.
- wrong: sampled at temperature 1. Their sampled output is near uniform over
  the vocabulary: what a stream says never recurs, so lookups find little,
  and what they find is wrong. This is what speculation costs where it
  cannot help.
- half: every other stream each way, in one batch.
- again: greedy, each timed prompt asked once before (untimed), so the prefix
  cache holds its answer and the drafter proposes the rest of it: proposals
  right in full, as where a client retries or regenerates. Both workers see
  the same cache hits; only the one that speculates proposes from them.

The two workers run side by side, each on SHARE of the device's memory.
With `--speculation-draft` the proposals come from a draft model instead:
`self` (the model as its own draft: greedy proposals always right, sampled
ones mostly wrong) or a random model of another shape with the same
tokenizer (proposals its own, mostly wrong).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.grpc_client import closed_loop
from bench.long_prompts import default_worker, metrics
from bench.runner import progress, steps_so_far
from bench.stats import RequestRecord
from bench.workload import Workload

# Each worker's --memory-budget, where the bench's own flags name none: both run
# side by side on one device, and each would otherwise plan on 90% of a GPU's
# memory (on CPU, 75% of the host's), growing its prefix cache into it. At 45%
# each, the worker that did not speculate ran out of CUDA memory at 64 streams
# (what neither process's plan counts: its CUDA context, the other's passes in
# flight), failing its requests.
SHARE = "40%"

KINDS = ("right", "wrong", "half", "again")
DEFAULT_KINDS = KINDS[:3]  # "again" is asked for by name: it runs its prompts twice


def counters(drafter: str) -> tuple[str, ...]:
    """The worker's speculation counters for this drafter."""
    return tuple(
        f'smg_mlx_speculative_{name}_total{{drafter="{drafter}"}}'
        for name in ("proposed_tokens", "accepted_tokens", "passes", "pass_tokens")
    )


def temperature(kind: str, index: int) -> float:
    """Request `index`'s temperature in workload `kind`."""
    sampled = kind == "wrong" or (kind == "half" and index % 2 == 1)
    return 1.0 if sampled else 0.0


def stream_rates(records: Iterable[RequestRecord], kind: str) -> dict[str, list[float]]:
    """Each stream's tokens a second after its first, greedy ones apart from
    sampled ones: in the half workload, whether the streams whose proposals
    are right gain, and whether the others keep their pace."""
    rates: dict[str, list[float]] = {"greedy": [], "sampled": []}
    for record in records:
        rate = record.stream_rate
        if record.error is None and rate is not None:
            rates["sampled" if temperature(kind, record.index) else "greedy"].append(rate)
    return rates


@dataclass(frozen=True)
class Speculation:
    levels: tuple[int, ...]
    kinds: tuple[str, ...] = DEFAULT_KINDS
    rounds: int = 3
    setting: str = "auto"  # --speculative of the worker that speculates
    draft: Path | None = None  # its --draft-model (None: prompt lookup)


def _round(address: str, port: int, workload: Workload, kind: str, c: int, first: int,
           tag: str, counted: tuple[str, ...]) -> tuple:  # fmt: skip
    """Warm-up, then the timed requests: (tokens, seconds, errors, the
    worker's steps, their seconds and their rows, and its `counted` counters,
    over the timed requests), the streams' rates (`stream_rates`), and the
    first error (None: none)."""
    warm, timed = workload.warmup(c), workload.requests(c)
    hot = partial(temperature, kind)
    asyncio.run(closed_loop(address, workload, c, range(first, first + warm), tag, hot))
    span = range(first + warm, first + warm + timed)
    if kind == "again":
        asyncio.run(closed_loop(address, workload, c, span, f"{tag}-first", hot))
    before = [*(steps_so_far(port) or (0.0, 0.0, 0.0)), *metrics(port, *counted)]
    records, wall = asyncio.run(closed_loop(address, workload, c, span, tag, hot))
    after = [*(steps_so_far(port) or before[:3]), *metrics(port, *counted)]
    changes = [(b or 0) - (a or 0) for a, b in zip(before, after, strict=True)]
    errors = [r.error for r in records if r.error is not None]
    figures = (sum(r.tokens for r in records), wall, len(errors), *changes)
    return figures, stream_rates(records, kind), next(iter(errors), None)


def timed_first(level: int, r: int) -> tuple[str, str]:
    """The workers in the order round `r` of the `level`-th level run (kinds and
    levels counted together) times them: each first in every other round, and
    in every other level's first round, so that a run of one round does not
    time one worker first throughout (which went first has moved a ratio by
    more than the 3% speculation may cost)."""
    return ("off", "on") if (level + r) % 2 == 0 else ("on", "off")


def run_speculation(model_dir: Path, work_dir: Path, spec: Speculation, workload: Workload,
                    extra: list[str], timeout_s: float) -> list[dict]:  # fmt: skip
    """Each workload at each level: tok/s off and on, and what the proposals did."""
    rows = []
    drafting = [] if spec.draft is None else ["--draft-model", str(spec.draft)]
    if "--memory-budget" not in extra:
        extra = [*extra, "--memory-budget", SHARE]
    counted = counters("prompt_lookup" if spec.draft is None else "draft_model")
    with (
        default_worker(model_dir, work_dir, [*extra, "--speculative", "off"], "spec-off",
                       timeout_s) as (off, off_metrics),
        default_worker(model_dir, work_dir, [*extra, "--speculative", spec.setting, *drafting],
                       "spec-on", timeout_s) as (on, on_metrics),
    ):  # fmt: skip
        first = 0
        workers = {"off": (off, off_metrics), "on": (on, on_metrics)}
        for kind in spec.kinds:
            for c in spec.levels:
                # tokens, seconds, errors; steps, their seconds and rows; the counters
                figures = {name: [0.0] * (6 + len(counted)) for name in workers}
                streams: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
                first_error: dict[str, str] = {}
                order = [timed_first(len(rows), r) for r in range(spec.rounds)]
                for r, names in enumerate(order):
                    for name in names:
                        worker, port = workers[name]
                        got, rates, error = _round(worker.address, port, workload, kind, c,
                                                   first, f"{kind}-{c}-{r}", counted)  # fmt: skip
                        if error is not None:
                            first_error.setdefault(name, error)
                        figures[name] = [a + b for a, b in zip(figures[name], got, strict=True)]
                        for how, seen in rates.items():
                            streams[name].setdefault(how, []).extend(seen)
                    first += workload.warmup(c) + workload.requests(c)
                proposed, accepted, passes, tokens = figures["on"][6:]
                row = {
                    "kind": kind, "concurrency": c,
                    "off_tok_s": figures["off"][0] / figures["off"][1],
                    "on_tok_s": figures["on"][0] / figures["on"][1],
                    "errors": figures["off"][2] + figures["on"][2],
                    # by worker: how many, and the first one's message
                    "failed": {name: [figures[name][2], error]
                               for name, error in first_error.items()},  # fmt: skip
                    "proposed": proposed, "accepted": accepted,
                    "checking_passes": passes, "tokens_per_checking_pass": tokens / max(1, passes),
                    "timed_first": [names[0] for names in order],  # each round's
                }  # fmt: skip
                row["on_over_off"] = row["on_tok_s"] / row["off_tok_s"]
                # A stream's own pace, greedy and sampled apart (mean tokens a second).
                for name, rates in streams.items():
                    row[f"{name}_stream_tok_s"] = {
                        how: sum(seen) / len(seen) for how, seen in rates.items() if seen
                    }
                row["stream_on_over_off"] = {
                    how: rate / row["off_stream_tok_s"][how]
                    for how, rate in row["on_stream_tok_s"].items()
                    if how in row["off_stream_tok_s"]
                }
                for name, (_, wall, _, steps, seconds, rows_stepped, *_) in figures.items():
                    # Where the time goes: steps (passes, their syncs) or between them
                    # (the engine's work on each step's tokens, admissions, waiting).
                    row[f"{name}_steps"] = steps
                    row[f"{name}_step_ms"] = 1e3 * seconds / max(1, steps)
                    row[f"{name}_rows_per_step"] = rows_stepped / max(1, steps)
                    row[f"{name}_stepping_share"] = seconds / wall
                progress(f"{kind} c={c}: {format_row(row)}")
                rows.append(row)
    return rows


def format_row(row: dict) -> str:
    accepted = row["accepted"] / row["proposed"] if row["proposed"] else 0.0
    return (
        f"off {row['off_tok_s']:.0f} tok/s, on {row['on_tok_s']:.0f} "
        f"(x{row['on_over_off']:.2f}); {row['accepted']:.0f} of {row['proposed']:.0f} "
        f"proposed tokens kept ({100 * accepted:.0f}%), "
        f"{row['tokens_per_checking_pass']:.1f} tokens a checking pass; steps off / on: "
        f"{row['off_steps']:.0f} / {row['on_steps']:.0f} of {row['off_step_ms']:.1f} / "
        f"{row['on_step_ms']:.1f} ms, stepping {100 * row['off_stepping_share']:.0f}% / "
        f"{100 * row['on_stepping_share']:.0f}% of the time"
        + "".join(f"; a {how} stream x{ratio:.2f}"
                  for how, ratio in row.get("stream_on_over_off", {}).items())  # fmt: skip
        + "".join(f"; {count:.0f} failed {name}, the first: {error}"
                  for name, (count, error) in row.get("failed", {}).items())  # fmt: skip
    )


def format_table(rows: list[dict]) -> str:
    lines = [f"{'workload':<8} {'conc':>4}  speculation on vs off"]
    lines += [f"{r['kind']:<8} {r['concurrency']:>4}  {format_row(r)}" for r in rows]
    return "\n".join(lines)
