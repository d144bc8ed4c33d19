"""What changing a batch's rows costs, in process (`python -m bench.batch_copies`).

mlx-lm's batch cache keeps every row of a layer in one array: a row leaving
copies the rest (`filter`), one joining copies them all (`extend`), and
lining up rows that speculation left apart copies them all too (`compact`).
Each is timed here on a model's own cache, `--rows` rows of `--context`
tokens, beside writing one row's keys and values in place (a slice update a
layer): what a joining row would cost if it took a leaving row's place.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache

from bench.model import add_model_flags, load_model
from bench.workload import levels_flag
from smg_mlx.engine.speculative.ragged_kv import ragged


def _filled(model: nn.Module, rows: int, context: int) -> list[BatchKVCache]:
    cache = [BatchKVCache([0] * rows) for _ in model.layers]
    tokens = mx.random.randint(0, model.args.vocab_size, (rows, context))
    mx.eval(model(tokens, cache=cache))
    return cache


def _ms(work: Callable[[], None], runs: int) -> float:
    """Milliseconds a run of `work`, each evaluated, after one untimed."""
    work()
    mx.synchronize()
    started = time.perf_counter()
    for _ in range(runs):
        work()
    mx.synchronize()
    return 1e3 * (time.perf_counter() - started) / runs


def _arrays(cache: list) -> list:
    return [(c.keys, c.values) for c in cache]


def measure(model: nn.Module, rows: int, context: int, runs: int) -> dict[str, float]:
    """Each change's milliseconds, over every layer."""
    one = _filled(model, 1, context)
    batch = _filled(model, rows, context)

    def turnover() -> None:
        for c in batch:
            c.filter(list(range(1, rows)))
        mx.eval(_arrays(batch))
        for c, o in zip(batch, one, strict=True):
            c.extend(o)
        mx.eval(_arrays(batch))

    apart = [ragged(c) for c in _filled(model, rows, context)]

    def line_up() -> None:
        for c in apart:
            c.rewind([i % 4 for i in range(rows)])
        for c in apart:
            c.compact()
        mx.eval(_arrays(apart))

    slots = _filled(model, rows, context)

    def in_place() -> None:
        for c, o in zip(slots, one, strict=True):
            c.keys[:1, :, :context, :] = o.keys[..., :context, :]
            c.values[:1, :, :context, :] = o.values[..., :context, :]
        mx.eval(_arrays(slots))

    return {
        "a row leaving and one joining": _ms(turnover, runs),
        "rows lined up": _ms(line_up, runs),
        "a row written in place": _ms(in_place, runs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch_copies", description=__doc__)
    add_model_flags(p)
    p.add_argument("--rows", default="16,32", type=levels_flag, help="batch sizes")
    p.add_argument("--context", type=int, default=300, help="tokens in each row's cache")
    p.add_argument("--runs", type=int, default=8, help="timed runs of each")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    model = load_model(args)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        figures = measure(model, rows, args.context, args.runs)
        print(f"rows {rows:3d}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in figures.items()),
              flush=True)  # fmt: skip
        results.append({"rows": rows, "context": args.context, "ms": figures})
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
