"""Whether this worker decodes speculatively, and the start-up line that says so."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from smg_mlx.config import DRAFT_MODEL_TOKENS, LOOKUP_DRAFT_TOKENS, EngineConfig
from smg_mlx.engine.batch.kv_format import caches_for, other_kinds
from smg_mlx.engine.batch.loading import built_model
from smg_mlx.engine.memory.probe import weights
from smg_mlx.engine.speculative.decoding import CHAIN, Drafting, DraftStats
from smg_mlx.engine.speculative.draft_model import PaddedOtherwise
from smg_mlx.engine.speculative.pacing import Pacing
from smg_mlx.engine.speculative.shared_history import SharedHistory
from smg_mlx.engine.types import LayerCaches, Unservable
from smg_mlx.logs import format_bytes
from smg_mlx.model_config import named_context_length

log = logging.getLogger(__name__)


class Draft(NamedTuple):
    """The draft model, and what makes a row's fresh caches for it (--kv-bits; None: its own)."""

    model: nn.Module
    caches: LayerCaches | None


def draft_for(
    config: EngineConfig, model: nn.Module, group: mx.distributed.Group | None
) -> Draft | None:
    """The --draft-model, loaded and checked, where speculative decoding may
    run with it (see `drafting_for`): before the batch check, which takes
    longer, so that a draft that cannot serve is refused first."""
    if config.draft_model is None or _why_not(config, model, _ranks(group)) is not None:
        return None
    draft = _draft(config, model)
    caches = None
    if config.kv_bits is not None:
        try:  # its rows' caches are as many tokens as the model's: stored the same way
            caches = caches_for(config, draft, whose="the draft's")
        except Unservable as exc:
            raise Unservable(
                f"--draft-model {config.draft_model}: {exc} (or name another draft)"
            ) from None
    return Draft(draft, caches)


def drafting_for(
    config: EngineConfig, model: nn.Module, group: mx.distributed.Group | None, batched: bool,
    draft: Draft | None, one_width: bool = False,
) -> Drafting | None:  # fmt: skip
    """What both lanes share to decode speculatively, or None where it is off
    (`batched`: rows of different lengths may share a pass of several tokens
    a row, as a pass checking proposals is), with `draft` (`draft_for`) or
    prompt lookup; `one_width`: see `Drafting`."""
    setting = config.speculative
    most = config.num_draft_tokens or (LOOKUP_DRAFT_TOKENS if draft is None else DRAFT_MODEL_TOKENS)
    why_not = _why_not(config, model, _ranks(group))
    if why_not is None and not batched:
        if config.batching == "equal-lengths":
            why_not = (
                "--batching equal-lengths: a checking pass runs streams of different lengths "
                "together, which that mode avoids"
            )
        else:
            why_not = (
                "this model's rows come out other than alone when batched at different "
                "lengths (the start-up check), and a checking pass runs them so"
            )
    if why_not is not None:
        if config.draft_model is not None and setting != "off":
            why_not += f"; --draft-model {config.draft_model} is not used"
        # Asked for (its default is off), it is worth a warning.
        say = log.info if setting == "off" else log.warning
        say("speculative decoding: off (%s)", why_not)
        return None
    always = setting == "always"
    log.info(
        "speculative decoding: %s, up to %d proposed token%s a stream a pass, %s",
        "prompt lookup" if draft is None else f"the draft model {config.draft_model}", most,
        "" if most == 1 else "s",
        "wherever there are some" if always else "where measured pass times say it pays",
    )  # fmt: skip
    chain = CHAIN if draft is None else 1  # (a draft model's proposals wait on the host)
    return Drafting(
        most, Pacing(always=always, most=most, chain=chain), DraftStats(), *(draft or ()),
        one_width=one_width, shared=SharedHistory() if draft is None else None, chain=chain,
    )  # fmt: skip


def _ranks(group: mx.distributed.Group | None) -> int:
    return group.size() if group is not None else 1


def _draft(config: EngineConfig, model: nn.Module) -> nn.Module | PaddedOtherwise:
    """The draft model, loaded; refused (types.Unservable) unless it can
    propose the model's tokens: the same tokenizer (the server checked it; its
    ids padded to another count or not: `PaddedOtherwise`), caches that take
    tokens back."""
    started = time.perf_counter()
    draft_path = config.draft_model
    try:
        draft, _ = built_model(draft_path, lazy=False, strict=True)
    except Unservable as exc:
        raise Unservable(f"--draft-model: {exc}") from None
    token = mx.array([[0]])
    scores, ids = draft(token).shape[-1], model(token).shape[-1]
    reads = getattr(getattr(draft, "args", None), "vocab_size", None) or scores
    if reads < ids or scores > ids:  # (padding: the tokenizers are the same)
        how = ["ids the model writes past the draft's reach it as its last"] if reads < ids else []
        how += ["it proposes only ids the model reads"] if scores > ids else []
        log.info(
            "draft model %s: its token ids padded to %d (read) and %d (scored), the model's "
            "to %d: %s", draft_path, reads, scores, ids, "; ".join(how),
        )  # fmt: skip
        draft = PaddedOtherwise(draft, reads if reads < ids else None,
                                ids if scores > ids else None)  # fmt: skip
    if (names := other_kinds(make_prompt_cache(draft))) is not None:
        raise Unservable(
            f"--draft-model {draft_path}: its caches include {names}, which cannot take "
            "tokens back; choose a draft with plain attention"
        )
    mine, theirs = named_context_length(draft_path), named_context_length(config.model_path)
    if mine is not None and theirs is not None and mine < theirs:
        log.warning(
            "draft model %s reads %d tokens of context, the model %d: past that its "
            "proposals are mostly wrong (checked, so outputs are unchanged, but what "
            "speculation would gain there is lost)", draft_path, mine, theirs,
        )  # fmt: skip
    draft_bytes, model_bytes = weights(draft), weights(model)
    if draft_bytes >= model_bytes:
        # A draft pass then reads as many bytes as the model's own: each proposal
        # costs what a plain pass making that token would (the model itself, a
        # larger model of the family passed by mistake).
        log.warning(
            "draft model %s is not smaller than the model (its weights %s, the model's %s): "
            "each token it proposes costs about a pass of the model, so checking its "
            "proposals cannot be faster than plain decoding (--speculative auto finds that "
            "and decodes plainly; always is slower): name a smaller draft of the model's "
            "family", draft_path, format_bytes(draft_bytes), format_bytes(model_bytes),
        )  # fmt: skip
    log.info("draft model %s loaded in %.1fs", draft_path, time.perf_counter() - started)
    return draft


def _why_not(config: EngineConfig, model: nn.Module, ranks: int) -> str | None:
    """Why speculation is off whatever the batch check finds (None: it may run)."""
    if config.speculative == "off":
        # (also where no flag was given: the log names what turns it on)
        return "--speculative off, the default; --speculative auto turns on prompt lookup"
    if ranks > 1:
        # Each rank would pace its passes by its own clock; they must run the same passes.
        return "several ranks"
    if (names := other_kinds(make_prompt_cache(model))) is not None:
        return f"this model's caches include {names}, which cannot take tokens back"
    return None
