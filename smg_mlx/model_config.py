"""What a model directory's config.json says, read without MLX: the model
facts the router asks for (`api.model_info`) and the context the engine's
warm-up prepares for (`engine.batch`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Keys under which configs of different families store the context length.
CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)
DEFAULT_CONTEXT_LENGTH = 4096  # served where config.json names none


class BadModelConfig(ValueError):
    """The model directory's config cannot be served; the message says what is wrong."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def whole(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadModelConfig(f"config.json gives {what} as {value!r}, not a number") from None


def first(configs: list[dict[str, Any]], keys: tuple[str, ...]) -> Any:
    """The first value of `keys` that `configs`, in order, give (None: none)."""
    for cfg in configs:
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
    return None


def model_configs(model_dir: Path) -> list[dict[str, Any]]:
    """config.json, then the language model's settings, which multimodal
    checkpoints nest in it."""
    config = read_json(model_dir / "config.json")
    return [config, config.get("text_config") or {}]


def named_context(configs: list[dict[str, Any]]) -> int | None:
    """The context length `configs` name (None: they name none)."""
    context = first(configs, CONTEXT_KEYS)
    return None if context is None else whole(context, "the context length")


def named_context_length(model_dir: Path) -> int | None:
    """The context length the model's config names (None: it names none)."""
    return named_context(model_configs(model_dir))
