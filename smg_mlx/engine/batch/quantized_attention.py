"""Attention over quantized KV caches (engine thread).

Under --kv-bits, `install` puts `attention` in place of mlx-lm's
(`models.base.quantized_scaled_dot_product_attention`) before any pass runs:

- **A pass of a few queries a row** (decoding, checking proposals) runs as
  one kernel on CUDA (`fused_quantized_attention`, for the heads it takes).
  Elsewhere it reads the keys and values quantized, as mlx-lm does, with one
  change: mlx-lm gives
  each KV head's group of query heads its keys broadcast along a batch axis,
  and mlx's CUDA quantized matmul takes keys broadcast along any batch axis
  for one matrix shared by the whole batch (every row and head would attend
  to the first one's keys). Here a KV head's query heads are folded into the
  query axis instead, so nothing is broadcast. (On CUDA, keys whose head is
  one quantization group are dequantized for their product: mlx's kernel for
  those gets it wrong on Hopper GPUs.)
- **A longer pass** (a prompt's chunk) dequantizes them and runs the fused
  attention, as the model's own caches do. mlx-lm's way holds every query's
  scores over every key at once (a 4,096-token chunk over 32k keys of a
  32-head model: gigabytes) through kernels made for a few rows; the
  dequantized copies cost what the model's own keys and values would, for
  the layers in flight (`layer_waits`). Where prefills run in few shapes
  (`attention_shapes`, CUDA), the keys and values are padded to the shape
  while still quantized, and dequantized from there: one full-size copy
  rather than two.

Where a few-query pass runs by quantized matmuls on CUDA, mlx compiles a
kernel for each tile size the folded query count picks (and would for key
counts that end part-way through a tile, which the cache's buffers never do
there: `quantized_kv.WHOLE`): about a minute each the first time on a host,
and a pass that meets one first stalls every stream that long. The warm-up
runs the few-query passes at every query count (`build_kernels`), for each
kind the model's passes showed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from smg_mlx.engine.batch import fused_quantized_attention as fused
from smg_mlx.engine.batch.attention_shapes import FEW_QUERIES, AttentionShapes
from smg_mlx.engine.batch.layer_waits import LayerWaits
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.progress import Progress

log = logging.getLogger(__name__)

Quantized = tuple[mx.array, mx.array, mx.array]
# What picks a few-query pass's kernels: heads, KV heads, key and value head
# sizes, dtype, the quantization's group size and bits.
Kind = tuple[int, int, int, int, Any, int, int]
# The key count `build_kernels` runs at: a whole number of any tile, as the
# cache's buffers hold (a whole number of its step).
BUILD_KEYS = BatchQuantizedKVCache.step
# Keys a part of the values' product covers (`_weighted`), where the batch
# reads its whole buffers (CUDA: allocated in blocks that this divides).
SPLIT_KEYS = 256
SPLIT = mx.cuda.is_available()
SIDE_BY_SIDE = 512  # products a GPU runs at once, about (a few per multiprocessor)
# mlx's CUDA kernel for the keys' product where a head is one quantization
# group (Hopper's) returns wrong scores, NaN among them, for these batched
# products: there the keys are dequantized first (`_scores`).
WHOLE_GROUP_KEYS_DEQUANTIZED = mx.cuda.is_available()


def install(shapes: AttentionShapes | None, seen: set[Kind] | None = None) -> None:
    """Quantized attention by `attention` from now on, prefills in `shapes`
    where they are given and installed; the kinds of its few-query passes
    go in `seen` (for `build_kernels`)."""
    base.quantized_scaled_dot_product_attention = partial(
        attention, shapes=shapes, few=FewQueryPasses(seen), waits=LayerWaits()
    )


def attention(
    queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float, mask: Any,
    group_size: int = 64, bits: int = 8, shapes: AttentionShapes | None = None,
    few: FewQueryPasses | None = None, waits: LayerWaits | None = None,
) -> mx.array:  # fmt: skip
    """softmax(queries · keysᵀ · scale, masked) · values, the keys and values
    quantized (module doc)."""
    if queries.shape[2] <= FEW_QUERIES:
        few = few or FewQueryPasses(None)
        return few(queries, q_keys, q_values, scale, mask, group_size, bits)

    def dequantize(parts: Quantized) -> mx.array:
        return mx.dequantize(*parts, group_size=group_size, bits=bits)

    if shapes is not None and shapes.installed:
        return shapes.prefill(queries, q_keys, q_values, scale, mask, dequantize)
    keys, values = dequantize(q_keys), dequantize(q_values)
    out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    return out if waits is None else waits.after(out, keys.shape[0] * keys.shape[2])


class FewQueryPasses:
    """Few-query passes: one fused kernel where it fits (CUDA), else `_few`
    (the keys and values may end with a 16-bit tail, `quantized_kv.TAILS`: on
    the CPU, in tests, quantized there and read after the rest).

    Every layer of a pass brings the same mask and shapes: what follows from
    them (its kind, whether the kernel takes it, the mask as the kernel reads
    it, the launch) is worked out at the first and kept for the rest, since
    a small model's decoding step on CUDA waits on the host, a layer at a time."""

    def __init__(self, seen: set[Kind] | None) -> None:
        self._seen = seen  # the kinds met, for `build_kernels`
        self._mask: Any = None  # the last pass's (compared by identity: arrays compare by value)
        self._shapes: tuple | None = None
        self._launch: fused.Launch | None = None  # None: not the fused kernel's

    def __call__(
        self, queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float,
        mask: Any, group_size: int, bits: int,
    ) -> mx.array:  # fmt: skip
        shapes = (
            queries.shape, queries.dtype, len(q_keys), q_keys[0].shape, q_keys[-1].shape,
            q_values[1].shape, scale, group_size, bits,
        )  # fmt: skip
        if mask is not self._mask or shapes != self._shapes:
            if self._seen is not None:
                self._seen.add(_kind(queries, q_keys, q_values, group_size, bits))
            self._launch = (
                fused.launcher(queries, q_keys, q_values, scale, mask, group_size, bits)
                if fused.fits(queries, q_keys, q_values, mask, group_size, bits) else None
            )  # fmt: skip
            self._mask, self._shapes = mask, shapes
        if self._launch is not None:
            return self._launch(queries, q_keys, q_values)
        if len(q_keys) > 3:
            q_keys, q_values = (_tail_quantized(q, group_size, bits) for q in (q_keys, q_values))
        return _few(queries, q_keys, q_values, scale, mask, group_size, bits)


def _tail_quantized(parts: tuple, group_size: int, bits: int) -> Quantized:
    *quantized, tail = parts
    more = mx.quantize(tail, group_size=group_size, bits=bits)
    return tuple(mx.concatenate([a, b], axis=2) for a, b in zip(quantized, more, strict=True))  # type: ignore[return-value]


def _few(
    queries: mx.array, q_keys: Quantized, q_values: Quantized, scale: float, mask: Any,
    group_size: int, bits: int,
) -> mx.array:  # fmt: skip
    """`attention` by quantized matmuls, each KV head's query heads folded into
    the query axis (module doc)."""
    rows, heads, length, dim = queries.shape
    kv_heads = q_keys[0].shape[1]
    repeats = heads // kv_heads
    folded = (queries * scale).reshape(rows, kv_heads, repeats * length, dim)
    scores = _scores(folded, q_keys, group_size, bits).reshape(rows, kv_heads, repeats, length, -1)
    if isinstance(mask, str):
        keys = scores.shape[-1]
        mask = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    if mask is not None:
        if mask.ndim > 3:  # (rows, 1 or KV heads, queries, keys): the same for each repeat
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if mx.default_device() == mx.cpu:
        # mlx's CPU kernel for the values' product sums in its inputs' dtype:
        # in 16 bits that rounds far past what quantizing the values costs.
        # (CUDA's sums 16-bit inputs in float32, on tensor cores.)
        scores = scores.astype(mx.float32)
    weights = mx.softmax(scores, axis=-1, precise=True)
    weights = weights.reshape(rows, kv_heads, repeats * length, -1)
    out = _weighted(weights, q_values, group_size, bits)
    return out.astype(queries.dtype).reshape(rows, heads, length, -1)


def _scores(folded: mx.array, q_keys: Quantized, group_size: int, bits: int) -> mx.array:
    """folded queries · keysᵀ, the keys quantized (see WHOLE_GROUP_KEYS_DEQUANTIZED)."""
    if WHOLE_GROUP_KEYS_DEQUANTIZED and folded.shape[-1] <= group_size:
        keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits)
        return folded @ keys.swapaxes(-1, -2)
    return mx.quantized_matmul(folded, *q_keys, transpose=True, group_size=group_size, bits=bits)


def _weighted(weights: mx.array, q_values: Quantized, group_size: int, bits: int) -> mx.array:
    """weights · values (float32 where the parts are summed). mlx's kernel for
    this product (its keys along the reduction) runs one serial loop over every
    key per head and row: at long context it waits on that loop, not on memory.
    Where the keys split evenly (the batch's whole buffers, on CUDA), the keys
    are cut into parts, each its own product, run side by side, and the parts
    are summed."""
    rows, kv_heads, m, keys = weights.shape
    parts = _parts(keys, rows * kv_heads)
    if parts < 2:
        return mx.quantized_matmul(
            weights, *q_values, transpose=False, group_size=group_size, bits=bits
        )
    chunk = keys // parts
    chunks = mx.contiguous(weights.reshape(rows, kv_heads, m, parts, chunk).swapaxes(2, 3))
    values = map(lambda x: x.reshape(rows, kv_heads, parts, chunk, x.shape[-1]), q_values)
    out = mx.quantized_matmul(chunks, *values, transpose=False, group_size=group_size, bits=bits)
    return out.astype(mx.float32).sum(axis=2)


def _kind(queries: mx.array, q_keys: Quantized, q_values: Quantized, group_size: int,
          bits: int) -> Kind:  # fmt: skip
    """A pass's `Kind` (the values' head size from their scales: a group each)."""
    return (
        queries.shape[1], q_keys[0].shape[1], queries.shape[-1],
        q_values[1].shape[-1] * group_size, queries.dtype, group_size, bits,
    )  # fmt: skip


def build_kernels(kinds: Iterable[Kind]) -> None:
    """Run a few-query pass at every query count up to FEW_QUERIES, for each
    kind (module doc)."""
    kinds = sorted(kinds, key=str)
    todo = [(kind, n, BUILD_KEYS) for kind in kinds for n in range(1, FEW_QUERIES + 1)]
    # The fused kernel's other form: passes long enough to be cut into parts.
    todo += [
        (kind, n, fused.PARTS_KEYS) for kind in kinds if _fused(kind)
        for n in range(1, FEW_QUERIES + 1)
    ]  # fmt: skip
    progress = Progress(log, "quantized attention kernels", "passes run", len(todo))
    for (heads, kv_heads, dk, dv, dtype, group_size, bits), n, keys in todo:
        q_keys, q_values = (
            tuple(mx.quantize(mx.zeros((1, kv_heads, keys, dim), dtype), group_size=group_size,
                              bits=bits))
            for dim in (dk, dv)
        )  # fmt: skip
        queries = mx.zeros((1, heads, n, dk), dtype)
        mask = mx.ones((1, 1, n, keys), mx.bool_)
        mx.eval(FewQueryPasses(None)(queries, q_keys, q_values, 1.0, mask, group_size, bits))  # type: ignore[arg-type]
        progress.advance()
    if todo:
        log.info(
            "quantized attention: passes of 1 to %d queries a row run in %.1fs (their kernels "
            "build the first time on a host: %s)",
            FEW_QUERIES, progress.seconds,
            "seconds, fused" if all(map(_fused, kinds))
            else "mlx's quantized matmuls, a minute each",
        )  # fmt: skip


def _fused(kind: Kind) -> bool:
    """Whether a kind's few-query passes run as the fused kernel."""
    _, _, key_dim, value_dim, _, group_size, bits = kind
    return fused.fits_kind(key_dim, value_dim, group_size, bits)


def _parts(keys: int, products: int) -> int:
    """The parts `_weighted` cuts `keys` into, beside `products` (rows times
    KV heads): enough that SIDE_BY_SIDE products run at once, each of a
    whole number of SPLIT_KEYS."""
    if not SPLIT or keys % SPLIT_KEYS:
        return 1
    parts = keys // SPLIT_KEYS
    while parts % 2 == 0 and parts // 2 * products >= SIDE_BY_SIDE:
        parts //= 2
    return parts
