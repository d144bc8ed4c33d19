"""Whether this worker decodes speculatively, and the start-up line that says so."""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_tokenizer

from smg_mlx.config import EngineConfig
from smg_mlx.engine.batch.kv_format import other_kinds
from smg_mlx.engine.speculative.decoding import Drafting, DraftStats
from smg_mlx.engine.speculative.pacing import Pacing
from smg_mlx.engine.types import Unservable

log = logging.getLogger(__name__)


def drafting_for(
    config: EngineConfig, model: nn.Module, group: mx.distributed.Group | None, batched: bool
) -> Drafting | None:
    """What both lanes share to decode speculatively, or None where it is off
    (`batched`: rows of different lengths may share a pass of several tokens
    a row, as a pass checking proposals is)."""
    setting, most = config.speculative, config.num_draft_tokens
    ranks = group.size() if group is not None else 1
    why_not = _why_not(config, model, ranks, batched)
    if why_not is not None:
        # Asked for (its default is off), it is worth a warning.
        say = log.info if setting == "off" else log.warning
        say("speculative decoding: off (%s)", why_not)
        return None
    always = setting == "always"
    draft = None if config.draft_model is None else _draft(config, model)
    log.info(
        "speculative decoding: %s, up to %d proposed tokens a stream a pass, %s",
        "prompt lookup" if draft is None else f"the draft model {config.draft_model}", most,
        "wherever there are some" if always else "where measured pass times say it pays",
    )  # fmt: skip
    return Drafting(most, Pacing(always=always), DraftStats(), draft)


def _draft(config: EngineConfig, model: nn.Module) -> nn.Module:
    """The draft model, loaded; refused (types.Unservable) unless it can
    propose the model's tokens: the same tokenizer, no more outputs than the
    model has inputs, caches that take tokens back."""
    started = time.perf_counter()
    draft_path = config.draft_model
    draft, draft_tokenizer = load(str(draft_path))
    vocabulary = load_tokenizer(config.model_path).vocab
    if draft_tokenizer.vocab != vocabulary:
        raise Unservable(
            f"--draft-model {draft_path}: its tokenizer's vocabulary ({len(draft_tokenizer.vocab)} "
            f"tokens) is not the model's ({len(vocabulary)}): a draft must share the model's "
            "tokenizer (e.g. a smaller model of the same family)"
        )
    token = mx.array([[0]])
    outputs, inputs = draft(token).shape[-1], model(token).shape[-1]
    if outputs > inputs:
        raise Unservable(
            f"--draft-model {draft_path}: it scores {outputs} token ids, the model knows "
            f"{inputs}: a draft must not propose ids the model cannot read"
        )
    if (names := other_kinds(make_prompt_cache(draft))) is not None:
        raise Unservable(
            f"--draft-model {draft_path}: its caches ({names}) cannot take tokens back; "
            "choose a draft with plain attention"
        )
    log.info("draft model %s loaded in %.1fs", draft_path, time.perf_counter() - started)
    return draft


def _why_not(config: EngineConfig, model: nn.Module, ranks: int, batched: bool) -> str | None:
    if config.speculative == "off":
        return "--speculative off"
    if ranks > 1:
        # Each rank would pace its passes by its own clock; they must run the same passes.
        return "several ranks"
    if (names := other_kinds(make_prompt_cache(model))) is not None:
        return f"this model's caches ({names}) cannot take tokens back"
    if not batched:
        if config.batching == "equal-lengths":
            return "--batching equal-lengths: prompts prefill together only at equal lengths"
        return "this model's prompts prefill together only at equal lengths"
    return None
