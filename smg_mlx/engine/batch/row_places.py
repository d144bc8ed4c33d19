"""mlx-lm's decoding rows, where a row joining takes the place a row left (engine thread only).

mlx-lm's `GenerationBatch` keeps every row of a layer's cache in one array:
a row leaving gathers the others into new arrays (`filter`), a row joining
concatenates them (`extend`). Each is a copy of every layer's cache, and on
CUDA each costs far more than the bytes it moves; under load a row leaves or
joins nearly every pass, and speculative decoding, whose rows finish apart,
makes that every pass.

Here a row that leaves leaves its place empty (a hole) and nothing is
copied. A row joining is written into a hole, one slice a layer, ending
where the batch's rows end (its padding masks what lies before it); only a
row longer than the batch's cache, or one that finds no hole, is appended as
mlx-lm appends it. Holes still run in each pass, their outputs dropped, so
once they outnumber `HOLES_KEPT` (or a quarter of the rows) at the start of a
pass they are gathered out as mlx-lm's filter does. Columns that no row uses any more are cut off
the front when a row leaves, as mlx-lm's filter cuts them (a view, no copy).

The batch's own lists (uids, tokens, samplers, ...) are mlx-lm's, in its
order; `_places[i]` is row i's place in the cache. A row's tokens are those
its cache holds (mlx-lm keeps them so), which says where its entries start.
Caches whose every layer is a plain or quantized (--kv-bits) batch KV cache
keep places; others (rotating windows, recurrent state) filter and extend as
mlx-lm's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from smg_mlx.engine.batch.ended_rows import EndedRow, EndingGenerationBatch
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.speculative.ragged_kv import (
    Ragged,
    RaggedBatchKVCache,
    RaggedBatchQuantizedKVCache,
    rewind_layers,
)

# Holes a batch keeps for rows to join, whatever its size.
HOLES_KEPT = 2
PLACEABLE = (
    BatchKVCache, RaggedBatchKVCache, BatchQuantizedKVCache, RaggedBatchQuantizedKVCache
)  # fmt: skip


def _placeable(cache: list) -> bool:
    return bool(cache) and all(type(c) in PLACEABLE for c in cache)


def _ends(cache: Any) -> list[int]:
    """Where each place's entries end (one column for all, unless ragged;
    quantized: after the 16-bit tail's)."""
    if isinstance(cache, Ragged):
        return cache._row_ends()
    return [cache.size()] * cache.offset.shape[0]


def _arrays(cache: Any) -> list[mx.array]:
    """A layer's arrays, keys' then values' (quantized: three parts each)."""
    if isinstance(cache, BatchQuantizedKVCache):
        return [*cache.keys, *cache.values]
    return [cache.keys, cache.values]


class PlacedGenerationBatch(EndingGenerationBatch):
    """Decoding rows that keep their places in the cache (module doc)."""

    _target: nn.Module  # the model (`model` routes rows to their places)
    _places: list[int]  # row i's place in the cache
    _width: int  # places in the cache: rows and holes
    # (each place's row, each row's place); None: row i at place i, no hole
    _route: tuple[mx.array, mx.array] | None

    @classmethod
    def start(cls, model: nn.Module, sampler: Any) -> Any:
        """An empty batch, as a lane's BatchGenerator starts with."""
        batch = super().start(model, sampler)
        batch._target = model
        batch.model = batch._through_places
        batch._places, batch._width, batch._route = [], 0, None
        return batch

    @property
    def holes(self) -> int:
        return self._width - len(self._places)

    def _through_places(self, inputs: mx.array, cache: list) -> mx.array:
        """The model over every place (a hole runs any row's inputs), its
        outputs in the rows' order."""
        if self._route is None:
            return self._target(inputs, cache=cache)
        rows, places = self._route
        return self._target(inputs[rows], cache=cache)[places]

    def _placed(self, places: list[int], width: int) -> None:
        self._places, self._width = places, width
        if places == list(range(width)):
            self._route = None
            return
        row_at = dict(zip(places, range(len(places)), strict=True))
        rows = [row_at.get(p, 0) for p in range(width)]
        self._route = mx.array(rows), mx.array(places)

    def extract_cache(self, idx: int) -> list[Any] | EndedRow:
        return self._ended(idx, self._places[idx])

    def filter(self, keep: list[int]) -> None:
        if not keep or not _placeable(self.prompt_cache):
            super().filter(keep)
            self._placed(list(range(len(keep))), len(keep))
            return
        with self._rows_only():
            super().filter(keep)
        self._placed([self._places[i] for i in keep], self._width)
        self._cut_front()

    def next(self) -> list:
        # Holes rows left in the last call may have been filled by rows joining
        # since (BatchGenerator moves prompts in after each pass): only holes
        # still empty now count.
        if self.holes > max(HOLES_KEPT, len(self._places) // 4):
            self._gather()
        return super().next()

    def _gather(self) -> None:
        """The rows gathered into places of their own order, holes left out
        (mlx-lm's filter: a copy of every layer's cache)."""
        if self._route is not None:
            for c in self.prompt_cache:
                c.filter(self._places)
        self._placed(list(range(len(self._places))), len(self._places))

    def _cut_front(self) -> None:
        """Drop the columns before the rows' first entries (views of the arrays)."""
        ends = _ends(self.prompt_cache[0])
        unused = min(ends[p] - len(t) for p, t in zip(self._places, self.tokens, strict=True))
        if unused <= 0:
            return
        for c in self.prompt_cache:
            if isinstance(c, BatchQuantizedKVCache):
                c.drop_front(unused)
            else:
                c.keys, c.values = c.keys[..., unused:, :], c.values[..., unused:, :]
                c._idx -= unused
                c.left_padding = mx.maximum(c.left_padding - unused, 0)  # holes' too
            if isinstance(c, Ragged) and c._ends is not None:
                c._ends = [e - unused for e in c._ends]

    def extend(self, other: GenerationBatch) -> None:
        if not self.uids or not _placeable(self.prompt_cache) or not _placeable(other.prompt_cache):
            self._gather()
            super().extend(other)
            self._placed(list(range(len(self.uids))), len(self.uids))
            return
        top = self.prompt_cache[0]._idx
        free = sorted(set(range(self._width)) - set(self._places))
        lengths = [len(t) for t in other.tokens]
        into = {}  # other's row -> the hole it takes
        for j, length in enumerate(lengths):
            if free and length <= top:
                into[j] = free.pop(0)
        if into:
            self._write_into_holes(other.prompt_cache, into, lengths)
        appended = [j for j in range(len(lengths)) if j not in into]
        if appended:
            for c, o in zip(self.prompt_cache, other.prompt_cache, strict=True):
                o.filter(appended)
                c.extend(o)
        width = self._width
        new = dict(into) | {j: width + k for k, j in enumerate(appended)}
        with self._rows_only():
            super().extend(other)
        self._placed(self._places + [new[j] for j in range(len(lengths))], width + len(appended))

    def _write_into_holes(self, theirs: list, into: dict[int, int], lengths: list[int]) -> None:
        """Other's rows `into` the holes named, each ending at the batch's last
        column: one write an array for each run of rows that take holes side
        by side, of its longest row's columns (a shorter row's padding lands
        in its hole's, masked). Slices, not an index array: a write at
        an array of rows is another kernel for CUDA to build."""
        if isinstance(self.prompt_cache[0], BatchQuantizedKVCache):
            for c in (*self.prompt_cache, *theirs):
                c.flush()  # (every row ends at `_idx`, the ones joining too)
        runs: list[list[int]] = []  # [their first row, its place, rows]
        for j, place in sorted(into.items()):
            if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == place:
                runs[-1][2] += 1
            else:
                runs.append([j, place, 1])
        spans = [max(lengths[j : j + rows]) for j, _, rows in runs]
        top = self.prompt_cache[0]._idx  # (every layer's)
        taken, first, counts = [False] * self._width, [0] * self._width, [0] * self._width
        for j, place in into.items():
            taken[place], first[place], counts[place] = True, top - lengths[j], lengths[j]
        at, first_at, counts_at = mx.array(taken), mx.array(first), mx.array(counts)
        for c, o in zip(self.prompt_cache, theirs, strict=True):
            for (j, place, rows), span in zip(runs, spans, strict=True):
                if span:
                    for a, b in zip(_arrays(c), _arrays(o), strict=True):
                        a[place : place + rows, :, top - span : top, :] = (
                            b[j : j + rows, :, o._idx - span : o._idx, :]
                        )  # fmt: skip
            if isinstance(c, Ragged) and c._ends is not None:
                for place in into.values():
                    c._ends[place] = top
            host = getattr(c, "_host_padding", None)  # (quantized: kept on the host too)
            if host is not None:
                c._set_padding([f if t else p for t, f, p in zip(taken, first, host, strict=True)])
            else:
                c.left_padding = mx.where(at, first_at, c.left_padding)
            c.offset = mx.where(at, counts_at, c.offset)

    def rewind(self, counts: list[int], ahead: bool = False) -> None:
        """Each row takes back its newest `counts[i]` entries (ragged caches; `ahead`:
        the device has, `rewind_ahead`); a hole ends where the furthest row ends, so
        that holes never drift away from the rows (`ragged_kv.SPREAD`)."""
        ends = _ends(self.prompt_cache[0])  # every layer's: written and taken back together
        furthest = max(ends[p] - n for p, n in zip(self._places, counts, strict=True))
        each = [ends[p] - furthest for p in range(self._width)]
        for p, n in zip(self._places, counts, strict=True):
            each[p] = n
        rewind_layers(self.prompt_cache, each, ahead)

    def rewind_ahead(self, counts: mx.array) -> None:
        """Each row takes back its newest `counts[i]` entries, counted on the device
        (ragged caches, `Ragged.rewind_ahead`); a hole, none."""
        if self._route is not None:
            # Gathered by each place's row, not scattered to each row's place:
            # mlx's CUDA backend builds an int32 scatter only on first use, which
            # would stall every stream for seconds; the warm-up builds gathers.
            taken = set(self._places)
            row = mx.array([p in taken for p in range(self._width)])
            counts = mx.where(row, counts[self._route[0]], 0)
        # (every layer's ends alike: written and taken back together)
        ends = mx.array(_ends(self.prompt_cache[0])) - counts
        for c in self.prompt_cache:
            c.rewind_ahead(counts, ends)
