"""Turn a GenerateRequest into the engine's GenerationSpec, or say what is wrong.

Everything a request could get wrong is caught here, on the asyncio side, so
nothing invalid ever reaches the engine thread. `check_sizes` comes first,
on the lists' sizes counted in the request's bytes before it is parsed
(api.wire); `prompt_text` reads only a length; `generation_spec` walks the
payload (a large one off the loop: api.payload).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

from smg_mlx.api import responses, wire
from smg_mlx.api.model_info import ModelInfo
from smg_mlx.api.sampling_defaults import (
    MAX_TEMPERATURE,
    NO_DEFAULTS,
    REPETITION_PENALTY,
    SamplingDefaults,
)
from smg_mlx.config import RequestLimits
from smg_mlx.engine.types import GenerationSpec, LogitsSettings, SamplingSettings
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.logs import counted

MAX_LOGPROBS = 20  # top alternatives per token, as in the OpenAI API
# What a request carries besides its prompt's ids, at most, in bytes (its
# stop ids and logit biases within their default limits, and the rest).
REQUEST_BESIDES_IDS = 64 << 10
# A text prompt longer than this many characters per context token cannot fit:
# it is refused before tokenizing, which takes seconds for megabytes of text.
MAX_TEXT_CHARS_PER_TOKEN = 64
# Temperatures below this are greedy: 1/temperature would overflow float32
# and sample at random, and far above it sampling is greedy in all but name.
GREEDY_BELOW = 1e-5
# Ranges that keep a model's logits, and so every logprob, finite (float16's
# largest is 65504): OpenAI's for the additive penalties and biases (the
# repetition penalty's is with the temperature's, in api.sampling_defaults).
ADDITIVE_PENALTY = (-2.0, 2.0)
LOGIT_BIAS = (-100.0, 100.0)
# About how many bytes of a message each id or value takes: how much work
# checking a request's lists is, in api.payload's measure.
BYTES_PER_ITEM = 4
# Fields of a request besides its lists' entries, with room for a client that
# sends a field more than once (the last one counts).
OTHER_FIELDS = 64
# Values of top_p and repetition_penalty that leave the model's own default in
# place: proto3's unset 0, and 1, which the router sends for a request that
# names neither.
UNSET_OR_NEUTRAL = (0.0, 1.0)


class InvalidRequest(ValueError):
    """A request the worker cannot serve; the message says what to fix."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequest(message)


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def _in_range(name: str, value: float, low: float, high: float, allowed: str = "") -> float:
    """`value` if finite and in [low, high]; `allowed` words the range otherwise."""
    allowed = allowed or f"in [{low:g}, {high:g}]"
    # The fields are float32: a client's 0.01 arrives as 0.00999999977...
    _check(
        math.isfinite(value) and _float32(low) <= value <= _float32(high),
        f"sampling_params.{name} must be {allowed}, got {value:g}",
    )
    return float(value)


def _penalty(params: Any, name: str, low: float, high: float, off: float) -> float:
    """A penalty: 0 (proto3's unset) is `off`; any other value in [low, high]."""
    value = getattr(params, name)
    if value == 0:
        return off
    unset = "" if low <= 0 <= high else "0 (unset) or "
    return _in_range(name, value, low, high, f"{unset}in [{low:g}, {high:g}]")


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


def encode(tokenizer: Any, text: str) -> list[int]:
    """The text's token ids, with the special tokens the tokenizer adds (a BOS)
    unless the text begins with the BOS already, as a rendered chat template's
    does: a second BOS would change what the model sees (mlx-lm's generate
    does the same)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def check_sizes(raw: bytes, info: ModelInfo, limits: RequestLimits, memory_tokens: int) -> None:
    """A GenerateRequest's lists within this worker's limits and its prompt's
    ids within the context and memory, counted in its bytes (api.wire) before
    anything parses it; raises wire.Unreadable for bytes that are none."""
    # A request within every limit has no more fields than this (a list sent
    # unpacked has one per entry).
    most = info.context_length + limits.max_stop_token_ids + limits.max_logit_bias + OTHER_FIELDS
    too_many = None
    try:
        sizes = wire.list_sizes(raw, pb.GenerateRequest.DESCRIPTOR, most)
    except wire.TooManyFields as exc:  # what was counted may name the list at fault
        sizes, too_many = exc.sizes, exc
    at_least = "at least " if too_many else ""  # the walk stopped short
    for field, limit, flag in (
        ("stop_token_ids", limits.max_stop_token_ids, "stop-token-ids"),
        ("logit_bias", limits.max_logit_bias, "logit-bias"),
    ):
        count = sizes.get(f"sampling_params.{field}", 0)
        _check(
            count <= limit,
            f"sampling_params.{field} has {at_least}{counted(count, 'entry', 'entries')}; "
            f"this worker takes at most {limit} (its --max-{flag} flag)",
        )
    prompt_length(sizes.get("tokenized.input_ids", 0), info, memory_tokens, at_least)
    _check(
        too_many is None,
        f"the request has {too_many}, more than one with a prompt shorter than the "
        "context and lists within their limits",
    )


def prompt_length(length: int, info: ModelInfo, memory_tokens: int, at_least: str = "") -> None:
    """A prompt of `length` tokens (`at_least` that many: "at least ") fits the
    context and what memory holds for one request (`memory_tokens` tokens of
    prompt and output)."""
    _check(
        length < info.context_length,
        f"the prompt has {at_least}{length} tokens; this model's context length is "
        f"{info.context_length}, so prompts must be shorter than that",
    )
    _check(
        length < memory_tokens,
        f"the prompt has {at_least}{length} tokens; this worker's memory budget holds at most "
        f"{memory_tokens} tokens of prompt and output per request, so prompts must be at "
        f"most {memory_tokens - 1} tokens (one more is generated): send a shorter prompt "
        "or use a worker with more memory",
    )


def payload_size(request: Any, prompt: Sequence[int]) -> int:
    """About how many bytes of lists `generation_spec` walks for this request."""
    params = request.sampling_params
    return BYTES_PER_ITEM * (len(prompt) + len(params.stop_token_ids) + len(params.logit_bias))


def prompt_ids(ids: Sequence[int], info: ModelInfo, memory_tokens: int) -> tuple[int, ...]:
    """The prompt's token ids, checked against the vocabulary, context and memory."""
    _check(bool(ids), "the prompt has no tokens: send at least one input id")
    # Length first: it is cheap, and a huge prompt should not be scanned.
    prompt_length(len(ids), info, memory_tokens)
    bad = [t for t in ids if t >= info.vocab_size]
    _check(
        not bad,
        f"token id {bad[0] if bad else 0} is outside the vocabulary "
        f"(ids must be below {info.vocab_size})",
    )
    return tuple(ids)


def sampling_settings(
    params: Any, vocab_size: int, defaults: SamplingDefaults = NO_DEFAULTS
) -> SamplingSettings:
    """How to choose tokens: what the request says, else the model's `defaults`
    (api.sampling_defaults), else no filter at temperature 1."""
    temperature = 1.0
    if params.HasField("temperature"):
        temperature = _in_range("temperature", params.temperature, 0.0, MAX_TEMPERATURE)
    elif defaults.temperature is not None:
        temperature = defaults.temperature
    top_p = defaults.top_p or 1.0
    if params.top_p not in UNSET_OR_NEUTRAL:
        top_p = _in_range("top_p", params.top_p, 0.0, 1.0, "in (0, 1] (0: unset)")
    # proto3 cannot tell an unset value from 0, so 0 means "unset" here.
    min_p = _in_range("min_p", params.min_p, 0.0, 1.0) or defaults.min_p or 0.0
    top_k = params.top_k or defaults.top_k or 0
    return SamplingSettings(
        temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
        top_p=top_p,
        # Keeping the whole vocabulary or more is no filter at all.
        top_k=top_k if top_k < vocab_size else 0,
        min_p=min_p,
        # MLX random keys take unsigned seeds; a negative int32 maps to its bits.
        seed=params.seed % 2**32 if params.HasField("seed") else None,
    )


def logits_settings(
    params: Any, vocab_size: int, defaults: SamplingDefaults = NO_DEFAULTS
) -> LogitsSettings:
    bias = tuple(
        sorted(
            (int(k), _in_range(f"logit_bias[{k}]", v, *LOGIT_BIAS))
            for k, v in params.logit_bias.items()
        )
    )
    bad = [k for k, _ in bias if not 0 <= k < vocab_size]
    _check(
        not bad,
        f"logit_bias names token id {bad[0] if bad else 0}, outside the vocabulary "
        f"(ids must be in [0, {vocab_size}))",
    )
    repetition = defaults.repetition_penalty or 1.0
    if params.repetition_penalty not in UNSET_OR_NEUTRAL:
        repetition = _penalty(params, "repetition_penalty", *REPETITION_PENALTY, off=1.0)
    return LogitsSettings(
        repetition_penalty=repetition,
        frequency_penalty=_penalty(params, "frequency_penalty", *ADDITIVE_PENALTY, off=0.0),
        presence_penalty=_penalty(params, "presence_penalty", *ADDITIVE_PENALTY, off=0.0),
        logit_bias=bias,
    )


def _logprobs(params: Any) -> int | None:
    if not params.HasField("logprobs"):
        return None
    logprobs = params.logprobs
    _check(
        0 <= logprobs <= MAX_LOGPROBS,
        f"sampling_params.logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}",
    )
    return logprobs


def _max_tokens(request: Any, room: int, logprobs: int | None, vocab_size: int, limit: int) -> int:
    """The most tokens to generate: what the request asks, within `room`; a
    non-streamed response must also fit one message of `limit` bytes."""
    params = request.sampling_params
    most = room
    if params.HasField("max_tokens"):
        _check(params.max_tokens > 0, "sampling_params.max_tokens must be at least 1")
        most = min(params.max_tokens, room)
    if request.stream:
        return most
    fits = responses.tokens_within(limit, vocab_size, logprobs)
    # Refused now, not after generating a response no client could receive.
    _check(
        not params.HasField("max_tokens") or most <= fits,
        f"a non-streamed response of {most} tokens"
        + ("" if logprobs is None else f" with {logprobs} logprobs each")
        + f" may exceed {limit} bytes, the most one response message may carry "
        f"(--max-response-bytes): stream it (stream: true), ask for fewer logprobs, "
        f"or set max_tokens to at most {fits}",
    )
    return min(most, fits)


def generation_spec(
    request: Any,
    info: ModelInfo,
    prompt: Sequence[int],
    memory_tokens: int,
    limits: RequestLimits,
    defaults: SamplingDefaults = NO_DEFAULTS,
) -> GenerationSpec:
    """Validate a GenerateRequest whose prompt is `prompt` (its token ids, or its
    text tokenized) and translate it; raises InvalidRequest. `memory_tokens`:
    the most tokens (prompt and output) one request may have in the worker's
    memory budget; `defaults`: the model's sampling values for what the
    request leaves unset."""
    prompt = prompt_ids(prompt, info, memory_tokens)
    params = request.sampling_params
    logprobs = _logprobs(params)
    # Past the context end, or what memory holds, generation stops with
    # finish_reason "length".
    room = min(info.context_length, memory_tokens) - len(prompt)
    max_tokens = _max_tokens(request, room, logprobs, info.vocab_size, limits.max_response_bytes)
    stops = set(params.stop_token_ids)
    bad = [t for t in stops if t >= info.vocab_size]
    _check(
        not bad,
        f"stop_token_ids has {bad[0] if bad else 0}, outside the vocabulary "
        f"(ids must be below {info.vocab_size})",
    )
    if not params.ignore_eos:
        stops.update(info.eos_token_ids)
    return GenerationSpec(
        prompt=prompt,
        max_tokens=max_tokens,
        stop_token_ids=frozenset(stops),
        sampling=sampling_settings(params, info.vocab_size, defaults),
        logits=logits_settings(params, info.vocab_size, defaults),
        logprobs=logprobs,
    )
