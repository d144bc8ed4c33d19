"""What a model directory's config.json (and generation_config.json) say, read
without MLX: the model facts the router asks for (`api.model_info`) and the
context the engine's warm-up prepares for (`engine.batch`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

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
    """The JSON object in `path` ({} where there is no such file); raises
    BadModelConfig, naming the file, where it holds none."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # UnicodeDecodeError too
        raise BadModelConfig(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise BadModelConfig(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def generation_config(model_dir: Path) -> dict[str, Any]:
    """The model's generation_config.json ({} without one). One that is not a
    JSON object is left out with a warning that names it, as mlx-lm leaves it out:
    it holds defaults, not what the model is."""
    try:
        return read_json(model_dir / "generation_config.json")
    except BadModelConfig as exc:
        log.warning(
            "%s; serving without the model's sampling values and end-of-sequence ids in it: "
            "fix the file, or pass --generation-config none",
            exc,
        )
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
