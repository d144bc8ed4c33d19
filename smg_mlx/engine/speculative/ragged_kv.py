"""A batched KV cache whose rows may end at different columns (engine thread only).

Speculative decoding writes every row's proposals in one pass and keeps only
what each row accepted. mlx-lm's BatchKVCache keeps all rows ending at one
column (`_idx`), so taking back a different number of entries per row would
mean moving whole rows. Here each row has its own end instead: a row takes
back its rejected entries by moving its end, its next entries are written
from there (over the rejected ones), and the attention mask hides what lies
past a row's end. Nothing is copied.

While every row ends at `_idx` (`_ends` is None) it is mlx-lm's cache,
unchanged: the ragged paths run only after a step took back different counts.
The columns past a row's end are room it has not used: when the rows' ends
drift apart by more than `SPREAD`, `rewind_layers` lines them up again (one
copy of the cache) so the batch holds no more columns than its longest row needs.

A pass may also be recorded while the one before it still runs (chained
checking passes, `rewind_ahead`): the device then counts what each row
takes back, and the host's ends stay an upper bound until it reads the
counts too.

`Ragged` is that bookkeeping; `RaggedBatchKVCache` and, under --kv-bits,
`RaggedBatchQuantizedKVCache` say how their arrays are written, rolled and cut.
`ragged(cache)` gives a batch cache of either kind its ragged class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll

from smg_mlx.engine.batch.batch_kv import make_room, width_after
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache, Quantized, map_parts

# Columns by which rows' ends may drift apart before `rewind_layers` lines them up.
SPREAD = 256


class Ragged:
    """A per-row end over a batch cache whose rows all end at `_idx` (see the
    module's docstring); mixed in before the batch cache's class."""

    _ends: list[int] | None = None
    # Each row's end on the device, while a pass is built before the host knows
    # how many entries the pass before it kept (`rewind_ahead`); `_ends` (or
    # `_idx`) is then where each row's entries reach at most, until `rewind`.
    _device_ends: mx.array | None = None

    @classmethod
    def adopt(cls, cache: Any) -> Any:
        """`cache` as this class, sharing its arrays (a cache of this class as it is)."""
        if isinstance(cache, cls):
            return cache
        ragged = cls.__new__(cls)
        ragged.__dict__.update(cache.__dict__)
        ragged._ends = None
        ragged._device_ends = None
        return ragged

    # What the storage does (the arrays' own layout):
    def _write_at(self, ends: mx.array, keys: mx.array, values: mx.array) -> None:
        """Write `keys` and `values` (B, H, n, D) at each row's end."""
        raise NotImplementedError

    def _arrays(self, fn: Callable[[mx.array], mx.array]) -> None:
        """Replace the keys' and values' arrays by `fn` of each."""
        raise NotImplementedError

    def _row_ends(self) -> list[int]:
        return self._ends if self._ends is not None else [self._idx] * self.offset.shape[0]

    def _set_ends(self, ends: list[int]) -> None:
        self._idx = max(ends, default=self._idx)
        self._ends = None if all(e == self._idx for e in ends) else ends

    def rewind(self, counts: list[int], ahead: bool = False) -> None:
        """Take back each row's newest `counts[i]` entries (`ahead`: the device
        has taken them back already, `rewind_ahead`). A model's layers rewind
        together, through `rewind_layers`."""
        self._device_ends = None
        if not any(counts):
            return
        self._set_ends([e - n for e, n in zip(self._row_ends(), counts, strict=True)])
        if not ahead:
            self.offset = self.offset - mx.array(counts)

    def drifted(self) -> bool:
        """Whether its rows' ends lie more than SPREAD apart."""
        return self._ends is not None and self._idx - min(self._ends) > SPREAD

    def rewind_ahead(self, counts: mx.array, ends: mx.array) -> None:
        """Take back each row's newest `counts[i]` entries, counted on the device
        (a pass still running), leaving it ending at `ends[i]` (its end less
        those, given by the caller once for every layer): the next pass writes
        from there, while the host's ends stay where the entries reach until
        `rewind(counts, ahead=True)` gives the same counts."""
        self.offset = self.offset - counts
        self._device_ends = ends

    def compact(self, unused: int | None = None) -> int | None:
        """Every row ending at `_idx` again, and no column that every row pads:
        how many those were (None: the rows ended together already). Where the
        caller knows that count (every layer's cache of a batch pads alike) it
        gives it as `unused`, else it is read back: a wait for the device
        before the next layer's copy is sent."""
        if self._ends is None:
            return None
        shift = mx.array([self._idx - e for e in self._ends])
        # What lies past a row's end rolls round into its padding, masked there.
        idx = self._idx
        self._arrays(lambda x: dynamic_roll(x[..., :idx, :], shift[:, None], axis=2))
        self.left_padding = self.left_padding + shift
        self._ends = None
        if unused is None:
            unused = min(self.left_padding.tolist())
        if unused > 0:
            self._arrays(lambda x: x[..., unused:, :])
            self._idx -= unused
            self.left_padding = self.left_padding - unused
        return unused

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        if self._ends is None and self._device_ends is None:
            return super().update_and_fetch(keys, values)
        n = keys.shape[2]
        self._write_at(self._query_ends(), keys, values)
        self.offset = self.offset + n
        if self._device_ends is not None:
            self._device_ends = self._device_ends + n
        self._set_ends([e + n for e in self._row_ends()])
        return self._fetch(n)

    def _query_ends(self) -> mx.array:
        """Where each row's next entries go."""
        return self._device_ends if self._device_ends is not None else mx.array(self._row_ends())

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if self._ends is None and self._device_ends is None:
            return super().make_mask(N, return_array=return_array, **kwargs)
        if kwargs.get("window_size") is not None:
            raise ValueError("a ragged cache has no sliding window")
        keys = mx.arange(self._mask_width(N))[None, None, None, :]
        queries = (self._query_ends()[:, None] + mx.arange(N)[None])[:, None, :, None]
        first = self.left_padding[:, None, None, None]
        return (keys >= first) & (keys <= queries)

    def filter(self, batch_indices: Any) -> None:
        ends = self._row_ends()
        kept = ends if isinstance(batch_indices, slice) else [ends[i] for i in batch_indices]
        self._idx = top = max(kept, default=self._idx)
        super().filter(batch_indices)  # drops the columns every kept row pads
        self._ends = None
        if kept:
            self._set_ends([e - (top - self._idx) for e in kept])

    def extend(self, other: Any) -> None:
        mine = self._row_ends()
        if isinstance(other, Ragged):
            theirs = other._row_ends()
        else:
            theirs = [other._idx] * other.offset.shape[0]
        mine_idx, their_idx = self._idx, other._idx
        super().extend(other)
        moved = [e + self._idx - mine_idx for e in mine]
        self._set_ends(moved + [e + self._idx - their_idx for e in theirs])

    def extract(self, idx: int) -> Any:
        if self._ends is None:
            return super().extract(idx)
        end = self._ends[idx]
        saved = self._idx
        self._idx = end
        try:
            return super().extract(idx)
        finally:
            self._idx = saved


def _where(ends: mx.array, n: int) -> mx.array:
    """put_along_axis's indices for `n` entries at each row's end, (B, 1, n, 1)."""
    return (ends[:, None] + mx.arange(n)[None])[:, None, :, None]


class RaggedBatchKVCache(Ragged, BatchKVCache):
    """mlx-lm's BatchKVCache with a per-row end."""

    def _fetch(self, n: int) -> tuple[mx.array, mx.array]:
        width = width_after(self, 0)  # (written: `_idx` has moved past them)
        return self.keys[..., :width, :], self.values[..., :width, :]

    def _mask_width(self, N: int) -> int:
        return width_after(self, N)

    def _arrays(self, fn: Callable[[mx.array], mx.array]) -> None:
        self.keys, self.values = fn(self.keys), fn(self.values)

    def _write_at(self, ends: mx.array, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        make_room(self, keys, values)  # after `_idx`, the longest row's end
        where = _where(ends, n)
        self.keys = mx.put_along_axis(self.keys, where, keys, axis=2)
        self.values = mx.put_along_axis(self.values, where, values, axis=2)


class RaggedBatchQuantizedKVCache(Ragged, BatchQuantizedKVCache):
    """--kv-bits: the batched quantized cache with a per-row end (and no 16-bit
    tail: every position is quantized, so that rows can take theirs back)."""

    tails = False

    @classmethod
    def adopt(cls, cache: Any) -> Any:
        cache.flush()
        ragged = super().adopt(cache)
        ragged._tail = None
        return ragged

    def _arrays(self, fn: Callable[[mx.array], mx.array]) -> None:
        self.keys, self.values = map_parts(fn, self.keys), map_parts(fn, self.values)
        self._cut = True  # `compact` cuts them

    def _write_at(self, ends: mx.array, keys: mx.array, values: mx.array) -> None:
        qk, qv = self._quantize(keys), self._quantize(values)
        self._reserve(keys.shape[2], qk, qv)
        where = _where(ends, keys.shape[2])

        def put(store: Quantized, new: Quantized) -> Quantized:
            return tuple(
                mx.put_along_axis(buf, where, part, axis=2)
                for buf, part in zip(store, new, strict=True)
            )  # type: ignore[return-value]

        self.keys, self.values = put(self.keys, qk), put(self.values, qv)


def line_up(caches: list) -> None:
    """The caches among `caches` (one model's layers, whose rows pad alike)
    whose rows ended apart end together again, copied now (`Ragged.compact`,
    evaluated)."""
    apart = [c for c in caches if isinstance(c, Ragged) and c._ends is not None]
    unused = None  # (read back from the first layer's, once)
    for cache in apart:
        unused = cache.compact(unused)
    if apart:
        mx.eval([(cache.keys, cache.values) for cache in apart])


def rewind_layers(caches: list, counts: list[int], ahead: bool = False) -> None:
    """Each of `caches` (one model's layers, whose rows end alike) takes back
    each row's newest `counts[i]` entries (`Ragged.rewind`); where that leaves
    the rows' ends over SPREAD apart, every layer is lined up (`line_up`:
    their padding read back once, not once a layer)."""
    for cache in caches:
        cache.rewind(counts, ahead)
    if caches and caches[0].drifted():
        line_up(caches)


def ragged(cache: Any) -> Ragged:
    """A target model's batch cache as its ragged class, sharing its arrays."""
    if isinstance(cache, BatchQuantizedKVCache):
        return RaggedBatchQuantizedKVCache.adopt(cache)
    return RaggedBatchKVCache.adopt(cache)
