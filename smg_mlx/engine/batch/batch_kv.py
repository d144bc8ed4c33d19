"""mlx-lm's batched KV cache where it does more than a step needs (engine thread).

Installed on import, for every BatchKVCache of the process:

- One row (never padded: padding lines rows up with each other) is masked
  with no array. A prompt chunk attends causally, a decoded token to every
  key; the fused kernels without a mask are faster at long context (several
  times for a chunk). A long prompt prefills alone, so this is its every
  pass, and a lone stream's every token. Whether several rows are padded
  would be read from the step before: they keep the array.
- Several rows attend over keys of a steady width (`steady_widths`, on
  CUDA): the cache's buffer up to the next multiple of its step (256 keys),
  the columns past the rows' ends hidden by the mask they carry anyway. mlx
  replays a pass from a recorded CUDA graph while its kernels are the ones
  recorded, and attention's matrix products and softmax pick their kernels
  by the key length: at the exact length, some plain passes and nearly every
  checking pass of speculative decoding (whose lengths move by what each row
  accepted) picked others, and every graph of the pass was built anew on
  the host. The buffer grows to multiples of its step, so the width holds
  from one growth to the next.
- A filter that keeps every row, in order, copies nothing. mlx-lm moves
  prompts into the decoding rows by filtering their cache, and gathers it
  whole even when all of them move, as a lone prompt always does: a second
  copy of the whole cache, in memory and in time, for nothing. Rows that
  leave are still gathered out, as before.

A filter also takes the padding every row kept has in front, where the
caller knows it: mlx-lm reads it back from the device, once a layer, and the
first read waits for the pass in flight, which leaves the device idle while
the host prepares the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

_steady = False  # `steady_widths`


def steady_widths(on: bool) -> None:
    """Whether several rows attend over keys of a steady width (module doc)."""
    global _steady
    _steady = on


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def room_after(capacity: int | None, end: int, n: int, step: int) -> int:
    """The columns a cache's buffer of `capacity` (None: none yet) holds once
    `n` entries are written at `end`: as it is, or grown to a multiple of `step`."""
    if capacity is not None and end + n <= capacity:
        return capacity
    return _round_up(end + n, step)


def attended(rows: int, end: int, room: int, step: int) -> int:
    """The keys a pass attends over, where `rows` rows end at `end` in a buffer
    of `room` columns: `end`, or a steady width past it (module doc)."""
    if not _steady or rows < 2:
        return end
    return min(_round_up(end, step), room)


def rooms(cache: BatchKVCache, n: int) -> tuple[int | None, int]:
    """The cache's buffer's columns now and once `n` entries are written."""
    capacity = None if cache.keys is None else cache.keys.shape[2]
    return capacity, room_after(capacity, cache._idx, n, cache.step)


def width_after(cache: BatchKVCache, n: int) -> int:
    """The keys the pass writing `n` entries at the cache's end attends over."""
    return attended(cache.offset.shape[0], cache._idx + n, rooms(cache, n)[1], cache.step)


def make_room(cache: BatchKVCache, keys: mx.array, values: mx.array) -> None:
    """The cache's buffer grown, where `keys` and `values` (B, H, n, D) would
    not fit after its end, to `rooms`' multiple of its step (what lies past
    its end is dropped)."""
    capacity, room = rooms(cache, keys.shape[2])
    if room == capacity:
        return
    B, heads, _, k_size = keys.shape
    kept = 0 if cache.keys is None else cache._idx
    new_k = mx.zeros((B, heads, room - kept, k_size), keys.dtype)
    new_v = mx.zeros((B, heads, room - kept, values.shape[3]), values.dtype)
    if cache.keys is None:
        cache.keys, cache.values = new_k, new_v
    else:
        cache.keys = mx.concatenate([cache.keys[..., :kept, :], new_k], axis=2)
        cache.values = mx.concatenate([cache.values[..., :kept, :], new_v], axis=2)


def _update_and_fetch(self: BatchKVCache, keys: mx.array, values: mx.array) -> tuple:
    """mlx-lm's, growing the buffer to a multiple of its step, and handing
    attention `width_after` keys."""
    prev, n = self._idx, keys.shape[2]
    width = width_after(self, n)
    make_room(self, keys, values)
    self.offset = self.offset + n
    self._idx += n
    self.keys[..., prev : self._idx, :] = keys
    self.values[..., prev : self._idx, :] = values
    return self.keys[..., :width, :], self.values[..., :width, :]


def steady_mask(end: int, n: int, width: int, first: mx.array,
                window_size: int | None = None) -> mx.array:  # fmt: skip
    """mlx-lm's causal mask for `n` queries ending at `end`, over `width`
    keys: a row sees its keys from `first` (its padding) to its query."""
    keys = mx.arange(width)[None]
    queries = mx.arange(end - n, end)[:, None]
    mask = queries >= keys
    if window_size is not None:
        mask = mask & (queries < keys + window_size)
    return mask & (first[:, None, None, None] <= keys)


def _no_mask_array_for_one_row(make_mask: Callable) -> Callable:
    def mask(self: BatchKVCache, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        plain = not return_array and all(v is None for v in kwargs.values())
        if self.left_padding.size == 1 and plain:
            return "causal" if N > 1 else None
        width = width_after(self, N)
        if width == self._idx + N:
            return make_mask(self, N, return_array=return_array, **kwargs)
        return steady_mask(self._idx + N, N, width, self.left_padding, kwargs.get("window_size"))

    return mask


def rows_kept(batch_indices: Any, rows: int) -> Any:
    """A filter's `batch_indices` over `rows` rows, as a slice where they keep
    every row in order: indexed as views, not gathered."""
    if isinstance(batch_indices, Sequence) and list(batch_indices) == list(range(rows)):
        return slice(None)
    return batch_indices


def _filter(filter_rows: Callable) -> Callable:
    def filter(self: BatchKVCache, batch_indices: Any, padding: int | None = None) -> None:
        batch_indices = rows_kept(batch_indices, self.offset.shape[0])
        if padding is None:
            filter_rows(self, batch_indices)
            return
        if self.keys is not None:
            self.keys, self.values = self.keys[batch_indices], self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        if padding > 0:
            if self.keys is not None:
                self.keys = self.keys[..., padding:, :]
                self.values = self.values[..., padding:, :]
            self._idx -= padding
            self.left_padding -= padding

    return filter


def stacked_rows(parts: Sequence[tuple[mx.array | None, int, int, int]], width: int,
                 like: mx.array) -> mx.array:  # fmt: skip
    """Batches of rows (B, H, columns, D) stacked in one new array of `width`
    columns, each given as (array, its rows, its entries' columns, where they
    go). A batch already in place (its entries from column 0, its buffer wide
    enough) goes in as it is; the others are padded (a copy each). Where the
    padded ones hold most rows (a lane shifted for a longer row joining),
    their copies would hold the lane twice beside the result: all are written
    into zeros instead, one buffer (filled once more)."""
    rows = sum(count for _, count, _, _ in parts)

    def in_place(array: mx.array | None, at: int) -> bool:
        return array is not None and at == 0 and array.shape[2] >= width

    padded = sum(count for array, count, _, at in parts if not in_place(array, at))
    if 2 * padded <= rows:
        shape = (like.shape[1], width, like.shape[3])
        return mx.concatenate([
            array[:, :, :width] if in_place(array, at)
            else mx.zeros((count, *shape), like.dtype) if array is None
            else mx.pad(array[:, :, :n], [(0, 0), (0, 0), (at, width - at - n), (0, 0)])
            for array, count, n, at in parts
        ])  # fmt: skip
    out = mx.zeros((rows, like.shape[1], width, like.shape[3]), like.dtype)
    first = 0
    for array, count, n, at in parts:
        if array is not None and n:
            out[first : first + count, :, at : at + n] = array[:, :, :n]
        first += count
    return out


def stacked_caches(caches: Sequence[Any], name: str, idx: int, width: int) -> Any:
    """The `name` arrays ("keys" or "values"; a quantized cache's: a tuple of
    parts) of batch caches stacked along rows (`stacked_rows`), each batch
    right-justified to end at column `idx` of `width`."""
    arrays = [getattr(c, name) for c in caches]
    like = next(a for a in arrays if a is not None)

    def stacked(part: Callable[[Any], mx.array]) -> mx.array:
        parts = [(None if a is None else part(a), c.offset.shape[0], c._idx, idx - c._idx)
                 for a, c in zip(arrays, caches, strict=True)]  # fmt: skip
        return stacked_rows(parts, width, part(like))

    if isinstance(like, tuple):
        return tuple(stacked(lambda a, i=i: a[i]) for i in range(len(like)))
    return stacked(lambda a: a)


def _extend(extend_rows: Callable) -> Callable:
    def extend(self: BatchKVCache, other: BatchKVCache) -> None:
        """mlx-lm's, both batches right-justified to the longer in a buffer as
        wide as the wider one's, made once (`stacked_rows`)."""
        both = (self, other)
        if all(c.keys is None for c in both):
            extend_rows(self, other)
            return
        idx = max(c._idx for c in both)
        width = max(c.keys.shape[2] for c in both if c.keys is not None)
        self.keys = stacked_caches(both, "keys", idx, width)
        self.values = stacked_caches(both, "values", idx, width)
        self.left_padding = mx.concatenate([c.left_padding + idx - c._idx for c in both])
        self.offset = mx.concatenate([c.offset for c in both])
        self._idx = idx

    return extend


BatchKVCache.update_and_fetch = _update_and_fetch
BatchKVCache.extend = _extend(BatchKVCache.extend)
BatchKVCache.make_mask = _no_mask_array_for_one_row(BatchKVCache.make_mask)
BatchKVCache.filter = _filter(BatchKVCache.filter)
