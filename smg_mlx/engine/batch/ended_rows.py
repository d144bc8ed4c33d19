"""What rows that end leave, copied out of the batch cache (engine thread only).

A row's keys and values copied out of its batch take a copy a layer array:
on a GPU each costs the host more (building the op, launching its kernel)
than the bytes it moves, about half a millisecond a row at 28 layers. Rows
ending together (requests started together that asked for as many tokens)
held the requests that replace them back that long for every row. So the
rows one pass ends, where they lie close together in the batch, are copied
out as one block a layer array, each row a view of it (`copied_out`); the
block is freed once every row of it that the prefix cache kept has been
copied into arrays of its own, a few rows a turn (`SharedBlocks.tend`),
while passes run. Until then the memory a block holds is counted whole,
beside its rows'.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# Rows copied out of their blocks in one turn.
ROWS_A_TURN = 8
# Rows a pass ends are copied out as a block where they span at most this
# many places a row (the places between, rows still running or holes, are
# copied too), and are at least two.
SPAN_PER_ROW = 2


@dataclass(eq=False)
class Snapshot:
    """A plain batch cache's arrays as a pass left them: later writes into
    the cache (rows joining in the same call) change its arrays, not these."""

    arrays: list[tuple[mx.array, mx.array]]  # each layer's keys and values
    padding: mx.array  # the left padding, a column a place
    end: int  # the column where every row's entries end

    @classmethod
    def of(cls, cache: list[BatchKVCache]) -> Snapshot:
        # mx.array(a): a handle to a's present value, which writes into a leave be
        arrays = [(mx.array(c.keys), mx.array(c.values)) for c in cache]
        return cls(arrays, mx.array(cache[0].left_padding), cache[0]._idx)


@dataclass(eq=False)
class EndedRow:
    """A row of a plain batch cache that ended or left, where it lies in a
    snapshot of the cache (rows a pass ended share theirs)."""

    snapshot: Snapshot
    place: int


@dataclass(eq=False)
class _Block:
    nbytes: int
    rows: int  # rows still viewing it


class SharedBlocks:
    """Rows the prefix cache kept that are still views of a block, and the
    memory their blocks hold."""

    def __init__(self) -> None:
        self._rows: deque[tuple[list[KVCache], _Block]] = deque()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, rows: Sequence[tuple[list[KVCache], _Block]]) -> None:
        """Kept rows that view their blocks (as `copied_out` gave them)."""
        blocks = {id(block): block for _, block in rows}
        for block in blocks.values():
            block.rows = sum(b is block for _, b in rows)
            self.nbytes += block.nbytes
        self._rows.extend(rows)

    def tend(self, most: int = ROWS_A_TURN) -> bool:
        """Copies up to `most` rows into arrays of their own, without waiting;
        whether a block was let go."""
        copied, freed = [], False
        for _ in range(min(most, len(self._rows))):
            layers, block = self._rows.popleft()
            for layer in layers:
                layer.keys, layer.values = mx.contiguous(layer.keys), mx.contiguous(layer.values)
                copied += [layer.keys, layer.values]
            block.rows -= 1
            if not block.rows:
                self.nbytes -= block.nbytes
                freed = True
        mx.async_eval(copied)
        return freed


def copied_out(
    caches: Sequence[list[Any] | EndedRow],
) -> tuple[list[list[Any]], list[_Block | None]]:
    """Each row's layer caches (lists, as other caches gave them, pass
    through), sent to the device without waiting, and the block each views
    (None: arrays of its own)."""
    out: list[list[Any]] = [c if isinstance(c, list) else [] for c in caches]
    blocks: list[_Block | None] = [None] * len(caches)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(caches):
        if isinstance(c, EndedRow):
            groups.setdefault(id(c.snapshot), []).append(i)
    # (others' lazy copies too: they would keep the batch's arrays alive)
    scheduled: list[Any] = [layer.state for c in caches if isinstance(c, list) for layer in c]
    for members in groups.values():
        rows = [caches[i] for i in members]
        taken = rows[0].snapshot
        paddings = taken.padding.tolist()  # one read for all
        places = [r.place for r in rows]
        low, high = min(places), max(places) + 1
        if len(rows) < 2 or high - low > SPAN_PER_ROW * len(rows):
            for i, row in zip(members, rows, strict=True):
                out[i] = _own(taken, row.place, paddings[row.place])
                scheduled += [a for layer in out[i] for a in (layer.keys, layer.values)]
            continue
        first = min(paddings[p] for p in places)
        parts = []
        block = _Block(0, 0)
        for keys, values in taken.arrays:
            pair = [mx.contiguous(a[low:high, :, first : taken.end]) for a in (keys, values)]
            scheduled += pair
            block.nbytes += sum(a.nbytes for a in pair)
            parts.append([mx.split(a, high - low, axis=0) for a in pair])
        for i, row in zip(members, rows, strict=True):
            at, skip = row.place - low, paddings[row.place] - first
            out[i] = [_layer(k[at], v[at], skip) for k, v in parts]
            blocks[i] = block
    mx.async_eval(scheduled)
    return out, blocks


def _own(taken: Snapshot, place: int, padding: int) -> list[KVCache]:
    """The row at `place` in arrays of its own."""
    row = slice(place, place + 1)
    return [
        _layer(*(mx.contiguous(a[row, :, padding : taken.end]) for a in pair), 0)
        for pair in taken.arrays
    ]


def _layer(keys: mx.array, values: mx.array, skip: int) -> KVCache:
    """A single sequence's cache of `keys` and `values` after `skip` columns."""
    layer = KVCache()
    layer.keys, layer.values = (a[:, :, skip:] if skip else a for a in (keys, values))
    layer.offset = layer.keys.shape[2]
    return layer
