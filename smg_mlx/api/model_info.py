"""What the router asks about a model, read from its directory (no MLX)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smg_mlx.model_config import (
    DEFAULT_CONTEXT_LENGTH,
    BadModelConfig,
    first,
    model_configs,
    named_context,
    token_ids,
    whole,
)

log = logging.getLogger(__name__)

# GetModelInfo reports lengths and token ids as uint32.
UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    served_model_name: str
    model_type: str
    architectures: tuple[str, ...]
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None


def _ids(value: Any, key: str) -> list[int]:
    """The ids a config gives under `key` (generation_config.json's are checked
    as it is read: a wrong one here is config.json's)."""
    ids = token_ids(value)
    if ids is None:
        raise BadModelConfig(
            f"config.json gives {key} as {value!r}, not a token id or a list of them; fix it"
        )
    return ids


def load_model_info(
    model_dir: Path,
    tokenizer: Any,
    served_model_name: str | None,
    generation: dict[str, Any] | None = None,
) -> ModelInfo:
    """Collect model facts from config.json, the tokenizer and `generation` (what
    generation_config.json holds; None where it is not read)."""
    configs = model_configs(model_dir)
    config = configs[0]
    gen_config = generation or {}

    context = named_context(configs)
    if context is None:
        log.warning(
            "%s/config.json names no context length; assuming %d",
            model_dir,
            DEFAULT_CONTEXT_LENGTH,
        )
        context = DEFAULT_CONTEXT_LENGTH
    if context < 2:
        raise BadModelConfig(
            f"config.json gives a context length of {context}; a model needs at least 2 "
            "tokens (one of prompt, one to generate): fix max_position_embeddings"
        )
    if context > UINT32_MAX:
        log.warning("config.json gives a context length of %d; serving %d", context, UINT32_MAX)
        context = UINT32_MAX
    vocab = first(configs, ("vocab_size",))
    vocab = whole(len(tokenizer) if vocab is None else vocab, "vocab_size")
    if not 0 < vocab <= UINT32_MAX:
        raise BadModelConfig(f"config.json gives a vocab_size of {vocab}; fix it")
    if len(tokenizer) > vocab:
        # A tokenizer of another model (or one with tokens added after training):
        # texts that come out with those ids are refused, request by request.
        log.warning(
            "the tokenizer has %d tokens and the model's vocabulary %d: prompts that "
            "tokenize to ids %d and above will be refused as outside the vocabulary; "
            "serve the tokenizer that came with the model",
            len(tokenizer), vocab, vocab,
        )  # fmt: skip

    def valid(ids: list[int], key: str) -> list[int]:
        kept = [i for i in ids if 0 <= i < vocab]
        if len(kept) < len(ids):
            log.warning("ignoring %s %s: outside the vocabulary", key, sorted(set(ids) - set(kept)))
        return kept

    eos = set(_ids(first(configs, ("eos_token_id",)), "eos_token_id"))
    eos.update(_ids(gen_config.get("eos_token_id"), "eos_token_id"))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))

    def token_id(key: str, tokenizer_value: int | None) -> int | None:
        value = first([gen_config, *configs], (key,))
        value = value if value is not None else tokenizer_value
        ids = valid(_ids(value, key)[:1], key)
        return ids[0] if ids else None

    return ModelInfo(
        # Absolute: the router reads the directory where it can, from its own working directory.
        model_path=str(model_dir.absolute()),
        served_model_name=served_model_name or model_dir.name,
        model_type=str(first(configs, ("model_type",)) or ""),
        architectures=_architectures(config.get("architectures")),
        context_length=context,
        vocab_size=vocab,
        eos_token_ids=tuple(sorted(valid(sorted(eos), "eos_token_id"))),
        bos_token_id=token_id("bos_token_id", tokenizer.bos_token_id),
        pad_token_id=token_id("pad_token_id", tokenizer.pad_token_id),
    )


def _architectures(value: Any) -> tuple[str, ...]:
    """config.json's architectures: a list of names (one name alone is taken as
    a list of one)."""
    if not value:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise BadModelConfig(
            f"config.json gives architectures as {value!r}, not a list of names: fix it"
        )
    return tuple(value)
