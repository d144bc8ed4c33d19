"""Samplers, logits processors and stop tokens for the engine thread (uses MLX).

mlx-lm samples a whole step in one call only when every row shares the same
sampler object, so unseeded requests with equal settings share one. A seeded
request gets its own sampler with its own random key: reproducible whatever
else is in the batch, and the process-wide generator is never reseeded.

Kernels: mlx's CUDA backend compiles a kernel the first time it meets a fused
(`mx.compile`) graph or a gather or scatter of a new pair of dtypes, seconds
each, once per host, while every stream waits (and before the first start is
ready: the warm-up meets them all). So what is here keeps that set small:
tokens are int32 everywhere (prompts are, so sampled tokens are made so too,
and the index arrays taken from them), the top-p, min-p and top-k filters
are plain array arithmetic taking their value as an array (mlx-lm's compile
it as a constant: a new kernel for every new value), and the penalties and
logit bias read and write along the logits' last axis, as the cache and the
top-p filter do, not by indexing them with token ids.

Stop tokens are a set lookup (`StopTokens`), not mlx-lm's `StopSequences`
automaton: every stop sequence here is one token, and building that automaton
for a large set took the engine thread long enough to pause every stream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from smg_mlx.engine.types import LogitsSettings, SamplingSettings

Sampler = Callable[[mx.array], mx.array]


def keep_top_p(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """Keep the most likely tokens whose probabilities sum to `top_p` (at least one)."""
    ordered = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ordered, dropped, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def keep_min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """Keep the tokens at least `min_p` times as likely as the most likely one."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < floor, -mx.inf, logprobs)


def keep_top_k(logprobs: mx.array, top_k: mx.array) -> mx.array:
    """Keep the `top_k` most likely tokens (and any tied with the last of them)."""
    ordered = mx.sort(logprobs, axis=-1)
    last = mx.broadcast_to(logprobs.shape[-1] - top_k, (*logprobs.shape[:-1], 1))
    threshold = mx.take_along_axis(ordered, last, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token of each row, as int32 (argmax gives uint32)."""
    return mx.argmax(logprobs, axis=-1).astype(mx.int32)


def batch_generator(model: nn.Module, **options: Any) -> BatchGenerator:
    """mlx-lm's BatchGenerator with int32 tokens throughout (greedy by default,
    and its empty decoding rows holding no uint32 array for the first rows to
    join: concatenated with int32 it would make int64)."""
    generator = BatchGenerator(model, sampler=greedy, **options)
    generator._generation_batch._next_tokens = None
    return generator


def make_sampler(settings: SamplingSettings) -> Sampler:
    """A sampler over log-probabilities; seeded ones carry their own key."""
    if settings.greedy:
        return greedy
    filters = []
    if settings.top_p < 1.0:
        top_p = mx.array(settings.top_p, dtype=mx.float32)
        filters.append(lambda x: keep_top_p(x, top_p))
    if settings.min_p > 0.0:
        log_min_p = mx.array(math.log(settings.min_p), dtype=mx.float32)
        filters.append(lambda x: keep_min_p(x, log_min_p))
    if settings.top_k > 0:
        top_k = mx.array(settings.top_k, dtype=mx.int32)
        filters.append(lambda x: keep_top_k(x, top_k))
    draw = _Draw(filters, 1.0 / settings.temperature)
    if settings.seed is not None:
        return SeededSampler(draw, settings.seed)
    return draw


class _Draw:
    """One draw from the filtered, tempered distribution (the process's
    random state, unless given a key)."""

    def __init__(self, filters: list[Callable[[mx.array], mx.array]], scale: float) -> None:
        self._filters, self._scale = filters, scale

    def __call__(self, logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        for keep in self._filters:
            logprobs = keep(logprobs)
        # In float32: a low temperature's scale (up to 1e5) overflows float16 to
        # inf, and every token would be drawn alike.
        drawn = mx.random.categorical(logprobs.astype(mx.float32) * self._scale, key=key)
        return drawn.astype(mx.int32)


class SeededSampler:
    """A seeded request's sampler: its own key, split once a token, so its
    tokens are the same whatever else runs in the batch. `ahead` draws
    several positions with the keys the next tokens would take and moves on
    by as many as are kept: a pass checking speculative proposals draws
    what decoding token by token would (engine.speculative.decoding)."""

    def __init__(self, draw: _Draw, seed: int) -> None:
        self._draw = draw
        self._key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, step = mx.random.split(self._key)
        return self._draw(logprobs, step)

    def ahead(self, logprobs: mx.array) -> tuple[mx.array, Callable[[int], None]]:
        """A draw for each of `logprobs`' rows (positions), each with the key
        its token would take; and the call that keeps the first n of them."""
        keys, key = [], self._key
        for _ in range(logprobs.shape[0]):
            key, step = mx.random.split(key)
            keys.append((key, step))
        draws = [self._draw(logprobs[j : j + 1], step) for j, (_, step) in enumerate(keys)]

        def keep(n: int) -> None:
            self._key = keys[n - 1][0]

        return mx.concatenate(draws), keep


CONTEXT = 20  # the penalties look back this many tokens (mlx-lm's default)


def make_processors(settings: LogitsSettings) -> list[Callable[[mx.array, mx.array], mx.array]]:
    return [Penalties(settings)] if settings.active else []


class Penalties:
    """mlx-lm's logits processors (`make_logits_processors`: the logit bias,
    then the repetition, presence and frequency penalties over the last
    `CONTEXT` tokens) in one, reading and writing the logits along their last
    axis: mlx-lm's index them by token ids, a gather and two scatters of
    their own to build on CUDA, where these share the kernels the cache and
    the top-p filter already use (see the module's doc). A token seen n times
    in the window loses n times the frequency penalty in one subtraction,
    where mlx-lm's subtracts it n times."""

    def __init__(self, settings: LogitsSettings) -> None:
        self._settings = settings
        bias = settings.logit_bias
        self._bias = (
            (mx.array([[t for t, _ in bias]], mx.int32), mx.array([[v for _, v in bias]]))
            if bias else None
        )  # fmt: skip

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """`logits` (1, vocabulary) after the row's `tokens` (1-D, int32)."""
        s = self._settings
        if self._bias is not None:
            at, values = self._bias
            biased = mx.take_along_axis(logits, at, axis=-1) + values.astype(logits.dtype)
            logits = mx.put_along_axis(logits, at, biased, axis=-1)
        window = tokens[None, -CONTEXT:]
        if window.size == 0 or not (
            s.repetition_penalty != 1.0 or s.presence_penalty or s.frequency_penalty
        ):
            return logits
        seen = mx.take_along_axis(logits, window, axis=-1)
        if s.repetition_penalty != 1.0:
            p = s.repetition_penalty
            seen = mx.where(seen < 0, seen * p, seen / p)
        if s.presence_penalty:
            seen = seen - s.presence_penalty
        if s.frequency_penalty:
            times = (window[0, :, None] == window[0, None, :]).sum(axis=-1)
            seen = seen - (times * s.frequency_penalty).astype(seen.dtype)
        # A token twice in the window is written twice, with the same value.
        return mx.put_along_axis(logits, window, seen, axis=-1)


class StopTokens:
    """A request's stop tokens, in the role of mlx-lm's `StopSequences`: its
    BatchGenerator takes a `matcher()` per sequence and asks `advance(token)`
    whether to stop there. One-token sequences need no state, so the matcher
    is this object itself, built from the request's own set at no cost."""

    __slots__ = ("_ids",)

    def __init__(self, ids: frozenset[int]) -> None:
        self._ids = ids

    def matcher(self) -> StopTokens:
        return self

    def advance(self, token: int) -> bool:
        return token in self._ids


class SamplerCache:
    """Shares samplers and logits processors between requests with equal settings.

    Bounded, so clients sending ever-new settings cannot grow it without end.
    """

    def __init__(self, size: int = 256) -> None:
        self._shared_sampler = functools.lru_cache(maxsize=size)(make_sampler)
        self.processors = functools.lru_cache(maxsize=size)(make_processors)

    def sampler(self, settings: SamplingSettings) -> Sampler:
        if settings.seed is not None and not settings.greedy:
            return make_sampler(settings)  # its key is its own state
        return self._shared_sampler(settings)
