"""Measures what a model costs, at warm-up, on the engine thread (uses MLX).

A formula drifts across backends and kernels (whether attention scores are
materialized, how logits are kept), so the prefill working set is measured:
one prompt at two lengths through mlx-lm's own BatchGenerator, peak memory
each time. The longer one's chunks are timed on a second run, each at a
longer context: what a prompt token costs to prefill, and how that grows
with the context.

Where the attention's working set is known instead (`engine.batch.attention_shapes`
says so on CUDA, where a peak's noise would pass for a slope), only what a
chunk token costs is measured: the larger of the two passes' sets.

The probe is sized to take a couple of seconds: short passes tell
how long a prompt token takes, and a model that is slow on this device (a
large one on a CPU) is measured in smaller chunks, down to SMALLEST_CHUNK
tokens, instead of for minutes. Its prefill working set per chunk token then
comes out larger (what a step costs whatever its size counts for fewer
tokens): an estimate on the safe side.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from smg_mlx.engine.batch.layer_waits import copies_per_key
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.batch.sampling import batch_generator
from smg_mlx.engine.memory.costs import MemoryModel, PrefillSpeed
from smg_mlx.engine.progress import Progress
from smg_mlx.engine.types import LayerCaches
from smg_mlx.logs import format_bytes

log = logging.getLogger(__name__)


# Of a GPU's memory (Metal's recommended working set, CUDA's total), and of the
# host's RAM on the CPU backend, where the OS and other processes share it.
GPU_SHARE = 0.9
HOST_SHARE = 0.75
# A container's memory limit, where Linux has one: cgroup v2's, then v1's.
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)
# The probe's prefill chunk at most, and the context it reaches: four chunks.
PROBE_CHUNK = 256
PROBE_CONTEXT = 1024
SMALLEST_CHUNK = 16
# About how long the probe's prefills may take, told from FIRST_LOOKS short
# passes of FIRST_LOOK_TOKENS; a model too slow for that is probed in the
# smallest chunks.
PROBE_SECONDS = 2.0
FIRST_LOOK_TOKENS = 16
FIRST_LOOKS = 3
# Prompt tokens the probe prefills, in chunks: a prompt of one chunk, one of
# four, and the latter again, timed.
PROBE_CHUNKS = 1 + 2 * PROBE_CONTEXT // PROBE_CHUNK


def host_memory(limits: Iterable[Path] = CGROUP_LIMITS) -> int:
    """The host's RAM, or the container's memory limit where that is smaller."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in limits:
        try:
            limit = path.read_text().strip()
        except OSError:  # no such cgroup file: not Linux, or no limit there
            continue
        if limit.isdigit():  # v2 writes "max" for none; v1 a number past any RAM
            memory = min(memory, int(limit))
    return memory


def device_memory() -> tuple[int, float]:
    """The device's memory in bytes, and the default share of it to budget."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        if info.get(key):
            return int(info[key]), GPU_SHARE
    return host_memory(), HOST_SHARE


def budget(size: int | None, share: float | None) -> tuple[int, str]:
    """Bytes to budget: `size`, or else `share` of the device's memory, or else
    the default share; and where that figure comes from, for the start-up line."""
    memory, default = device_memory()
    if size is None:
        device = (
            "the GPU's memory"
            if default == GPU_SHARE
            else "the host's memory (or its container's limit)"
        )
        named = " (--memory-budget)" if share is not None else ""
        share = default if share is None else share
        percent = f"{100 * share:.1f}".removesuffix(".0")  # (80.5% is not 80%)
        source = f"{percent}%{named} of {device}, {format_bytes(memory)}"
        return int(memory * share), source
    if size > memory:
        log.warning(
            "--memory-budget %s is more than the device has (%s): a worker that grows past "
            "that runs the machine out of memory; give at most that, or a percentage",
            format_bytes(size), format_bytes(memory),
        )  # fmt: skip
    return size, "--memory-budget"


def _one_prompt(
    model: nn.Module, stream: mx.Stream, length: int, chunk: int, progress: Progress,
    caches: LayerCaches,
) -> tuple[int, list[tuple[int, float]]]:  # fmt: skip
    """Peak bytes above what was allocated before, for one prompt of `length`
    tokens prefilled in chunks of `chunk` and one generated token; and each
    full chunk's (context before it, seconds). One prompt more for `progress`."""
    generator = batch_generator(
        model, completion_batch_size=1, prefill_batch_size=1, prefill_step_size=chunk,
        stream=stream,
    )  # fmt: skip
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    generator.insert([[i % 100 + 1 for i in range(length)]], max_tokens=[1], caches=[caches()])
    chunks, done = [], 0
    while True:
        progress.tick()
        started = time.perf_counter()
        prompts, finished = generator.next()
        seconds = time.perf_counter() - started
        processed = next((r.progress[0] for r in prompts if not r.end_of_prompt), done)
        if processed - done == chunk:
            chunks.append((done, seconds))
        done = processed
        if any(r.finish_reason for r in finished):
            break
    peak = mx.get_peak_memory() - before
    generator.close()
    progress.advance()
    return peak, chunks


def _speed(chunks: list[tuple[int, float]], chunk: int) -> PrefillSpeed:
    """Seconds per prompt token, and more per token of context, from chunks
    timed at growing contexts (the fastest at the shortest, the slowest at
    the longest: noise there only makes the estimate err long)."""
    (first, fast), (last, slow) = chunks[0], chunks[-1]
    per_token = min(seconds for _, seconds in chunks) / chunk
    per_context = max(0.0, (slow - fast) / (chunk * (last - first))) if last > first else 0.0
    return PrefillSpeed(per_token, per_context)


def weights(model: nn.Module) -> int:
    """The model's parameters' bytes."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def with_draft(
    found: MemoryModel, draft: nn.Module, stream: mx.Stream, width: float,
    caches: LayerCaches | None = None,
) -> MemoryModel:  # fmt: skip
    """What the model costs with a draft model beside it (engine.speculative):
    its weights, its cache's rows (`caches()`, else its own), which follow
    the model's, and its catch-up passes (`width`: their working set per the
    model's prefill's, as many tokens)."""
    per_token = kv_per_token(draft, stream, caches)
    # The total is what GetServerInfo's kv-bytes-per-token and the planner count.
    log.info(
        "the draft model's KV: %s per token (%s a token with the model's)",
        format_bytes(per_token), format_bytes(found.kv_per_token + per_token),
    )  # fmt: skip
    return replace(
        found,
        weights=found.weights + weights(draft),
        kv_per_token=found.kv_per_token + per_token,
        draft_width=width,
    )


def kv_per_token(model: nn.Module, stream: mx.Stream, caches: LayerCaches | None = None) -> float:
    """KV bytes per token, from the shapes of a prompt cache (`caches()`, or
    else the model's own) after a pass of PROBE_CHUNK tokens (one cache step)
    that is never evaluated: shapes are known before any work is done."""
    return token_bytes(probed_cache(model, stream, caches))


def token_bytes(cache: list) -> float:
    """The bytes a token takes in `cache`, as `probed_cache` leaves it."""
    return sum(c.nbytes for c in cache) / PROBE_CHUNK


def row_bytes(cache: list) -> float:
    """The bytes a running row holds beside its tokens in `cache`, as
    `probed_cache` leaves it: under --kv-bits where the fused kernel reads
    them, its newest positions' 16-bit tail."""
    return float(sum(c.tail_nbytes() for c in cache if isinstance(c, BatchQuantizedKVCache)))


def probed_cache(model: nn.Module, stream: mx.Stream, caches: LayerCaches | None = None) -> list:
    """A prompt cache (`caches()`, or else the model's own) after a pass of
    PROBE_CHUNK tokens, never evaluated."""
    cache = caches() if caches is not None else make_prompt_cache(model)
    with mx.stream(stream):
        model(mx.array([[1] * PROBE_CHUNK]), cache=cache)
    return cache


def _seconds_per_token(model: nn.Module, stream: mx.Stream, caches: LayerCaches) -> float:
    """What a prompt token takes, roughly: a short prompt's pass, the fastest
    of FIRST_LOOKS after a first that builds the shape's kernels (one slow
    look would have a fast model probed in smaller chunks: larger, noisier
    estimates)."""
    tokens = mx.array([[1] * FIRST_LOOK_TOKENS])
    fastest = math.inf
    for look in range(1 + FIRST_LOOKS):
        cache = caches()
        started = time.perf_counter()
        with mx.stream(stream):
            model(tokens, cache=cache)
            mx.eval([c.state for c in cache])
        if look:
            fastest = min(fastest, time.perf_counter() - started)
    return fastest / FIRST_LOOK_TOKENS


def one_row(caches: LayerCaches) -> list:
    """A sequence's fresh caches (`caches()`) as a batch cache of one row."""
    return [layer.merge([layer]) for layer in caches()]


def _probe_chunk(per_token: float, max_chunk: int) -> int:
    """The largest chunk, a power of two, whose probe takes about PROBE_SECONDS."""
    chunk = PROBE_CHUNK
    while chunk > SMALLEST_CHUNK and PROBE_CHUNKS * chunk * per_token > PROBE_SECONDS:
        chunk //= 2
    return min(chunk, max_chunk)


def measure(
    model: nn.Module, stream: mx.Stream, max_chunk: int,
    group: mx.distributed.Group | None = None,
    attention: Callable[[float], tuple[float, float] | None] | None = None,
    caches: LayerCaches | None = None, copied: float = 0.0,
) -> tuple[MemoryModel, PrefillSpeed]:  # fmt: skip
    """The model's weights, KV bytes per token and prefill working set; and
    what prefilling costs in time. With a `group` of ranks (each holding a
    part of the model), every rank probes alike: their passes are collectives.
    `attention`, given the KV bytes per token, tells what a prefill's
    attention holds per query and key, and per key, where it knows. `caches`
    makes a sequence's caches as the rows' are made (--kv-bits; None: the
    model's own). `copied`: where `attention` does not say, the bytes per key
    a prefill's attention copies over all layers (quantized keys and values
    dequantized): held per key, whatever the chunk, not per chunk token."""
    started = time.perf_counter()
    if caches is None:
        caches = passes = partial(make_prompt_cache, model)
    else:
        # The probe's own passes run a batch of one, as rows run: mlx's CUDA
        # quantized matmul refuses the views that mlx-lm's single-sequence
        # quantized cache hands attention.
        passes = partial(one_row, caches)
    held = weights(model)
    probed = probed_cache(model, stream, passes)
    per_kv_token, per_row = token_bytes(probed), row_bytes(probed)
    per_token = _seconds_per_token(model, stream, passes)
    chunk = _probe_chunk(per_token, max_chunk)
    if group is not None:  # each rank timed itself: the slowest one's chunk for all
        chunk = mx.distributed.all_min(mx.array(chunk), group=group, stream=stream).item()
    log.info(
        "measuring the model's memory and speed: prompts of %d tokens in all, about %.1fs",
        PROBE_CHUNKS * chunk, PROBE_CHUNKS * chunk * per_token,
    )  # fmt: skip
    # The working set of the last chunk, the cache aside, at two contexts; then
    # the long one again, timed: a backend's first run of a shape includes
    # building its kernels (cuDNN graphs on CUDA), which no later run pays.
    short, long = chunk + 1, PROBE_CONTEXT // PROBE_CHUNK * chunk + 1
    progress = Progress(log, "memory probe", "prompts", 3)
    spent = {}
    for n in (short, long):
        peak, _ = _one_prompt(model, stream, n, chunk, progress, caches)
        spent[n] = peak - n * per_kv_token
    speed = _speed(_one_prompt(model, stream, long, chunk, progress, caches)[1], chunk)
    known = attention(per_kv_token) if attention is not None else None
    if known is None:
        # The probe's prompts are too short to go a layer at a time
        # (layer_waits): they held every layer's copies, a long prompt those
        # of the layers in flight.
        spent = {n: held - copied * n for n, held in spent.items()}
        per_context = max(0.0, (spent[long] - spent[short]) / (chunk * (long - short)))
        per_chunk_token = max(0.0, spent[short] / chunk - per_context * short)
        per_key = copies_per_key(copied, len(model.layers))
    else:
        per_context, per_key = known
        per_chunk_token = max(0.0, *spent.values()) / chunk
    mx.clear_cache()
    found = MemoryModel(held, per_kv_token, per_chunk_token, per_context, per_key, per_row)
    log_found(found, speed, f"measured in {time.perf_counter() - started:.1f}s")
    return found, speed


def log_found(memory: MemoryModel, speed: PrefillSpeed, how: str) -> None:
    """What the probe found (`how`: measured now, or when)."""
    log.info(
        "prefill: %.3f ms per prompt token, and %.3f us more per token of context",
        speed.per_token * 1e3, speed.per_context * 1e6,
    )  # fmt: skip
    log.info(
        "memory: weights %s, KV %s per token%s, prefill %s per chunk token and %s more per "
        "token of context, %s per key a prompt attends to (%s)",
        format_bytes(memory.weights), format_bytes(memory.kv_per_token),
        f" and {format_bytes(memory.row_bytes)} a running row (its 16-bit tail)"
        if memory.row_bytes else "",
        format_bytes(memory.prefill_per_token), format_bytes(memory.prefill_per_context),
        format_bytes(memory.prefill_row_per_key), how,
    )  # fmt: skip
