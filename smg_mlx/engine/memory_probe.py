"""Measures what a model costs in memory, at warm-up, on the engine thread (uses MLX).

A formula drifts across backends and kernels (whether attention scores are
materialized, how logits are kept), so the prefill working set is measured:
one prompt at two lengths through mlx-lm's own BatchGenerator, peak memory
each time.
"""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from smg_mlx.engine.memory import MemoryModel, format_bytes

log = logging.getLogger(__name__)

# Of a GPU's memory (Metal's recommended working set, CUDA's total), and of the
# host's RAM on the CPU backend, where the OS and other processes share it.
GPU_SHARE = 0.9
HOST_SHARE = 0.75
PROBE_CHUNK = 256
PROBE_CONTEXT = 1024


def device_memory() -> tuple[int, float]:
    """The device's memory in bytes, and the default share of it to budget."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        if info.get(key):
            return int(info[key]), GPU_SHARE
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), HOST_SHARE


def budget(size: int | None, share: float | None) -> int:
    """Bytes to budget: `size`, or else `share` of the device's memory, or else
    the default share."""
    if size is not None:
        return size
    memory, default = device_memory()
    return int(memory * (default if share is None else share))


def _peak_of_one_prompt(model: nn.Module, stream: mx.Stream, length: int, chunk: int) -> int:
    """Peak bytes above what was allocated before, for one prompt of `length`
    tokens prefilled in chunks of `chunk` and one generated token."""
    generator = BatchGenerator(
        model, completion_batch_size=1, prefill_batch_size=1, prefill_step_size=chunk,
        stream=stream,
    )  # fmt: skip
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    generator.insert([[i % 100 + 1 for i in range(length)]], max_tokens=[1])
    while not any(r.finish_reason for r in generator.next()[1]):
        pass
    peak = mx.get_peak_memory() - before
    generator.close()
    return peak


def measure(model: nn.Module, stream: mx.Stream, max_chunk: int) -> tuple[MemoryModel, float]:
    """The model's weights, KV bytes per token and prefill working set; and the
    seconds one prompt token took to prefill."""
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    cache = make_prompt_cache(model)
    with mx.stream(stream):
        model(mx.array([[1] * PROBE_CHUNK]), cache=cache)
        mx.eval([c.state for c in cache])
    kv_per_token = sum(c.nbytes for c in cache) / PROBE_CHUNK
    del cache
    chunk = min(PROBE_CHUNK, max_chunk)
    # The working set of the last chunk, the cache aside, at two contexts.
    short, long = chunk, max(PROBE_CONTEXT, 2 * chunk)
    started = time.perf_counter()
    spent = {
        n: _peak_of_one_prompt(model, stream, n, chunk) - n * kv_per_token for n in (short, long)
    }
    per_token = (time.perf_counter() - started) / (short + long)
    per_context = max(0.0, (spent[long] - spent[short]) / (chunk * (long - short)))
    per_chunk_token = max(0.0, spent[short] / chunk - per_context * short)
    mx.clear_cache()
    found = MemoryModel(weights, kv_per_token, per_chunk_token, per_context)
    log.info(
        "memory: weights %s, KV %s per token, prefill %s per chunk token and %s more per "
        "token of context",
        format_bytes(weights), format_bytes(kv_per_token), format_bytes(per_chunk_token),
        format_bytes(per_context),
    )  # fmt: skip
    return found, per_token
