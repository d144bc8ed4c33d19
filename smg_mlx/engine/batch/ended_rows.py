"""What rows that end leave, copied out of the batch cache (engine thread only).

A row's keys and values copied out of its batch take a copy a layer array:
on a GPU each costs the host more (building the op, launching its kernel)
than the bytes it moves, paid between passes for every row that ends (under
load, most turns). So the rows one pass ends, where they lie close together
in the batch, are copied out as one block a layer array, each row a view of
it (`copied_out`). A block
is memory as long as one of its rows is kept: the memory beyond its kept
rows is counted beside them (`SharedBlocks.waste`), and once its kept rows
fill less than half of it they are copied into arrays of their own and the
block goes (`SharedBlocks.tend`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from smg_mlx.engine.batch import batch_kv  # noqa: F401 - its filter takes a known padding
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier
from smg_mlx.engine.prefix_cache.token_tree import Entry
from smg_mlx.engine.speculative.ragged_kv import (
    Ragged,
    RaggedBatchKVCache,
    RaggedBatchQuantizedKVCache,
)

# Batch caches whose filter takes the padding its rows share, known from their tokens.
KNOWN_PADDING = (BatchKVCache, BatchQuantizedKVCache)
# Batch caches whose ended rows are taken from a snapshot (`EndedRow`); the
# ragged ones' rows (speculative decoding's) end each at its own column. Any
# other's are copied out by mlx-lm, which reads the padding back from the
# device: that waits for the pass in flight.
SNAPSHOT = (*KNOWN_PADDING, RaggedBatchKVCache, RaggedBatchQuantizedKVCache)
# Rows a pass ends are copied out as a block where they are at least two and
# span at most this many places a row (the places between, rows still
# running or holes, are copied too).
SPAN_PER_ROW = 1.5


@dataclass(eq=False)
class Snapshot:
    """A batch cache's arrays as a pass left them: later writes into the
    cache (rows joining in the same call) change its arrays, not these."""

    arrays: list[list[mx.array]]  # each layer's: keys then values (quantized: 3 parts each)
    end: int  # the column where every row's entries end (ragged: the furthest)
    quantized: tuple[int, int] | None = None  # (group size, bits); None: 16-bit
    # Quantized: each layer's 16-bit tail (keys, values), its positions after
    # the `arrays`' (which end at `end` less theirs); None: no positions there.
    tails: list[tuple[mx.array, mx.array]] | None = None
    # Where each place's entries end, where rows end apart (a ragged cache); None: at `end`.
    ends: list[int] | None = None

    def end_of(self, place: int) -> int:
        return self.end if self.ends is None else self.ends[place]

    @classmethod
    def of(cls, cache: list[BatchKVCache] | list[BatchQuantizedKVCache]) -> Snapshot:
        # a[:]: a view of a's present value, its buffer shared. A write into the
        # cache replaces the cache's array, not this one, and copies the buffer
        # only while a view holds it (mx.array(a) would copy every layer's whole
        # buffer, for every row's end).
        first = cache[0]
        if isinstance(first, BatchQuantizedKVCache):
            # The tail is not flushed into the buffers: the pass in flight reads
            # them, so each write would copy a whole buffer first, and the rows
            # ending are quantized alone as they are copied out (`copied`).
            arrays = [[a[:] for a in (*c.keys, *c.values)] for c in cache]
            tailed = first._tailed
            tails = [tuple(t[:, :, :tailed] for t in c._tail) for c in cache] if tailed else None
            quantized = (first.group_size, first.bits)
            return cls(arrays, first._idx + tailed, quantized, tails, _apart(first))  # type: ignore[arg-type]
        return cls([[c.keys[:], c.values[:]] for c in cache], first._idx, ends=_apart(first))

    def copied(self, layer: int, rows: slice, start: int, end: int) -> list[mx.array]:
        """Layer `layer`'s arrays for `rows`, from column `start` to `end`, in
        arrays of their own (a tail's positions quantized as a flush would:
        a cache with a tail has every row ending at `self.end`)."""
        arrays = self.arrays[layer]
        if self.tails is None:
            return [mx.contiguous(a[rows, :, start:end]) for a in arrays]
        group_size, bits = self.quantized  # type: ignore[misc]
        quantized = [mx.quantize(t[rows], group_size=group_size, bits=bits)
                     for t in self.tails[layer]]  # fmt: skip
        written = self.end - self.tails[layer][0].shape[2]  # (the quantized columns')
        return [
            mx.concatenate([a[rows, :, start:written], t], axis=2)
            for a, t in zip(arrays, [*quantized[0], *quantized[1]], strict=True)
        ]


def _apart(cache: Any) -> list[int] | None:
    """Where each place of a ragged cache ends, if its rows end apart."""
    return list(cache._ends) if isinstance(cache, Ragged) and cache._ends is not None else None


@dataclass(eq=False)
class EndedRow:
    """A row of a batch cache (16-bit or quantized) that ended or left, where
    it lies in a snapshot of the cache (rows a pass ended share theirs)."""

    snapshot: Snapshot
    place: int
    padding: int  # the columns before its entries

    @property
    def end(self) -> int:
        return self.snapshot.end_of(self.place)


class _NoStop:
    """A stop matcher that never matches (a joining row's prompt token)."""

    @staticmethod
    def advance(token: int) -> bool:
        return False


_NO_STOP = _NoStop()


class EndingGenerationBatch(GenerationBatch):
    """mlx-lm's decoding rows, where a row that ends or leaves hands over
    where it lies in the cache (`EndedRow`) instead of a copy (`copied_out`),
    and the rows left are filtered without waiting for the pass in flight."""

    # In a pass, the cache as it left it once a row it ended asked (the rest share it)
    _snapshots: list[Snapshot] | None
    _joining: set[int]  # rows whose pending input is their prompt's last token (`join`)

    @classmethod
    def start(cls, model: nn.Module, sampler: Any) -> Any:
        """An empty batch, as a lane's BatchGenerator starts with."""
        batch = cls.empty(model, sampler)
        batch._next_tokens = None  # not uint32: see sampling.batch_generator
        batch._snapshots = None
        batch._joining = set()
        return batch

    def join(self, rows: GenerationBatch) -> None:
        """Rows whose prompts are prefilled but for their last token, their
        pending input: the next pass runs it beside the other rows' and
        samples their first tokens, returning nothing for them (`engine.batch.joining`)."""
        self.extend(rows)
        self._joining.update(rows.uids)

    def _joined(self) -> list[int]:
        """The rows joining in the pass about to run, by index; none after it."""
        joining, self._joining = self._joining, set()
        return [i for i, uid in enumerate(self.uids) if uid in joining]

    def next(self) -> list:
        self._snapshots = []
        try:
            return self._decode()
        finally:
            self._snapshots = None

    def _decode(self) -> list:
        """One pass over the rows (mlx-lm's); rows joining return nothing from it."""
        joining = self._joined()
        if not joining:
            return GenerationBatch.next(self)
        uids = {self.uids[i] for i in joining}
        for i in joining:  # their input is a prompt token: neither counted nor matched
            self._num_tokens[i] -= 1
            self._matchers[i] = _NO_STOP
        responses = GenerationBatch.next(self)
        for i, uid in enumerate(self.uids):
            if uid in uids:
                self._matchers[i] = self.stop_sequences[i].matcher()
        return [r for r in responses if r.uid not in uids]

    def extract_cache(self, idx: int) -> list[Any] | EndedRow:
        return self._ended(idx, idx)

    def filter(self, keep: list[int]) -> None:
        cache = self.prompt_cache
        if not keep or not cache or any(type(c) not in KNOWN_PADDING for c in cache):
            super().filter(keep)
            return
        # The padding every row kept has: the least of theirs (see `_ended`).
        padding = min(self._padding(i) for i in keep)
        rows = slice(None) if keep == list(range(len(self.uids))) else mx.array(keep)
        with self._rows_only():
            super().filter(keep)
        for c in cache:
            c.filter(rows, padding)

    def _padding(self, idx: int) -> int:
        """Row `idx`'s padding, from its tokens, which its cache holds: reading
        the cache's would wait for the pass on the device."""
        return self.prompt_cache[0].size() - len(self.tokens[idx])

    @contextmanager
    def _rows_only(self) -> Iterator[None]:
        """mlx-lm's bookkeeping of the rows, with its copies of the cache left out."""
        cache, self.prompt_cache = self.prompt_cache, []
        try:
            yield
        finally:
            self.prompt_cache = cache

    def _ended(self, idx: int, place: int) -> list[Any] | EndedRow:
        """Row `idx`, at `place` in the cache."""
        cache = self.prompt_cache
        if not cache or any(type(c) not in SNAPSHOT for c in cache):
            return [c.extract(place) for c in cache]
        if self._snapshots is None:  # (not in a pass: a row leaving)
            taken = Snapshot.of(cache)
        else:
            if not self._snapshots:
                self._snapshots.append(Snapshot.of(cache))
            taken = self._snapshots[0]
        # (its entries end its tokens: those before them are its padding)
        return EndedRow(taken, place, taken.end_of(place) - len(self.tokens[idx]))


@dataclass(eq=False)
class Block:
    """Rows' keys and values copied out of a batch together."""

    nbytes: int = 0
    kept: int = 0  # bytes of its rows the prefix cache keeps
    rows: dict[int, list[KVCache]] = field(default_factory=dict)  # those rows, by entry id


class SharedBlocks:
    """The blocks whose rows the prefix cache keeps (`tend` after it changes)."""

    def __init__(self, memory: MemoryTier | None) -> None:
        self._memory = memory
        if memory is not None:
            memory.departed = []
        self._blocks: dict[int, Block] = {}  # each kept row's, by entry id
        self.waste = 0  # bytes the blocks hold beyond their kept rows

    def add(self, kept: Sequence[tuple[Entry | None, list[KVCache], Block | None]]) -> None:
        """Rows the prefix cache was given, as `copied_out` made them (their
        entries, None where not kept). A block less than half kept from the
        start (rows the cache already held, in longer entries, are not kept
        again) goes at once."""
        blocks = {}
        for entry, layers, block in kept:
            if entry is not None and block is not None:
                block.rows[entry.id] = layers
                block.kept += entry.nbytes
                self._blocks[entry.id] = blocks[id(block)] = block
        self.waste += sum(block.nbytes - block.kept for block in blocks.values())
        self._release(blocks.values())

    def tend(self) -> bool:
        """Forget rows whose entries left the cache, and let go of blocks
        now less than half kept; whether the memory held changed."""
        departed = self._memory.departed if self._memory is not None else None
        if not departed:
            return False
        self._memory.departed = []
        touched = {}
        for entry in departed:
            block = self._blocks.pop(entry.id, None)
            if block is not None:
                del block.rows[entry.id]
                block.kept -= entry.nbytes
                self.waste += entry.nbytes
                touched[id(block)] = block
        self._release(touched.values())
        return bool(touched)

    def _release(self, blocks: Iterable[Block]) -> None:
        """Copy the kept rows of each block less than half kept into arrays
        of their own (without waiting), so that the block goes."""
        copied = []
        for block in blocks:
            if 2 * block.kept >= block.nbytes:
                continue
            self.waste -= block.nbytes - block.kept
            for entry_id, layers in block.rows.items():
                del self._blocks[entry_id]
                for layer in layers:
                    layer.keys, layer.values = (
                        _contiguous(layer.keys), _contiguous(layer.values)
                    )  # fmt: skip
                    copied += [layer.keys, layer.values]
            block.rows.clear()
        mx.async_eval(copied)


def copied_out(
    caches: Sequence[list[Any] | EndedRow],
) -> tuple[list[list[Any]], list[Block | None]]:
    """Each row's layer caches (lists, as other caches gave them, pass
    through), sent to the device without waiting, and the block each views
    (None: arrays of its own)."""
    out: list[list[Any]] = [c if isinstance(c, list) else [] for c in caches]
    blocks: list[Block | None] = [None] * len(caches)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(caches):
        if isinstance(c, EndedRow):
            groups.setdefault(id(c.snapshot), []).append(i)
    # (others' lazy copies too: they would keep the batch's arrays alive)
    scheduled: list[Any] = [layer.state for c in caches if isinstance(c, list) for layer in c]
    for members in groups.values():
        rows = [caches[i] for i in members]
        taken = rows[0].snapshot
        places = [r.place for r in rows]
        low, high = min(places), max(places) + 1
        if len(rows) < 2 or high - low > SPAN_PER_ROW * len(rows):
            for i, row in zip(members, rows, strict=True):
                out[i] = _own(taken, row)
                scheduled += [layer.state for layer in out[i]]
            continue
        first, end = min(r.padding for r in rows), max(r.end for r in rows)
        parts = []
        block = Block()
        for layer in range(len(taken.arrays)):
            copies = taken.copied(layer, slice(low, high), first, end)
            scheduled += copies
            block.nbytes += sum(a.nbytes for a in copies)
            parts.append([mx.split(a, high - low, axis=0) for a in copies])
        for i, row in zip(members, rows, strict=True):
            at, skip, length = row.place - low, row.padding - first, row.end - row.padding
            out[i] = [_layer(taken, [a[at] for a in layer], skip, length) for layer in parts]
            blocks[i] = block
    mx.async_eval(scheduled)
    return out, blocks


def one_row(cache: list[Any] | EndedRow) -> list[Any]:
    """`copied_out` of one row (in arrays of its own)."""
    return copied_out([cache])[0][0]


def _own(taken: Snapshot, row: EndedRow) -> list[Any]:
    """`row` in arrays of its own."""
    rows, length = slice(row.place, row.place + 1), row.end - row.padding
    return [_layer(taken, taken.copied(i, rows, row.padding, row.end), 0, length)
            for i in range(len(taken.arrays))]  # fmt: skip


def _layer(taken: Snapshot, arrays: list[mx.array], skip: int,
           length: int) -> KVCache | QuantizedKVCache:  # fmt: skip
    """A single sequence's cache of a layer's `arrays` (as `taken` holds
    them): `length` columns after `skip` (a row of a block ends before
    those ending furthest)."""
    arrays = [a[:, :, skip : skip + length] if skip or a.shape[2] > length else a for a in arrays]
    if taken.quantized is None:
        layer = KVCache()
        layer.keys, layer.values = arrays
    else:
        group_size, bits = taken.quantized
        layer = QuantizedKVCache(group_size=group_size, bits=bits)
        layer.keys, layer.values = tuple(arrays[:3]), tuple(arrays[3:])
    layer.offset = arrays[0].shape[2]
    return layer


def _contiguous(x: mx.array | tuple[mx.array, ...]) -> mx.array | tuple[mx.array, ...]:
    """`x` (quantized: each part) in an array of its own."""
    return tuple(map(mx.contiguous, x)) if isinstance(x, tuple) else mx.contiguous(x)
