"""Samplers, logits processors and stop tokens for the engine thread (uses MLX).

mlx-lm samples a whole step in one call only when every row shares the same
sampler object, so unseeded requests with equal settings share one. A seeded
request gets its own sampler with its own random key: reproducible whatever
else is in the batch, and the process-wide generator is never reseeded.

The top-p, min-p and top-k filters are our own: mlx-lm compiles its filters
with the value as a constant, so every new value from a client would compile
anew, on the engine thread, while every stream waits, and stay in MLX's
compile cache for good. Ours take the value as an array: compiled once.

Stop tokens are a set lookup (`StopTokens`), not mlx-lm's `StopSequences`
automaton: every stop sequence here is one token, and building that automaton
for a large set took the engine thread long enough to pause every stream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

from smg_mlx.engine.types import LogitsSettings, SamplingSettings

Sampler = Callable[[mx.array], mx.array]


@mx.compile
def keep_top_p(logprobs: mx.array, top_p: mx.array) -> mx.array:
    """Keep the most likely tokens whose probabilities sum to `top_p` (at least one)."""
    ordered = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ordered.astype(mx.float32))
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ordered, dropped, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


@mx.compile
def keep_min_p(logprobs: mx.array, log_min_p: mx.array) -> mx.array:
    """Keep the tokens at least `min_p` times as likely as the most likely one."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + log_min_p
    return mx.where(logprobs < floor, -mx.inf, logprobs)


@mx.compile
def keep_top_k(logprobs: mx.array, top_k: mx.array) -> mx.array:
    """Keep the `top_k` most likely tokens (and any tied with the last of them)."""
    ordered = mx.sort(logprobs, axis=-1)
    last = mx.broadcast_to(logprobs.shape[-1] - top_k, (*logprobs.shape[:-1], 1))
    threshold = mx.take_along_axis(ordered, last, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def make_sampler(settings: SamplingSettings) -> Sampler:
    """A sampler over log-probabilities; seeded ones carry their own key."""
    if settings.greedy:
        return greedy_sampler
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
        return mx.random.categorical(logprobs.astype(mx.float32) * self._scale, key=key)


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


def make_processors(settings: LogitsSettings) -> list:
    if not settings.active:
        return []
    return make_logits_processors(
        logit_bias=dict(settings.logit_bias) or None,
        repetition_penalty=(
            settings.repetition_penalty if settings.repetition_penalty != 1.0 else None
        ),
        frequency_penalty=settings.frequency_penalty or None,
        presence_penalty=settings.presence_penalty or None,
    )


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
