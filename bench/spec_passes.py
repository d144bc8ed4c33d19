"""What checking passes do alone, without the worker (`python -m bench.spec_passes`).

mlx-lm's BatchGenerator, its decoding rows replaced by the worker's
speculative ones, runs ROWS streams that never end (no admissions, no
server, no prefix cache): plain decoding, checking in every pass where a
proposal is found (`--speculative always`; a stream's first tokens have none
to find) and paced (`auto`), each for `--seconds` after a
warm-up. The streams are greedy (`right`), or every other one is sampled at
temperature 1 (`half`: those find nothing to propose), as in `python -m
bench --speculation`. Where the worker's own figures (`python -m bench --speculation`)
fall short of these, the cost is in the serving around the passes, not in
the passes. On mlx's CUDA backend the worker's attention shapes, few-row kernel and
settings (`loading.as_served`: keys of steady widths) are installed, as the worker
installs them, and each kind of checking pass runs once before the timing, as in the
worker's warm-up (mlx builds some kernels on first use, seconds each). Past that, a
pass meeting new shapes as the streams grow still costs more: the median call is
reported beside the mean. The bench's random models repeat
themselves under greedy decoding: proposals are right once a stream has.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.nn as nn
import numpy as np
from mlx_lm.generate import BatchGenerator

from bench.model import add_model_flags, load_model
from bench.workload import levels_flag
from smg_mlx.engine.batch import few_rows_matmul
from smg_mlx.engine.batch.attention_shapes import AttentionShapes, shapes_build
from smg_mlx.engine.batch.batch import CUDA_CHUNK
from smg_mlx.engine.batch.loading import as_served
from smg_mlx.engine.batch.sampling import make_sampler
from smg_mlx.engine.speculative.decoding import (
    CHAIN,
    Drafting,
    DraftStats,
    SpeculativeGenerationBatch,
)
from smg_mlx.engine.speculative.pacing import Pacing
from smg_mlx.engine.types import SamplingSettings

MODES = ("plain", "always", "paced")
WORKLOADS = ("right", "half")
PROMPT_TOKENS = 64
WARM_UP_CALLS = 40


def measure(
    model: nn.Module, rows: int, mode: str, most: int, seconds: float, workload: str = "right",
    one_width: bool = False,
) -> dict:
    """One mode at one batch size: tokens a second, and what checking did."""
    rng = np.random.default_rng(rows)
    prompts = rng.integers(0, model.args.vocab_size, size=(rows, PROMPT_TOKENS)).tolist()
    generator = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=8)
    stats = DraftStats()
    if mode != "plain":
        # (paced: the widths the worker's pacing chooses from)
        pacing = Pacing(always=mode == "always", most=most, chain=CHAIN)
        drafting = Drafting(most, pacing, stats, one_width=one_width)
        generator._generation_batch = SpeculativeGenerationBatch.start(
            model, generator.sampler, drafting
        )
    greedy, hot = (make_sampler(SamplingSettings(temperature=t)) for t in (0.0, 1.0))
    samplers = [hot if workload == "half" and i % 2 else greedy for i in range(rows)]
    generator.insert(prompts, [1 << 30] * rows, samplers=samplers)
    while len(generator._generation_batch.uids) < rows:  # (the prompts)
        generator.next()
    if mode != "plain":  # before pacing's first trial, as the worker's warm-up
        generator._generation_batch.exercise()
    for _ in range(WARM_UP_CALLS):
        generator.next()
    counts = lambda: (stats.passes, stats.proposed, stats.accepted)  # noqa: E731
    before = counts()
    tokens = 0
    took = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        began = time.perf_counter()
        tokens += len(generator.next()[1])
        took.append(time.perf_counter() - began)
    wall = time.perf_counter() - started
    generator.close()
    passes, proposed, accepted = (now - then for now, then in zip(counts(), before, strict=True))
    return {
        "workload": workload, "rows": rows, "mode": mode, "tok_s": tokens / wall,
        "ms_per_call": 1000 * wall / len(took), "median_ms_per_call": 1000 * float(np.median(took)),
        "calls": len(took), "checking_passes": passes, "proposed": proposed, "accepted": accepted,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.spec_passes", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    add_model_flags(p)
    p.add_argument("--rows", default="4,16,64", type=levels_flag, help="batch sizes")
    p.add_argument("--workload", choices=WORKLOADS, default="right",
                   help="greedy streams (right) or every other one sampled (half)")  # fmt: skip
    p.add_argument("--num-draft-tokens", type=int, default=8, help="the most a row proposes")
    p.add_argument("--seconds", type=float, default=5.0, help="timed, per mode and batch size")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    as_served()
    model = load_model(args)
    cuda = shapes_build()
    if cuda:  # as the worker runs there
        AttentionShapes(CUDA_CHUNK).install()
    few_rows_matmul.install(model)  # (CUDA only, as the worker)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        plain = None
        for mode in MODES:
            r = measure(model, rows, mode, args.num_draft_tokens, args.seconds, args.workload,
                        one_width=cuda)
            plain = plain or r["tok_s"]
            said = [f"{r['ms_per_call']:.1f} ms a call (median {r['median_ms_per_call']:.1f})"]
            if mode != "plain":
                said.append(f"{r['checking_passes']} checking passes in {r['calls']} calls")
            if r["proposed"]:
                said.append(f"{r['accepted']} of {r['proposed']} proposed kept")
            print(f"rows {rows:3d} {mode:6s} {r['tok_s']:8.0f} tok/s (x{r['tok_s'] / plain:.2f}), "
                  f"{'; '.join(said)}", flush=True)  # fmt: skip
            results.append(r)
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
