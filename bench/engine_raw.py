"""The ceiling: mlx-lm's BatchGenerator driven directly, on one thread, no server.

Run as its own process (`python -m bench.engine_raw`): it loads the model
once, then runs one round of a level for each JSON line on its stdin
(`{"concurrency", "warmup", "timed"}`, prompt index ranges as "A:B") and
answers each with one JSON line on stdout, until its stdin closes. The
runner keeps it for every round where it keeps the workers (the gate), as a
worker keeps its compiled kernels, and else starts one per round.

A round keeps `concurrency` sequences in flight (a closed loop: a new one is
inserted as soon as one finishes, between two steps, which is where a worker
can insert too) with the same prompts, lengths, sampler and batch limits the
workers get. Timestamps are taken when `next()` hands the tokens over: the
earliest a server could send them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from bench.stats import RequestRecord
from bench.workload import Level, Workload


def _closed_loop(generator, workload: Workload, concurrency: int, indices: range):
    """Runs the requests with these prompt indices, `concurrency` at a time, each
    replacement inserted in the step its predecessor finished.
    Returns (records, wall seconds)."""
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=0.0)  # one shared greedy sampler: batched sampling
    started: dict[int, tuple[float, RequestRecord, int]] = {}  # uid: start, record, length
    records: list[RequestRecord] = []
    issued = 0

    def launch(n: int) -> None:
        nonlocal issued
        n = min(n, len(indices) - issued)
        if n <= 0:
            return
        taken = [indices[issued + i] for i in range(n)]
        lengths = [workload.answer_tokens(index) for index in taken]
        prompts = [workload.prompt(index) for index in taken]
        uids = generator.insert(prompts, max_tokens=lengths, samplers=[sampler] * n)
        now = time.perf_counter()
        for uid, length in zip(uids, lengths, strict=True):
            started[uid] = (now, RequestRecord(), length)
        issued += n

    begin = time.perf_counter()
    launch(concurrency)
    while started:
        _, responses = generator.next()
        now = time.perf_counter()
        finished = 0
        for r in responses:
            t0, record, length = started[r.uid]
            record.arrived(now - t0, 1)
            if r.finish_reason is not None:
                if record.tokens != length:
                    record.error = f"{r.finish_reason} after {record.tokens} tokens"
                records.append(record)
                del started[r.uid]
                finished += 1
        launch(finished)
    return records, time.perf_counter() - begin


def serve(model_dir: Path, workload: Workload, lines: TextIO, out: TextIO) -> None:
    """Load the model, then one round per line of `lines`, each answered on `out`."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(model_dir))
    # A stream of its own, made on this thread, as the worker's engine thread does.
    stream = mx.new_stream(mx.default_device())
    for line in lines:
        asked = json.loads(line)
        level = Level(asked["concurrency"], 0, _range(asked["warmup"]), _range(asked["timed"]))
        out.write(json.dumps(run(model, stream, workload, level)) + "\n")
        out.flush()


def run(model: Any, stream: Any, workload: Workload, level: Level) -> dict:
    """One round of one level on a fresh BatchGenerator: its warm-up, then its
    timed requests."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(
        model,
        stream=stream,
        completion_batch_size=workload.completion_batch_size,
        prefill_batch_size=workload.prefill_batch_size,
        prefill_step_size=workload.prefill_step_size,
    )
    c = level.concurrency
    _closed_loop(generator, workload, c, level.warmup)
    with generator.stats() as counted:
        records, wall = _closed_loop(generator, workload, c, level.timed)
    generator.close()
    return {
        "device": str(mx.default_device()),
        "mlx_lm": metadata.version("mlx-lm"),
        "records": [asdict(r) for r in records],
        "wall_s": wall,
        # mlx-lm's own counters: how the engine's time splits between prefill and decode.
        "batch_stats": {
            "concurrency": c,
            "decode_steps": counted.generation_steps,
            "tokens_per_step": counted.generation_tokens / max(1, counted.generation_steps),
            "prompt_share": counted.prompt_time / counted.wall_time,
            "decode_share": counted.decode_time / counted.wall_time,
        },
    }


def _range(text: str) -> range:
    start, stop = (int(part) for part in text.split(":"))
    return range(start, stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--workload", required=True, help="Workload as JSON")
    args = parser.parse_args()
    workload = Workload.from_dict(json.loads(args.workload))
    serve(args.model, workload, sys.stdin, sys.stdout)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # a terminal's Ctrl-C reaches this child too: the bench says it
        raise SystemExit(130) from None
