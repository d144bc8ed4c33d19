"""Rows that end together leave the batch as one block, each row a view of it."""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache

from smg_mlx.engine.batch import quantized_kv
from smg_mlx.engine.batch.ended_rows import (
    EndedRow,
    EndingGenerationBatch,
    SharedBlocks,
    Snapshot,
    copied_out,
)
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier
from smg_mlx.engine.speculative.ragged_kv import ragged

PADDING = [0, 2, 1, 0, 3, 0]


def _batch(layers: int = 3) -> list[BatchKVCache]:
    cache = []
    for _ in range(layers):
        layer = BatchKVCache(list(PADDING))
        keys = mx.random.normal((len(PADDING), 2, 6, 4))
        layer.update_and_fetch(keys, -keys)
        cache.append(layer)
    return cache


def _row(cache: list[BatchKVCache], place: int) -> list[np.ndarray]:
    """What the row at `place` holds, after its padding, every layer."""
    pad, end = PADDING[place], cache[0]._idx
    return [np.array(a[place, :, pad:end]) for c in cache for a in (c.keys, c.values)]


def _held(layers: list) -> list[np.ndarray]:
    return [np.array(a[0, :, : c.offset]) for c in layers for a in (c.keys, c.values)]


def test_rows_ending_together_share_a_block_until_it_is_mostly_unused():
    cache = _batch()
    want = {p: _row(cache, p) for p in range(len(PADDING))}
    taken = Snapshot.of(cache)
    places = [0, 1, 2, 3]
    out, blocks = copied_out([EndedRow(taken, p, PADDING[p]) for p in places])
    # a row joining writes into the cache afterwards: the rows are as they were
    for layer in cache:
        layer.keys[1] = 0.0
    for place, layers in zip(places, out, strict=True):
        assert [c.offset for c in layers] == [6 - PADDING[place]] * 3
        for got, expected in zip(_held(layers), want[place], strict=True):
            np.testing.assert_array_equal(got, expected)
    block = blocks[0]
    assert block is not None and all(b is block for b in blocks)
    # the block: places 0-3, from the smallest padding, 3 layers' keys and values
    assert block.nbytes == 3 * 2 * (4 * 2 * 6 * 4 * 4)

    memory = MemoryTier()
    shared = SharedBlocks(memory)
    tokens = [[place + 1] * (6 - PADDING[place]) for place in places]
    entries = [memory.insert(t, layers)[0] for t, layers in zip(tokens, out, strict=True)]
    shared.add(list(zip(entries, out, blocks, strict=True)))
    assert not shared.tend()  # nothing left
    kept = sum(e.nbytes for e in entries)
    assert shared.waste == block.nbytes - kept > 0  # the padding the rows leave out
    memory.drop([entries[0].id])
    assert shared.tend() and shared.waste == block.nbytes - kept + entries[0].nbytes
    memory.drop([entries[1].id, entries[2].id])  # under half of it kept: copied out
    assert shared.tend() and shared.waste == 0
    memory.drop([entries[3].id])  # its own arrays now: nothing of a block left
    assert not shared.tend() and shared.waste == 0
    for got, expected in zip(_held(out[3]), want[3], strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_row_alone_or_rows_far_apart_get_arrays_of_their_own():
    cache = _batch()
    taken = Snapshot.of(cache)
    for places in ([3], [0, 5], [1, 4]):
        out, blocks = copied_out([EndedRow(taken, p, PADDING[p]) for p in places])
        assert blocks == [None] * len(places)
        for place, layers in zip(places, out, strict=True):
            for got, expected in zip(_held(layers), _row(cache, place), strict=True):
                np.testing.assert_array_equal(got, expected)


def test_quantized_rows_ending_together_share_a_block_each_row_as_extract_gives_it(monkeypatch):
    """--kv-bits: rows a pass ends come out as one block a layer part too
    (each row alone: six copies a layer), their decoding tail quantized in as
    they are copied: the batch's buffers, which the pass in flight reads, are
    not written (each write would copy a whole buffer first)."""
    monkeypatch.setattr(quantized_kv, "TAILS", True)
    cache = []
    for _ in range(3):
        layer = BatchQuantizedKVCache(list(PADDING), group_size=32, bits=8)
        prompt = mx.random.normal((len(PADDING), 2, 6, 64))
        layer.update_and_fetch(prompt, -prompt)
        step = mx.random.normal((len(PADDING), 2, 1, 64))
        layer.update_and_fetch(step, 2 * step)  # a decoding pass: into the 16-bit tail
        cache.append(layer)
    assert cache[0]._tailed == 1
    places = [0, 1, 2, 3]
    taken = Snapshot.of(cache)
    out, blocks = copied_out([EndedRow(taken, p, PADDING[p]) for p in places])
    (alone,), _ = copied_out([EndedRow(taken, 2, PADDING[2])])
    assert all(c._tailed == 1 for c in cache)
    block = blocks[0]
    assert block is not None and all(b is block for b in blocks)
    for got, expected in zip(alone, out[2], strict=True):
        for a, b in zip((*got.keys, *got.values), (*expected.keys, *expected.values), strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    for place, layers in zip(places, out, strict=True):
        want = [c.extract(place, PADDING[place]) for c in cache]
        for got, expected in zip(layers, want, strict=True):
            assert isinstance(got, QuantizedKVCache)
            assert (got.group_size, got.bits, got.offset) == (32, 8, 7 - PADDING[place])
            for a, b in zip((*got.keys, *got.values), (*expected.keys, *expected.values),
                            strict=True):  # fmt: skip
                np.testing.assert_array_equal(np.array(a), np.array(b))
    memory = MemoryTier()
    shared = SharedBlocks(memory)
    tokens = [[place + 1] * (7 - PADDING[place]) for place in places]
    entries = [memory.insert(t, layers)[0] for t, layers in zip(tokens, out, strict=True)]
    shared.add(list(zip(entries, out, blocks, strict=True)))
    memory.drop([entries[0].id, entries[1].id, entries[2].id])  # under half kept: copied out
    assert shared.tend() and shared.waste == 0
    assert all(isinstance(c.keys, tuple) and len(c.keys) == 3 for c in out[3])


def test_a_block_mostly_unkept_from_the_start_goes_at_once():
    """Rows the cache holds already (in longer entries) are not kept again:
    the one row kept beside them keeps no block of theirs alive."""
    cache = _batch()
    taken = Snapshot.of(cache)
    places = [0, 1, 2, 3]
    out, blocks = copied_out([EndedRow(taken, p, PADDING[p]) for p in places])
    memory = MemoryTier()
    shared = SharedBlocks(memory)
    tokens = [3] * (6 - PADDING[3])
    entry, _ = memory.insert(tokens, out[3])
    shared.add([(None, out[0], blocks[0]), (None, out[1], blocks[1]),
                (None, out[2], blocks[2]), (entry, out[3], blocks[3])])  # fmt: skip
    assert shared.waste == 0
    assert all(not block.rows for block in blocks)
    for got, expected in zip(_held(out[3]), _row(cache, 3), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_a_snapshot_holds_the_rows_as_they_were_and_copies_no_more_than_they_take():
    """A snapshot is taken as rows end; rows joining write into the cache before
    the ended rows are copied out. Those rows are as they were, and copying one
    out costs about its own bytes: not a copy of every layer's whole buffer."""
    cache = _batch(layers=4)
    for layer in cache:  # a longer cache, so that a row is a small part of it
        keys = mx.random.normal((len(PADDING), 2, 250, 4))
        layer.update_and_fetch(keys, -keys)
    mx.eval([(c.keys, c.values) for c in cache])
    pad, end = PADDING[4], cache[0]._idx
    want = [np.array(a[4, :, pad:end]) for c in cache for a in (c.keys, c.values)]
    taken = Snapshot.of(cache)
    for layer in cache:  # written before the ended row is copied
        layer.keys[4] = 0.0
        layer.values[4] = 0.0
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    (layers,), _ = copied_out([EndedRow(taken, 4, pad)])
    mx.eval([(c.keys, c.values) for c in layers])
    for got, expected in zip(_held(layers), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    row = sum(c.keys.nbytes + c.values.nbytes for c in layers)
    batch = sum(a.nbytes for c in cache for a in (c.keys, c.values))
    assert row < batch / 4
    assert mx.get_peak_memory() - before < 2 * row


def test_rows_of_a_ragged_cache_come_out_to_their_own_ends_without_reading_the_device():
    """Speculative decoding's rows end apart (`ragged_kv`): each ended row is
    taken from a snapshot, to its own end, alone or in a block, as mlx-lm's
    extract gives it (which reads the padding back from the device, waiting
    for the pass in flight: the ragged cache's rows are not copied so)."""
    cache = [ragged(layer) for layer in _batch()]
    back = [0, 2, 1, 0, 3, 1]
    for layer in cache:
        layer.rewind(back)
    ends = [6 - n for n in back]
    assert cache[0]._ends == ends
    want = {p: [np.array(a[p, :, PADDING[p] : ends[p]]) for c in cache for a in (c.keys, c.values)]
            for p in range(len(PADDING))}  # fmt: skip
    batch = EndingGenerationBatch.start(None, None)
    batch.prompt_cache = cache
    batch.tokens = [[1] * (e - p) for e, p in zip(ends, PADDING, strict=True)]
    rows = [batch.extract_cache(p) for p in range(len(PADDING))]
    assert all(isinstance(r, EndedRow) for r in rows)
    assert [r.padding for r in rows] == PADDING
    for places in ([0, 1, 2, 3], [4], [1, 5]):
        out, _ = copied_out([rows[p] for p in places])
        for place, layers in zip(places, out, strict=True):
            assert [c.offset for c in layers] == [ends[place] - PADDING[place]] * 3
            for got, expected in zip(_held(layers), want[place], strict=True):
                np.testing.assert_array_equal(got, expected)
