"""A batched KV cache that stores keys and values quantized (engine thread; WIP).

`BatchQuantizedKVCache` is to mlx-lm's `QuantizedKVCache` what `BatchKVCache`
is to `KVCache`: rows are left-padded to a common length, each row keeps its
own offset, and the batch generator's prepare/finalize, filter, extend,
extract and merge keep their meaning. Keys and values are each a tuple
(packed, scales, biases) as `mx.quantize` returns them along the head
dimension, so mlx-lm's attention takes its quantized path (it looks for
`bits` on the cache).

Importing this module gives `QuantizedKVCache` a `merge`, which is how
mlx-lm's BatchGenerator turns per-sequence caches into a batch cache: insert
prompts with `caches=[[QuantizedKVCache(group_size, bits) per layer], ...]`;
and an `nbytes` that counts a fresh one as empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache

from smg_mlx.engine.batch import fused_quantized_attention as fused
from smg_mlx.engine.batch.attention_shapes import FEW_QUERIES
from smg_mlx.engine.batch.batch_kv import rows_kept, stacked_caches

Quantized = tuple[mx.array, mx.array, mx.array]  # packed, scales, biases

# mlx's CUDA quantized matmul takes only arrays stored whole, end to end: a
# view of the cache's first positions, with room to grow after them, is
# refused ("No implementation for problem shape"). There attention reads the
# whole buffers, and the mask hides the positions not yet written (copying
# the written ones out would move the whole cache every step). The buffers
# hold a whole number of `step` positions there: mlx builds a kernel of its
# own for key counts that end part-way through its tile, a minute's build the
# first time on a host (`quantized_attention.build_kernels`).
WHOLE = mx.cuda.is_available()
# A decoding pass writes its keys and values as they come, 16-bit, into a
# tail of TAIL positions after the quantized ones, which the fused kernel
# reads as it would read them quantized (it quantizes them itself, as
# mx.quantize does): quantizing them there would take two quantizations and
# six writes a layer, each an op the host builds and launches (a small
# model's decoding step waits on those). The tail is quantized into the
# buffers when it is full, and before rows join or the cache is read whole
# (`flush`). Where the kernel runs (CUDA); tests turn it on on the CPU,
# where attention quantizes the tail before it reads it.
# The tail holds a few decoding steps' positions: a flush costs the host as
# many ops as a step's attention, while each step's kernel reads the whole
# tail (16-bit, quantized as it reads), and each row holds it (`tail_nbytes`).
TAILS = WHOLE
TAIL = 4 * FEW_QUERIES  # (a pass of up to FEW_QUERIES positions fits an empty tail)


def _whole_steps(n: int, step: int) -> int:
    return -(-n // step) * step


def map_parts(fn: Callable[[mx.array], mx.array], q: Quantized) -> Quantized:
    return tuple(fn(x) for x in q)  # type: ignore[return-value]


def _zeros_like_rows(q: Quantized, rows: int, length: int) -> Quantized:
    """Empty (all-zero) quantized positions shaped like `q` but `rows` x `length`."""
    return map_parts(lambda x: mx.zeros((rows, x.shape[1], length, x.shape[3]), x.dtype), q)


def _roll_right(x: mx.array, shifts: mx.array) -> mx.array:
    """Each row of `x` (B, H, T, D) rotated right along T by its own shift."""
    T = x.shape[2]
    src = (mx.arange(T)[None] - shifts[:, None]) % T  # (B, T): where each slot reads from
    return mx.take_along_axis(x, src[:, None, :, None], axis=2)


def _nbytes(cache: Any) -> int:
    """A quantized cache's bytes (0 while it holds nothing)."""
    return 0 if cache.keys is None else sum(x.nbytes for x in (*cache.keys, *cache.values))


class BatchQuantizedKVCache(_BaseCache):
    """Left-padded rows of quantized keys and values; see BatchKVCache for the layout."""

    step = 256  # positions are allocated in blocks, as mlx-lm's caches do
    # Whether a buffer may be a view, or end off a step (WHOLE: made whole
    # before the next write, `_make_whole`).
    _cut = False

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Quantized | None = None
        self.values: Quantized | None = None
        self.group_size = group_size
        self.bits = bits
        self._set_padding(list(left_padding))
        # A row's offset counts its own tokens: padding comes before position 0.
        self.offset = -self.left_padding
        self._idx = 0  # positions quantized, padding included, the same for every row
        self._right_padding: list[int] | None = None
        self._tail: tuple[mx.array, mx.array] | None = None  # 16-bit keys, values (TAILS)
        self._tailed = 0  # positions in the tail, after the `_idx` quantized ones

    # -- each row's left padding ---------------------------------------------
    # Kept on the host too, while every change to it is known there (a prompt
    # batch's life: made, padded, filtered): a filter or extract that reads it
    # from the device waits for the pass in flight, and the device then idles
    # while the host prepares the next.

    @property
    def left_padding(self) -> mx.array:
        return self._left_padding

    @left_padding.setter
    def left_padding(self, value: mx.array) -> None:
        self._left_padding, self._host_padding = value, None  # a change not known here

    def _set_padding(self, host: list[int]) -> None:
        self._left_padding, self._host_padding = mx.array(host), host

    def _padding_of(self, rows: Any) -> list[int] | None:
        """The left padding of `rows` (a slice or a list of rows), None where unknown here."""
        host = self._host_padding
        if host is None:
            return None
        if isinstance(rows, slice):
            return host[rows]
        return [host[i] for i in rows] if isinstance(rows, Sequence) else None

    # -- writing and reading ------------------------------------------------

    def _quantize(self, x: mx.array) -> Quantized:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))  # type: ignore[return-value]

    def _capacity(self) -> int:
        """The positions allocated (WHOLE: once made whole)."""
        size = 0 if self.keys is None else self.keys[0].shape[2]
        return _whole_steps(size, self.step) if WHOLE and self._cut else size

    def _make_whole(self) -> None:
        """(WHOLE) Buffers cut (a view, or to their written positions) copied
        whole, to `_capacity`: the copy a view needs anyway, padded at its end."""
        if not (WHOLE and self._cut and self.keys is not None):
            return
        size = self._capacity()

        def whole(x: mx.array) -> mx.array:
            tail = size - x.shape[2]
            return mx.pad(x, [(0, 0), (0, 0), (0, tail), (0, 0)]) if tail else mx.contiguous(x)

        self.keys, self.values = map_parts(whole, self.keys), map_parts(whole, self.values)
        self._cut = False

    def _capacity_for(self, n: int) -> int:
        """The positions allocated once `n` more are written after `_idx`."""
        if self._idx + n <= self._capacity():
            return self._capacity()
        return _whole_steps(self._idx + n, self.step)

    def _spare(self, written: int) -> int:
        """Positions allocated past `written` ones in a buffer made anew (WHOLE:
        to a whole number of steps, so the next write needs no copy to grow;
        else none, as mlx-lm's caches)."""
        return _whole_steps(written, self.step) - written if WHOLE else 0

    def _reserve(self, n: int, qk: Quantized, qv: Quantized) -> None:
        """Room for `n` more positions after `_idx` (`qk`, `qv`: what they will hold)."""
        self._make_whole()
        prev = self._idx
        size = self._capacity_for(n)
        if size == self._capacity():
            return
        B = qk[0].shape[0]
        if self.keys is None:
            self.keys = _zeros_like_rows(qk, B, size)
            self.values = _zeros_like_rows(qv, B, size)
        else:
            # Keep only what was written: a previous block may be part-used.
            def grow(x: mx.array) -> mx.array:
                pad = mx.zeros((*x.shape[:2], size - prev, x.shape[3]), x.dtype)
                return mx.concatenate([x[:, :, :prev], pad], axis=2)

            self.keys, self.values = map_parts(grow, self.keys), map_parts(grow, self.values)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        n = keys.shape[2]
        self.offset = self.offset + n
        if self._tail_pass(n):
            return self._into_tail(keys, values)
        self.flush()
        self._write(keys, values)
        return self._fetch(n)

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """`keys` and `values` quantized into the buffers, after `_idx`."""
        n = keys.shape[2]
        prev = self._idx
        qk, qv = self._quantize(keys), self._quantize(values)
        self._reserve(n, qk, qv)
        for store, new in ((self.keys, qk), (self.values, qv)):
            for buf, part in zip(store, new, strict=True):
                buf[:, :, prev : prev + n] = part
        self._idx += n

    # -- the 16-bit tail (TAILS) ------------------------------------------------

    tails = True  # whether this class keeps one (a ragged cache's rows end apart: not)

    def _tail_pass(self, N: int) -> bool:
        """Whether a pass of `N` positions a row goes into the tail: a few-query
        pass over rows that hold quantized positions, of heads the kernel takes."""
        if not (TAILS and self.tails and self.keys is not None and N <= FEW_QUERIES):
            return False
        if self._right_padding is not None:  # (rolled into left padding after the pass)
            return False
        return not fused.AVAILABLE or fused.fits_kind(
            *self._head_sizes(), self.group_size, self.bits
        )

    def _head_sizes(self) -> tuple[int, int]:
        """The keys' and values' head sizes (a scale a quantization group)."""
        return self.keys[1].shape[-1] * self.group_size, self.values[1].shape[-1] * self.group_size

    def tail_nbytes(self) -> int:
        """Bytes each row's tail holds (0 where passes write none)."""
        if not self._tail_pass(1):
            return 0
        return TAIL * self.keys[0].shape[1] * sum(self._head_sizes()) * self.keys[1].dtype.size

    def _into_tail(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        n = keys.shape[2]
        if self._tailed + n > TAIL:
            self.flush()
        self._make_whole()
        if self._tail is None:
            self._tail = tuple(  # type: ignore[assignment]
                mx.zeros((*x.shape[:2], TAIL, x.shape[3]), x.dtype) for x in (keys, values)
            )
        at = self._tailed
        for buf, new in zip(self._tail, (keys, values), strict=True):
            buf[:, :, at : at + n] = new
        self._tailed += n
        main_keys, main_values = self._fetch(n)
        return (*main_keys, self._tail[0]), (*main_values, self._tail[1])

    def flush(self) -> None:
        """The tail's positions quantized into the buffers."""
        if self._tailed:
            keys, values = (x[:, :, : self._tailed] for x in self._tail)
            self._tailed = 0
            self._write(keys, values)

    def _tail_mask(self, N: int) -> mx.array:
        """A tail pass's mask: the quantized positions (the buffers' width),
        then the tail's TAIL, as the pass will find them (`_into_tail`)."""
        total = self._idx + self._tailed
        flushes = self._tailed + N > TAIL
        quantized = total if flushes else self._idx
        # The buffers' width once a flush wrote (a tail pass reads them whole where WHOLE).
        flushed = self._tailed if flushes else 0
        width = self._capacity_for(flushed) if WHOLE else self._idx + flushed
        mask = create_causal_mask(N, offset=total, left_padding=self.left_padding)
        ends = [(0, 0)] * (mask.ndim - 1)
        main = mx.pad(mask[..., :quantized], [*ends, (0, width - quantized)])
        tail = mask[..., quantized:]
        tail = mx.pad(tail, [*ends, (0, TAIL - tail.shape[-1])])
        return mx.concatenate([main, tail], axis=-1)

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        """The positions written (the tail's quantized)."""
        self.flush()
        return self._written()

    def _written(self) -> tuple[Quantized, Quantized]:
        cut = lambda x: x[:, :, : self._idx]  # noqa: E731
        return map_parts(cut, self.keys), map_parts(cut, self.values)

    def _one_prompt(self, N: int) -> bool:
        """Whether a pass of `N` new positions is one row's prompt chunk: its
        attention dequantizes what it reads into a copy anyway
        (`quantized_attention`), and runs causal, with no mask array: the
        fused kernel is several times faster so."""
        return N > FEW_QUERIES and self.left_padding.size == 1

    def _fetch(self, n: int) -> tuple[Quantized, Quantized]:
        """What attention reads after `n` positions were written: the
        positions written, or (WHOLE, but for one prompt) the buffers, their
        unwritten tail masked by `make_mask`."""
        if not WHOLE or self._one_prompt(n):
            return self._written()
        return self.keys, self.values

    def _mask_width(self, N: int) -> int:
        """The keys attention will read once `N` more are written."""
        return self._capacity_for(N) if WHOLE and not self._one_prompt(N) else self._idx + N

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if self._tail_pass(N):  # (no sliding windows here: refused at start-up)
            return self._tail_mask(N)
        self.flush()  # (as the pass's writes will)
        if self._one_prompt(N) and not return_array and all(v is None for v in kwargs.values()):
            return "causal"
        # Else an array: left padding must be masked (and where WHOLE, the
        # positions past the newest, which are not written yet).
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        tail = self._mask_width(N) - (self._idx + N)
        return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, tail)]) if tail else mask

    # -- ragged prompts -------------------------------------------------------

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            self._shift_padding(list(left_padding))
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self) -> None:
        """After a right-padded chunk: rotate each row's padding round to its left,
        so every row ends at `_idx` again (the padding is masked as left padding)."""
        if self._right_padding is None:
            return
        pad = mx.array(self._right_padding)
        roll = lambda x: _roll_right(x, pad)  # noqa: E731
        self.keys, self.values = map_parts(roll, self.keys), map_parts(roll, self.values)
        self._shift_padding(self._right_padding)
        self._right_padding = None

    def _shift_padding(self, more: list[int]) -> None:
        """Each row's padding `more[i]` positions longer (its offset as many less)."""
        self.offset = self.offset - mx.array(more)
        host = self._host_padding
        if host is None:
            self.left_padding = self.left_padding + mx.array(more)
        else:
            self._set_padding([p + m for p, m in zip(host, more, strict=True)])

    # -- rows in and out ------------------------------------------------------

    def filter(self, batch_indices: Any, padding: int | None = None) -> None:
        """Keep the given rows; drop the left padding they all share
        (`padding`, where the caller knows it: else from the host's copy, or
        read from the device)."""
        batch_indices = rows_kept(batch_indices, self.offset.shape[0])
        kept = self._padding_of(batch_indices)
        take = lambda x: x[batch_indices]  # noqa: E731
        if self.keys is not None:
            self.keys, self.values = map_parts(take, self.keys), map_parts(take, self.values)
        # The tail's positions stay after the quantized ones, whatever padding goes.
        self._tail = map_parts(take, self._tail) if self._tailed else None
        self.offset = self.offset[batch_indices]
        if kept is None:
            self.left_padding = self.left_padding[batch_indices]
            kept = self.left_padding.tolist() if padding is None else None
        shared = min(kept) if padding is None else padding
        self._drop_columns(shared)
        if kept is not None:
            self._set_padding([p - shared for p in kept])
        elif shared:
            self.left_padding = self.left_padding - shared

    def drop_front(self, n: int) -> None:
        """The first `n` columns dropped (before every row's entries: holes'
        padding, `row_places`, is cut to fit)."""
        self._drop_columns(n)
        host = self._host_padding
        if host is not None:
            self._set_padding([max(p - n, 0) for p in host])
        else:
            self.left_padding = mx.maximum(self.left_padding - n, 0)

    def _drop_columns(self, n: int) -> None:
        """The first `n` columns left out: views (`_cut`: made whole before the next write)."""
        if n > 0 and self.keys is not None:
            drop = lambda x: x[:, :, n:]  # noqa: E731
            self.keys, self.values = map_parts(drop, self.keys), map_parts(drop, self.values)
            self._cut = True
        self._idx -= n

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append `other`'s rows, both batches right-justified to the longer one."""
        self._check_same_format(other)
        self.flush()  # (every row ends at `_idx`, as the rows joining do)
        other.flush()
        self._tail = None
        if self.keys is None and other.keys is None:
            self._join_padding(other, 0, 0)
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        both = (self, other)
        idx = max(self._idx, other._idx)
        # Only written positions are kept (and `_spare` room after them).
        width = idx + self._spare(idx)

        self.keys = stacked_caches(both, "keys", idx, width)
        self.values = stacked_caches(both, "values", idx, width)
        self._join_padding(other, idx - self._idx, idx - other._idx)
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = idx

    def _join_padding(self, other: BatchQuantizedKVCache, mine: int, theirs: int) -> None:
        """The left padding of `other`'s rows after this batch's, each side's
        `mine` and `theirs` positions longer."""
        if self._host_padding is not None and other._host_padding is not None:
            self._set_padding([p + mine for p in self._host_padding]
                              + [p + theirs for p in other._host_padding])  # fmt: skip
        else:
            self.left_padding = mx.concatenate(
                [self.left_padding + mine, other.left_padding + theirs]
            )

    def extract(self, idx: int, padding: int | None = None) -> QuantizedKVCache:
        """Row `idx` alone, its padding left out (`padding`, where the caller
        knows it: read from the device else), as mlx-lm's single-sequence cache."""
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None:
            return cache
        self.flush()
        if padding is None:
            host = self._padding_of([idx])
            padding = host[0] if host is not None else self.left_padding[idx].item()
        row = lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx])  # noqa: E731
        cache.keys, cache.values = map_parts(row, self.keys), map_parts(row, self.values)
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch of single-sequence caches, each right-aligned to the longest."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):
            raise ValueError("caches of different group sizes or bits cannot be batched")
        # `offset`, not `size()`: QuantizedKVCache does not define size (it reads 0).
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, group_size=group_size, bits=bits)
        if longest == 0:
            return batch
        full = next(c for c in caches if c.keys is not None)
        size = longest + batch._spare(longest)
        keys = _zeros_like_rows(full.keys, len(caches), size)
        values = _zeros_like_rows(full.values, len(caches), size)
        for i, (c, n, p) in enumerate(zip(caches, lengths, padding, strict=True)):
            if n == 0:
                continue
            for store, src in ((keys, c.keys), (values, c.values)):
                for buf, part in zip(store, src, strict=True):
                    buf[i : i + 1, :, p:longest] = part[:, :, :n]
        batch.keys, batch.values = keys, values
        batch._idx = longest
        batch.offset = batch.offset + longest
        return batch

    def _check_same_format(self, other: BatchQuantizedKVCache) -> None:
        if (other.group_size, other.bits) != (self.group_size, self.bits):
            raise ValueError("caches of different group sizes or bits cannot be batched")

    # -- bookkeeping ----------------------------------------------------------

    @property
    def state(self) -> tuple:
        self.flush()
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self._tail, self._tailed = None, 0
        self._cut = True

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.flush()
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self) -> int:
        return self._idx + self._tailed

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return _nbytes(self) + (0 if self._tail is None else sum(x.nbytes for x in self._tail))


def _merge_quantized(cls: type, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
    return BatchQuantizedKVCache.merge(caches)


# mlx-lm merges a batch through its first row's cache class (generate._merge_caches).
QuantizedKVCache.merge = classmethod(_merge_quantized)
# And counts what waits to be prefilled, fresh caches too, which mlx-lm's own
# `nbytes` fails on (its keys are None).
QuantizedKVCache.nbytes = property(_nbytes)
