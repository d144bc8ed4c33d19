"""mlx-lm's batched KV cache where it does more than a step needs (engine thread).

Installed on import, for every BatchKVCache of the process:

- One row (never padded: padding lines rows up with each other) is masked
  with no array. A prompt chunk attends causally, a decoded token to every
  key; the fused kernels without a mask are faster at long context (several
  times for a chunk). A long prompt prefills alone, so this is its every
  pass, and a lone stream's every token. Whether several rows are padded
  would be read from the step before: they keep the array.
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

from mlx_lm.models.cache import BatchKVCache


def _no_mask_array_for_one_row(make_mask: Callable) -> Callable:
    def mask(self: BatchKVCache, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        plain = not return_array and all(v is None for v in kwargs.values())
        if self.left_padding.size == 1 and plain:
            return "causal" if N > 1 else None
        return make_mask(self, N, return_array=return_array, **kwargs)

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


BatchKVCache.make_mask = _no_mask_array_for_one_row(BatchKVCache.make_mask)
BatchKVCache.filter = _filter(BatchKVCache.filter)
