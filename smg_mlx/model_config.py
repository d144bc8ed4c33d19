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


TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")


def token_ids(value: Any) -> list[int] | None:
    """The token ids a config gives as one id, a list of them or null ([]);
    None where it gives something else."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values if v is not None):
        return None
    return [v for v in values if v is not None]


def generation_config(model_dir: Path) -> dict[str, Any]:
    """The model's generation_config.json ({} without one). One that is not a
    JSON object, or a token id in it that is none, is left out with a warning
    that names it, as mlx-lm leaves it out: it holds defaults, not what the
    model is."""
    path = model_dir / "generation_config.json"
    fix = "fix the file, or pass --generation-config none"
    try:
        config = read_json(path)
    except BadModelConfig as exc:
        log.warning("%s; serving without the model's sampling values and end-of-sequence "
                    "ids in it: %s", exc, fix)  # fmt: skip
        return {}
    for key in TOKEN_ID_KEYS:
        if key in config and token_ids(config[key]) is None:
            log.warning("%s gives %s as %r, not a token id or a list of them; serving "
                        "without it: %s", path, key, config.pop(key), fix)  # fmt: skip
    return config


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
