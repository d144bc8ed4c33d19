"""One layer's decoding attention, alone (`python -m bench.attention_pass`).

In process, no model: for each batch size and context, random keys and
values of `--kv-heads` heads, one query a row of `--heads` heads, and the
median of `--runs` passes (each run's passes queued together, as a model's
layers are): the model's own attention over 16-bit keys and values
(mlx's fused kernel), the worker's over them quantized to `--kv-bits` (on
CUDA the fused kernel of ours), and with `--matmuls` (CUDA) mlx's
quantized matmuls, the worker's path elsewhere. What a decoding step spends on
attention is about this times the model's layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from bench.workload import levels_flag
from smg_mlx.config import KV_GROUP_SIZES
from smg_mlx.engine.batch import fused_quantized_attention, quantized_attention

PASSES = 20  # passes a run queues before it waits


def device_ms(attend: Callable[[], mx.array], runs: int) -> float:
    """The median milliseconds a pass, over `runs` runs of PASSES queued before a wait
    (after one untimed): the device's time, launches overlapped."""
    mx.eval(attend())
    times = []
    for _ in range(runs + 1):
        mx.synchronize()
        started = time.perf_counter()
        mx.eval([attend() for _ in range(PASSES)])
        times.append((time.perf_counter() - started) / PASSES)
    return 1e3 * statistics.median(times[1:])


def measure(heads: int, kv_heads: int, dim: int, rows: int, context: int, bits: int,
            group_size: int, matmuls: bool, runs: int) -> dict[str, float]:  # fmt: skip
    """Each way's milliseconds for one pass."""
    keys, values = (
        mx.random.normal((rows, kv_heads, context, dim), key=mx.random.key(i)).astype(mx.bfloat16)
        for i in (1, 2)
    )  # fmt: skip
    queries = mx.random.normal((rows, heads, 1, dim), key=mx.random.key(3)).astype(mx.bfloat16)
    q_keys, q_values = (
        tuple(mx.quantize(x, group_size=group_size, bits=bits)) for x in (keys, values)
    )
    mx.eval(keys, values, queries, q_keys, q_values)
    scale = dim**-0.5
    ms = {"16-bit": device_ms(lambda: mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=None), runs)}  # fmt: skip
    ms[f"{bits}-bit"] = device_ms(lambda: quantized_attention.attention(
        queries, q_keys, q_values, scale, None, group_size, bits), runs)  # fmt: skip
    if matmuls and fused_quantized_attention.AVAILABLE:
        ms[f"{bits}-bit matmuls"] = device_ms(lambda: quantized_attention._few(
            queries, q_keys, q_values, scale, None, group_size, bits), runs)  # fmt: skip
    return {k: round(v, 3) for k, v in ms.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.attention_pass", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--heads", type=int, default=32, help="query heads (Qwen3-8B's)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128, help="each head's size")
    p.add_argument("--rows", default="1,16,64", type=levels_flag, help="batch sizes")
    p.add_argument("--contexts", default="2048,8192,32768", help="keys each row holds")
    p.add_argument("--kv-bits", type=int, default=8, choices=(4, 8), help="the quantized KV's")
    p.add_argument("--kv-group-size", type=int, default=64, choices=KV_GROUP_SIZES,
                   help="the quantization's group size")  # fmt: skip
    p.add_argument("--matmuls", action="store_true",
                   help="mlx's quantized matmuls too (CUDA; elsewhere the pass is theirs)")
    p.add_argument("--runs", type=int, default=5, help=f"timed runs of {PASSES} passes")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    if args.head_dim % args.kv_group_size or args.heads % args.kv_heads:
        p.error("--head-dim must be a multiple of --kv-group-size, and --heads of --kv-heads")
    print(f"{args.heads} query heads over {args.kv_heads} KV heads of {args.head_dim}; the "
          f"quantized pass {'fused' if fused_quantized_attention.AVAILABLE else 'by matmuls'}",
          flush=True)  # fmt: skip
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            ms = measure(args.heads, args.kv_heads, args.head_dim, rows, context, args.kv_bits,
                         args.kv_group_size, args.matmuls, args.runs)  # fmt: skip
            results.append({"rows": rows, "context": context, "ms": ms})
            times = ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
            print(f"{rows:3d} rows x {context:6d} keys: {times}", flush=True)
            mx.clear_cache()
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
