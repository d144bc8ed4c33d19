"""Attention over quantized KV caches with its scores bounded (engine thread).

mlx-lm's attention over a quantized cache
(`models.base.quantized_scaled_dot_product_attention`) holds every query's
scores over every key at once: a 4,096-token prefill chunk over 32k keys of
a 32-head model holds gigabytes. Once installed, it runs on blocks of a
pass's queries whose scores fit `costs.QUANTIZED_SCORES_BYTES`, each block
evaluated before the next (left lazy, MLX would hold every block's scores
together). A query's output depends on no other query's, so the result is
the same.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from smg_mlx.engine.memory.costs import QUANTIZED_SCORES_BYTES, SMALLEST_BLOCK, MemoryModel
from smg_mlx.logs import format_bytes

log = logging.getLogger(__name__)

_whole = base.quantized_scaled_dot_product_attention
_per_score = 0.0  # bytes a prefill holds per query and key (the probe's figure)


def install(memory: MemoryModel) -> MemoryModel:
    """Bound the quantized attention's scores from now on, by what `memory`
    says a query and key cost; `memory`, bounded as the planner then sees it."""
    global _per_score
    _per_score = memory.prefill_per_context
    base.quantized_scaled_dot_product_attention = bounded
    log.info(
        "quantized attention: a pass's queries run in blocks whose scores fit %s",
        format_bytes(QUANTIZED_SCORES_BYTES),
    )
    return dataclasses.replace(memory, scores_bound=QUANTIZED_SCORES_BYTES)


def bounded(
    queries: mx.array, q_keys: tuple, q_values: tuple, scale: float, mask: Any,
    group_size: int = 64, bits: int = 8,
) -> mx.array:  # fmt: skip
    """mlx-lm's quantized attention, on blocks of queries (module doc); never
    fewer than SMALLEST_BLOCK: decoding and checking passes (a few queries a
    row) run whole, as before, and no prompt in blocks of a handful."""
    rows, _, length, _ = queries.shape
    keys = q_keys[0].shape[-2]
    block = max(SMALLEST_BLOCK, int(QUANTIZED_SCORES_BYTES // max(rows * keys * _per_score, 1.0)))
    if length <= block or isinstance(mask, str):
        return _whole(queries, q_keys, q_values, scale, mask, group_size, bits)
    parts = []
    for start in range(0, length, block):
        end = start + block
        part = _whole(
            queries[:, :, start:end], q_keys, q_values, scale,
            None if mask is None else mask[..., start:end, :], group_size, bits,
        )  # fmt: skip
        mx.eval(part)
        parts.append(part)
    return mx.concatenate(parts, axis=2)
