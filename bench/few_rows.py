"""A linear layer's product of a few rows, mlx's against the worker's few-row
kernel (`python -m bench.few_rows`, CUDA only): microseconds a product, the
device's time (`attention_pass.device_ms`: products of one shape queued
before a wait), for the shapes of Llama-8B's and Qwen3-0.6B's layers. Where ours
is the faster is where `few_rows_matmul.MOST_ROWS` lets it take a product."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (in, out): Llama-8B's q/o, k/v, gate/up, down, lm_head; Qwen3-0.6B's.
SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256),
          (1024, 2048), (1024, 1024), (1024, 3072), (3072, 1024), (1024, 151936)]  # fmt: skip
RUNS = 5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.few_rows", description=__doc__)
    p.add_argument("--rows", default="1,2,4,5,8,9,16", help="input rows, comma-separated")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    import mlx.core as mx

    from bench.attention_pass import device_ms
    from smg_mlx.engine.batch import few_rows_matmul as few

    if not few.AVAILABLE:
        print("the few-row kernel is CUDA's: this machine has no CUDA device", file=sys.stderr)
        return 1
    results = []
    for k, n in SHAPES:
        w = (mx.random.normal((n, k)) / k**0.5).astype(mx.bfloat16)
        said = [f"{k:>5} -> {n:<6}"]
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            theirs = 1e3 * device_ms(lambda x=x, w=w: x @ w.T, RUNS)
            ours = (1e3 * device_ms(lambda x=x, w=w: few.matmul(x, w), RUNS)
                    if rows >= few.LEAST_ROWS else None)  # fmt: skip
            taken = few.LEAST_ROWS <= rows <= few.most_rows(w.size)
            results.append({"in": k, "out": n, "rows": rows, "mlx_us": theirs, "ours_us": ours,
                            "taken": taken})  # fmt: skip
            mine = "-" if ours is None else f"{ours:.0f}{'*' if taken else ''}"
            said.append(f"{rows}: {theirs:.0f}/{mine}")
        print("  ".join(said), flush=True)
    print("(rows: mlx's/ours, microseconds a product; * where the worker takes ours)")
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
