"""Whether this worker decodes speculatively, and the start-up line that says so."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from smg_mlx.config import EngineConfig
from smg_mlx.engine.speculative.decoding import Drafting, DraftStats
from smg_mlx.engine.speculative.pacing import Pacing

log = logging.getLogger(__name__)


def drafting_for(
    config: EngineConfig, model: nn.Module, group: mx.distributed.Group | None, batched: bool
) -> Drafting | None:
    """What both lanes share to decode speculatively, or None where it is off
    (`batched`: rows of different lengths may share a pass of several tokens
    a row, as a pass checking proposals is)."""
    setting, most = config.speculative, config.num_draft_tokens
    ranks = group.size() if group is not None else 1
    why_not = _why_not(setting, model, ranks, batched)
    if why_not is not None:
        log.info("speculative decoding: off (%s)", why_not)
        return None
    always = setting == "always"
    log.info(
        "speculative decoding: prompt lookup, up to %d proposed tokens a stream a pass, %s",
        most, "wherever there are some" if always else "where measured pass times say it pays",
    )  # fmt: skip
    return Drafting(most, Pacing(always=always), DraftStats())


def _why_not(setting: str, model: nn.Module, ranks: int, batched: bool) -> str | None:
    if setting == "off":
        return "--speculative off"
    if ranks > 1:
        # Each rank would pace its passes by its own clock; they must run the same passes.
        return "several ranks"
    kinds = {type(cache) for cache in make_prompt_cache(model)}
    if kinds != {KVCache}:
        names = ", ".join(sorted(kind.__name__ for kind in kinds))
        return f"this model's caches ({names}) cannot take tokens back"
    if not batched:
        return "this model's prompts prefill together only at equal lengths"
    return None
