"""A decoding step's time for each KV format (`python -m bench.decode_steps`).

In process, no server: for each batch size and context, a batch cache of
that many rows is prefilled with that many tokens each, then the model
decodes, steps pipelined as the worker runs them (the next step recorded
while the device runs the last), and the median step is reported, with the
median time the host took to record it (the model's call, before it goes to
the device): where recording alone is most of the step, the step waits on
the host, not the device. (Handing a step over can wait on the device too:
mlx holds the host back while too much is queued.) Formats:
the model's own KV (16), and each of `--kv-bits` through the worker's
quantized attention (on CUDA the fused kernel); with `--matmuls`, the same
formats again through mlx's quantized matmuls, the worker's path elsewhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from bench.model import add_model_flags, load_model, quantizable
from smg_mlx.config import KV_GROUP_SIZES, EngineConfig
from smg_mlx.engine.batch import (
    fused_quantized_attention,
    kv_format,
    quantized_attention,
    quantized_kv,
)

FILL_CHUNK = 1024  # context tokens a row prefilled per pass
UNTIMED_STEPS = 8


def step_ms(model: nn.Module, bits: int | None, group_size: int, rows: int, context: int,
            steps: int) -> tuple[float, float]:  # fmt: skip
    """The medians of `steps` pipelined decoding steps (after UNTIMED_STEPS) over
    `rows` rows of `context` tokens, the KV in `bits` (None: the model's own):
    the step's time and the host's time recording it, in ms."""
    config = EngineConfig(model_path=Path("."), kv_bits=bits, kv_group_size=group_size)
    fresh = kv_format.caches_for(config, model) or (lambda: make_prompt_cache(model))
    cache = [layer.merge([layer] * rows) for layer in fresh()]
    tokens = mx.array([[(7 * i + r) % 1000 + 1 for i in range(context)] for r in range(rows)])
    for start in range(0, context, FILL_CHUNK):
        model(tokens[:, start : start + FILL_CHUNK], cache=cache)
        mx.eval([c.state for c in cache])
    y = tokens[:, -1:]
    times, recording = [], []
    previous = None
    for _ in range(UNTIMED_STEPS + steps):
        started = time.perf_counter()
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        recording.append(time.perf_counter() - started)
        mx.async_eval(y)
        if previous is not None:
            previous.tolist()  # the step before: what the worker waits for
        previous = y
        times.append(time.perf_counter() - started)
    mx.eval(y)
    return tuple(1e3 * statistics.median(t[UNTIMED_STEPS:]) for t in (times, recording))  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode_steps", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    add_model_flags(p)
    p.add_argument("--rows", default="1,4,16,64", help="batch sizes")
    p.add_argument("--contexts", default="64,960,1984", help="tokens each row holds")
    p.add_argument("--kv-bits", default="8",
                   help="quantized formats besides the model's own KV ('' for none)")
    p.add_argument("--kv-group-size", type=int, default=64, choices=KV_GROUP_SIZES)
    p.add_argument("--matmuls", action="store_true",
                   help="the quantized formats through mlx's quantized matmuls too")  # fmt: skip
    p.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    model = load_model(args)
    quantized_attention.install(None)
    quantized = [b for b in (int(b) for b in args.kv_bits.split(",") if b)
                 if quantizable(model, b, args.kv_group_size, "--kv-bits '' for the model's "
                                "own KV alone, or a model whose heads --kv-group-size divides: "
                                "--model, --shape")]  # fmt: skip
    ways = [(None, "own")] + [(b, "worker") for b in quantized]
    if args.matmuls:
        ways += [(b, "matmuls") for b in quantized]
    fused, tails = fused_quantized_attention.AVAILABLE, quantized_kv.TAILS
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            row = {"rows": rows, "context": context, "ms": {}, "recording_ms": {}}
            for bits, way in ways:
                # (mlx's matmuls read no 16-bit tail)
                fused_quantized_attention.AVAILABLE = fused and way != "matmuls"
                quantized_kv.TAILS = tails and way != "matmuls"
                name = f"{bits or 16}-bit" + (" matmuls" if way == "matmuls" else "")
                ms, rec = step_ms(model, bits, args.kv_group_size, rows, context, args.steps)
                row["ms"][name], row["recording_ms"][name] = round(ms, 2), round(rec, 2)
                mx.clear_cache()
            fused_quantized_attention.AVAILABLE, quantized_kv.TAILS = fused, tails
            results.append(row)
            times = ", ".join(f"{k} {v:.2f} ms (recorded in {row['recording_ms'][k]:.2f})"
                              for k, v in row["ms"].items())
            print(f"{rows:3d} rows x {context:6d} tokens: {times}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
