"""Turn a GenerateRequest into the engine's GenerationSpec, or say what is wrong.

Everything a request could get wrong is caught here, on the asyncio side, so
nothing invalid ever reaches the engine thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from smg_mlx.api.model_info import ModelInfo
from smg_mlx.engine.types import GenerationSpec, LogitsSettings, SamplingSettings

MAX_LOGPROBS = 20  # top alternatives per token, as in the OpenAI API
# A text prompt longer than this many characters per context token cannot fit:
# it is refused before tokenizing, which takes seconds for megabytes of text.
MAX_TEXT_CHARS_PER_TOKEN = 64
# Temperatures below this are greedy: 1/temperature would overflow float32
# and sample at random, and far above it sampling is greedy in all but name.
GREEDY_BELOW = 1e-5


class InvalidRequest(ValueError):
    """A request the worker cannot serve; the message says what to fix."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def _finite(name: str, value: float) -> float:
    _check(math.isfinite(value), f"sampling_params.{name} must be a finite number, got {value}")
    return float(value)


def prompt_text(request: Any, info: ModelInfo) -> str | None:
    """The text prompt, bounded before anything tokenizes it; None when the
    request carries token ids."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("no input: set tokenized.input_ids or text")
    if kind != "text":
        return None
    _check(bool(request.text), "text is empty: send a non-empty prompt")
    limit = info.context_length * MAX_TEXT_CHARS_PER_TOKEN
    _check(
        len(request.text) <= limit,
        f"the text has {len(request.text)} characters; this model's context of "
        f"{info.context_length} tokens takes at most {limit} "
        f"({MAX_TEXT_CHARS_PER_TOKEN} per token): send a shorter prompt",
    )
    return request.text


def prompt_ids(ids: Sequence[int], info: ModelInfo) -> tuple[int, ...]:
    """The prompt's token ids, checked against the vocabulary and context."""
    _check(bool(ids), "the prompt has no tokens: send at least one input id")
    # Length first: it is cheap, and a huge prompt should not be scanned.
    _check(
        len(ids) < info.context_length,
        f"the prompt has {len(ids)} tokens; this model's context length is "
        f"{info.context_length}, so prompts must be shorter than that",
    )
    bad = [t for t in ids if t >= info.vocab_size]
    _check(
        not bad,
        f"token id {bad[0] if bad else 0} is outside the vocabulary "
        f"(ids must be below {info.vocab_size})",
    )
    return tuple(ids)


def sampling_settings(params: Any, vocab_size: int) -> SamplingSettings:
    temperature = 1.0
    if params.HasField("temperature"):
        temperature = _finite("temperature", params.temperature)
        _check(temperature >= 0, f"sampling_params.temperature must be >= 0, got {temperature}")
    # proto3 cannot tell an unset float from 0, so 0 means "off" here.
    top_p = _finite("top_p", params.top_p)
    _check(0 <= top_p <= 1, f"sampling_params.top_p must be in (0, 1], got {top_p}")
    min_p = _finite("min_p", params.min_p)
    _check(0 <= min_p <= 1, f"sampling_params.min_p must be in [0, 1], got {min_p}")
    return SamplingSettings(
        temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
        top_p=top_p or 1.0,
        # Keeping the whole vocabulary or more is no filter at all.
        top_k=params.top_k if params.top_k < vocab_size else 0,
        min_p=min_p,
        # MLX random keys take unsigned seeds; a negative int32 maps to its bits.
        seed=params.seed % 2**32 if params.HasField("seed") else None,
    )


def logits_settings(params: Any, vocab_size: int) -> LogitsSettings:
    repetition = _finite("repetition_penalty", params.repetition_penalty)
    _check(
        repetition >= 0,
        f"sampling_params.repetition_penalty must be > 0 (1 is off), got {repetition}",
    )
    bias = tuple(sorted((int(k), _finite("logit_bias", v)) for k, v in params.logit_bias.items()))
    bad = [k for k, _ in bias if not 0 <= k < vocab_size]
    _check(
        not bad,
        f"logit_bias names token id {bad[0] if bad else 0}, outside the vocabulary "
        f"(ids must be in [0, {vocab_size}))",
    )
    return LogitsSettings(
        repetition_penalty=repetition or 1.0,
        frequency_penalty=_finite("frequency_penalty", params.frequency_penalty),
        presence_penalty=_finite("presence_penalty", params.presence_penalty),
        logit_bias=bias,
    )


def generation_spec(
    request: Any, info: ModelInfo, prompt: Sequence[int], memory_tokens: int
) -> GenerationSpec:
    """Validate a GenerateRequest whose prompt is `prompt` (its token ids, or its
    text tokenized) and translate it; raises InvalidRequest. `memory_tokens`:
    the most tokens (prompt and output) one request may have in the worker's
    memory budget."""
    prompt = prompt_ids(prompt, info)
    _check(
        len(prompt) < memory_tokens,
        f"the prompt has {len(prompt)} tokens; this worker's memory budget holds at most "
        f"{memory_tokens} tokens of prompt and output per request: send a shorter prompt "
        "or use a worker with more memory",
    )
    params = request.sampling_params
    # Past the context end, or what memory holds, generation stops with
    # finish_reason "length".
    room = min(info.context_length, memory_tokens) - len(prompt)
    max_tokens = room
    if params.HasField("max_tokens"):
        _check(params.max_tokens > 0, "sampling_params.max_tokens must be at least 1")
        max_tokens = min(params.max_tokens, room)
    logprobs = None
    if params.HasField("logprobs"):
        logprobs = params.logprobs
        _check(
            0 <= logprobs <= MAX_LOGPROBS,
            f"sampling_params.logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}",
        )
    stops = set(params.stop_token_ids)
    bad = [t for t in stops if t >= info.vocab_size]
    _check(not bad, f"stop_token_ids has {bad[0] if bad else 0}, outside the vocabulary")
    if not params.ignore_eos:
        stops.update(info.eos_token_ids)
    return GenerationSpec(
        prompt=prompt,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(stops),
        sampling=sampling_settings(params, info.vocab_size),
        logits=logits_settings(params, info.vocab_size),
        logprobs=logprobs,
    )
