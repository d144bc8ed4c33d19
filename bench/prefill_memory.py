"""What a long prefill chunk holds beside the KV cache (`python -m bench.prefill_memory`).

In process, no server: a prompt of `--context` tokens is prefilled in chunks
of `--chunk` into a batch cache of one row (the model's own KV, then each of `--kv-bits`),
and the next chunk is timed with its peak memory above what the KV cache
grows by. Each runs with the worker's layer waits (`engine.batch.layer_waits`)
and with the pass recorded whole, alternately, twice. A burst of 8 fresh
prompts of 64 tokens (several rows: a masked pass) is timed both ways too,
the median of 20 passes. On mlx's CUDA backend the worker's attention shapes
are installed, as the worker installs them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from bench.model import add_model_flags, ensure_model, quantizable
from smg_mlx.config import EngineConfig
from smg_mlx.engine.batch import kv_format, layer_waits, quantized_attention
from smg_mlx.engine.batch.attention_shapes import AttentionShapes, shapes_build
from smg_mlx.engine.memory.probe import kv_per_token, one_row

BURST_ROWS, BURST_TOKENS, BURST_PASSES = 8, 64, 20


def measure(model: nn.Module, fresh: Callable[[], list], per_token: float, context: int,
            chunk: int) -> dict:  # fmt: skip
    """One long chunk's time and peak memory above its KV; a burst's pass time."""
    cache = one_row(fresh)
    tokens = mx.array([[i % 1000 + 1 for i in range(context + chunk)]])
    for start in range(0, context, chunk):
        model(tokens[:, start : start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    model(tokens[:, context:], cache=cache)
    mx.eval([c.state for c in cache])
    seconds = time.perf_counter() - started
    above = mx.get_peak_memory() - before - chunk * per_token
    del cache
    burst = mx.array([[i % 900 + 1 for i in range(BURST_TOKENS)]] * BURST_ROWS)
    passes = []
    for _ in range(BURST_PASSES):
        rows = [layer.merge([layer] * BURST_ROWS) for layer in fresh()]
        mx.synchronize()
        started = time.perf_counter()
        model(burst, cache=rows)
        mx.eval([c.state for c in rows])
        passes.append(time.perf_counter() - started)
    return {
        "chunk_ms": 1e3 * seconds, "peak_above_kv_bytes": above,
        "peak_above_kv_per_key": above / (context + chunk),
        "burst_pass_ms": 1e3 * statistics.median(passes),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_memory", description=__doc__)
    add_model_flags(p)
    p.add_argument("--context", type=int, default=28672, help="tokens before the timed chunk")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--kv-bits", default="8",
                   help="quantized formats besides the model's own KV ('' for none)")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    path = args.model or ensure_model(args.shape, args.work_dir)
    from mlx_lm import load  # (as bench.model.load_model)

    model = load(str(path))[0]
    stream = mx.new_stream(mx.default_device())
    mx.set_default_stream(stream)
    shapes = None
    if shapes_build():
        shapes = AttentionShapes(args.chunk)
        shapes.install()
    quantized_attention.install(shapes)
    waits = layer_waits.WAIT_KEYS
    results = []
    quantized = [b for b in (int(b) for b in args.kv_bits.split(",") if b)
                 if quantizable(model, b, EngineConfig.kv_group_size, "--kv-bits '' for the "
                                "model's own KV alone, or a model whose heads the group size "
                                "divides: --model, --shape")]  # fmt: skip
    for bits in [None, *quantized]:
        config = EngineConfig(model_path=path, kv_bits=bits)
        caches = kv_format.caches_for(config, model)
        fresh = caches if caches is not None else lambda: make_prompt_cache(model)
        per_token = kv_per_token(model, stream, partial(one_row, fresh))
        for waited in (False, True, False, True):
            layer_waits.WAIT_KEYS = waits if waited else sys.maxsize
            r = measure(model, fresh, per_token, args.context, args.chunk)
            r.update(kv_bits=bits, layer_waits=waited, kv_per_token=per_token)
            results.append(r)
            kv = f"{bits}-bit KV" if bits else "the model's own KV"
            print(f"{kv}, {'layer by layer' if waited else 'recorded whole'}: "
                  f"{args.chunk} tokens over {args.context}: {r['chunk_ms']:.0f} ms, peak above "
                  f"the KV {r['peak_above_kv_bytes'] / 2**20:.0f} MiB "
                  f"({r['peak_above_kv_per_key'] / 1024:.1f} KiB a key, the KV "
                  f"{per_token / 1024:.1f} KiB a token); a burst of {BURST_ROWS} x "
                  f"{BURST_TOKENS}: {r['burst_pass_ms']:.2f} ms a pass", flush=True)  # fmt: skip
    layer_waits.WAIT_KEYS = waits
    if args.out is not None:
        args.out.write_text(json.dumps({"command": sys.argv, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
