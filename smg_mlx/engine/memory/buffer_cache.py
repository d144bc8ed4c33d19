"""MLX's buffer cache kept through mlx-lm's passes on CUDA (engine thread only).

mlx-lm empties MLX's buffer cache after every prefill chunk (`mx.clear_cache`).
On mlx's CUDA backend that hands the buffers back to the driver, and the next
pass allocates every one of them anew: at long context a pass then takes up
to twice its compute, and the passes that move a prompt into the decoding
rows several times theirs. Inside `kept()` those calls leave the cache as it
is, within its limit (`bound`); MLX's allocator also frees
cached buffers before any allocation that would pass its memory limit.
Elsewhere (Metal, where a Mac's other programs share the memory; the engine's
own clears) a clear is a clear.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from smg_mlx.engine.memory.planner import Cost, MemoryPlanner


def _skipped() -> None:
    """mlx-lm's clear of the buffer cache, inside `kept()`."""


@contextmanager
def kept() -> Iterator[None]:
    """mlx-lm's calls inside leave MLX's buffer cache as it is (it calls
    `mx.clear_cache` by module attribute)."""
    clear = mx.clear_cache
    mx.clear_cache = _skipped
    try:
        yield
    finally:
        mx.clear_cache = clear


def bound(planner: MemoryPlanner) -> int:
    """Hold MLX's buffer cache to the working set the budget counts for one
    full prefill chunk at short context: what a pass frees for the next one,
    while the batch and the prefix cache fill the budget. (Larger, the
    allocator would free cached buffers before most allocations there.)
    Returns the limit before."""
    chunk = planner.max_chunk
    working_set = planner.prefill_bytes([Cost(chunk, chunk, chunk)], chunk)
    return mx.set_cache_limit(int(working_set))
