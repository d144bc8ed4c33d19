"""A row joining a lane (`engine.batch.batch_kv.stacked_rows`), on the CPU: every
row keeps its entries, and the lane's cache is in memory at most twice while
it happens (its old buffer and the new one), not three times."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from smg_mlx.engine.batch import batch_kv  # noqa: F401 - installs the extend under test
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache

GROUP = 64


def _rows(lengths: list[int], bits: int | None) -> tuple[list, list[mx.array]]:
    """Single-sequence caches of random keys (values their negation), and the keys."""
    caches, keys = [], []
    for seed, n in enumerate(lengths):
        k = mx.random.normal((1, 2, n, GROUP), key=mx.random.key(seed))
        cache = KVCache() if bits is None else QuantizedKVCache(group_size=GROUP, bits=bits)
        cache.update_and_fetch(k, -k)
        caches.append(cache)
        keys.append(k)
    return caches, keys


def _merged(caches: list, bits: int | None) -> BatchKVCache | BatchQuantizedKVCache:
    return (BatchKVCache if bits is None else BatchQuantizedKVCache).merge(caches)


def _arrays(cache: BatchKVCache | BatchQuantizedKVCache) -> list[mx.array]:
    parts = (cache.keys, cache.values)
    return [a for p in parts for a in (p if isinstance(p, tuple) else (p,))]


def _row_keys(cache: BatchKVCache | BatchQuantizedKVCache, row: int, n: int) -> mx.array:
    end = cache._idx
    if isinstance(cache, BatchQuantizedKVCache):
        parts = tuple(a[row : row + 1, :, end - n : end] for a in cache.keys)
        return mx.dequantize(*parts, group_size=GROUP, bits=cache.bits)
    return cache.keys[row : row + 1, :, end - n : end]


@pytest.mark.parametrize("length", [1500, 500], ids=["longer: the lane shifts", "shorter"])
@pytest.mark.parametrize("bits", [None, 8], ids=["16-bit", "8-bit"])
def test_a_row_joining_a_lane_keeps_every_row_and_the_lane_at_most_twice_in_memory(
    bits, length
):
    lengths = [700, 900, 800]
    lane_rows, lane_keys = _rows(lengths, bits)
    joining_rows, joining_keys = _rows([length], bits)
    lane, joining = _merged(lane_rows, bits), _merged(joining_rows, bits)
    mx.eval(_arrays(lane), _arrays(joining))
    lane_bytes = sum(a.nbytes for a in _arrays(lane))
    del lane_rows, joining_rows
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    lane.extend(joining)
    mx.eval(_arrays(lane))
    rise = mx.get_peak_memory() - before
    new_bytes = sum(a.nbytes for a in _arrays(lane))
    # The new buffer, and not a padded copy of the lane's besides.
    assert rise < new_bytes + lane_bytes / 2, (rise, new_bytes, lane_bytes)
    every = [*lengths, length]
    end = max(every)
    assert lane._idx == end and lane.offset.tolist() == every
    assert lane.left_padding.tolist() == [end - n for n in every]
    for row, (n, keys) in enumerate(zip(every, lane_keys + joining_keys, strict=True)):
        got = _row_keys(lane, row, n)
        if bits is None:
            assert mx.array_equal(got, keys).item()
        else:  # quantized once, on the way in: the same as that row's own cache's
            assert mx.allclose(got, keys, atol=0.05).item()
