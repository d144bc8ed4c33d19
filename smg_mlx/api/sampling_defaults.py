"""The model's own sampling values, from its generation_config.json: what a request
that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets
(`api.translation` applies them), as vLLM does by default."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What a request may send (api.translation refuses more). Above MAX_TEMPERATURE
# every token is about as likely as any other; far above it, 1/temperature
# underflows to 0 and filtered tokens' logits become NaN. A repetition penalty
# scales a logit by at most 100 either way, which keeps it finite (float16's
# largest is 65504).
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY = (0.01, 100.0)

# The range a request could send each value in (a default outside it is ignored).
RANGES = {
    "temperature": (0.0, MAX_TEMPERATURE),
    "top_p": (0.0, 1.0),
    "top_k": (0, math.inf),
    "min_p": (0.0, 1.0),
    "repetition_penalty": REPETITION_PENALTY,
}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def __str__(self) -> str:
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        return ", ".join(f"{name} {value:g}" for name, value in values if value is not None)


NO_DEFAULTS = SamplingDefaults()  # the worker's own: temperature 1, no filters


def read(config: dict[str, Any], path: Path) -> SamplingDefaults:
    """The sampling values `config` (what `path`, a generation_config.json, holds)
    names; one that is not a number a request could send is left out, with a warning."""
    found = {}
    for name, (low, high) in RANGES.items():
        value = config.get(name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        whole = name != "top_k" or (number and float(value).is_integer())
        if not (number and whole and low <= value <= high):
            log.warning("ignoring %s's %s of %r: not a value a request may send", path, name, value)
            continue
        found[name] = int(value) if name == "top_k" else float(value)
    return SamplingDefaults(**found)
