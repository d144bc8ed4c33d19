"""--kv-bits: the rows' KV caches stored quantized (engine thread).

A row starts from mlx-lm's QuantizedKVCache, one per layer; mlx-lm's
BatchGenerator merges those into `quantized_kv.BatchQuantizedKVCache` and
hands each finished row back as QuantizedKVCache again, which the prompt
cache keeps as it is (no re-quantizing on the way in or out).

Only plain attention caches have a quantized counterpart: a model with
sliding windows or recurrent state, or with heads that do not split into
whole quantization groups, is refused at start-up rather than served with
some layers unquantized.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from smg_mlx.config import KV_GROUP_SIZES, EngineConfig
from smg_mlx.engine.batch import quantized_kv  # noqa: F401 - gives QuantizedKVCache its merge
from smg_mlx.engine.memory.probe import probed_cache, token_bytes
from smg_mlx.engine.types import LayerCaches, Unservable
from smg_mlx.logs import format_bytes

log = logging.getLogger(__name__)


def caches_for(
    config: EngineConfig, model: nn.Module, whose: str = "this model's"
) -> LayerCaches | None:
    """What makes a row's fresh per-layer caches under --kv-bits (None: off,
    mlx-lm makes the model's own); refused (types.Unservable) for a model
    whose caches cannot all be quantized (`whose`: the model, as refusals name it)."""
    if config.kv_bits is None:
        return None
    bits, group = config.kv_bits, config.kv_group_size
    flag = f"--kv-bits {bits}"
    cache = make_prompt_cache(model)
    if (names := other_kinds(cache)) is not None:
        raise Unservable(
            f"{flag}: {whose} caches include {names}, not plain attention KV caches, "
            "which alone can be quantized; leave out --kv-bits"
        )
    # The heads' sizes, from a pass never evaluated: shapes are known before any work.
    model(mx.array([[1]]), cache=cache)
    # (A rank holding part of a pipeline leaves the other ranks' layers empty.)
    arrays = [a for layer in cache if layer.keys is not None for a in (layer.keys, layer.values)]
    heads = sorted({a.shape[-1] for a in arrays})
    if any(size % group for size in heads):
        fits = [g for g in KV_GROUP_SIZES if not any(size % g for size in heads)]
        fix = (
            f"give --kv-group-size {' or '.join(map(str, fits))}, or leave out --kv-bits"
            if fits
            else f"no --kv-group-size offered ({', '.join(map(str, KV_GROUP_SIZES))}) does: "
            f"{whose} KV cannot be quantized, leave out --kv-bits"
        )
        raise Unservable(
            f"{flag}: {whose} head sizes ({', '.join(map(str, heads))}) are not a "
            f"multiple of --kv-group-size {group}, which quantization needs; {fix}"
        )
    layers = len(cache)

    def fresh() -> list[QuantizedKVCache]:
        return [QuantizedKVCache(group_size=group, bits=bits) for _ in range(layers)]

    return fresh


def other_kinds(cache: list) -> str | None:
    """The names of the kinds of `cache`'s layers other than plain attention
    KVCaches (None: there are none): those neither quantize nor take tokens back."""
    kinds = {type(layer) for layer in cache} - {KVCache}
    return ", ".join(sorted(k.__name__ for k in kinds)) or None


def log_cost(kv_format: str, per_token: float, model: nn.Module, stream: mx.Stream) -> None:
    """The start-up line of what a token's KV costs as stored (`per_token`,
    measured by the probe), against the model's own caches."""
    cache = probed_cache(model, stream)
    own = token_bytes(cache)
    # Named: a float32 model's own KV takes twice a 16-bit one's.
    dtype = next((c.keys.dtype for c in cache if c.keys is not None), None)
    name = str(dtype).removeprefix("mlx.core.") + " " if dtype is not None else ""
    log.info(
        "KV caches stored as %s: %s per token, %.2fx of the model's own %sKV (%s)",
        kv_format, format_bytes(per_token), per_token / own, name, format_bytes(own),
    )  # fmt: skip
