"""How long a pass over the model takes: the time side of the scheduler's step budget.

Pure arithmetic, no MLX. A pass (one call of a lane's BatchGenerator; a step
runs one or more) decodes the lane's running sequences once and prefills a
chunk of each of its prompts being prefilled; its prefill part costs about
`tokens x a + queries x b x context` seconds: `a` for each prompt token (the
weights' matrix work), `b` for each token of context each query attends to
(the queries are its tokens, or more where attention runs padded, see
`engine.batch.attention_shapes`). The start-up probe
(`engine.memory.probe`) measures `a` and `b`; the passes the engine then runs
correct them, since a probe of short prompts cannot see what a long context
or a first-seen batch shape costs on this device. The correction is kept for
each range of contexts: how the cost grows with the context depends on the
kernels a backend picks, which a linear fit of short contexts can be far off.
"""

from __future__ import annotations

import statistics
from collections import deque

from smg_mlx.engine.memory.costs import PrefillSpeed

# The correction is the median of the last few prefill passes at about that
# context: one slow pass (a shape the backend compiles kernels for on first
# use) does not shrink the chunks after it.
RECENT_PASSES = 3
# Contexts share a correction within each power of two of this many tokens.
CONTEXT_RANGE = 1024
# A pass's correction is taken within these bounds of the probe's estimate
# (whose short contexts can make it grow with the context far too fast)...
CORRECTION_RANGE = (0.01, 10.0)
# ...and at most this many times the correction before it: a run of passes that
# build kernels for new shapes (on CUDA, each costs more than a small chunk's
# work) must not teach the clock that every token costs that much.
MOST_GROWTH = 2.0
# Weight of each new decode-only pass in the decode time's moving average, and
# of each first-seen shape's extra time in the shape build's.
DECODE_WEIGHT = 0.2
BUILD_WEIGHT = 0.3


class StepClock:
    """Predicts a lane's passes; learns from those that ran. Engine thread only."""

    def __init__(self, speed: PrefillSpeed) -> None:
        self.speed = speed
        self.decode_seconds = 0.0  # a pass that only decodes, as of late
        # What a prefill shape the backend has not built kernels for adds to
        # its pass, as of late (only where the scheduler says a shape is new).
        self.build_seconds = 0.0
        # By context range: measured over predicted prefill time, lately.
        self._corrections: dict[int, deque[float]] = {}

    def correction(self, context: int) -> float:
        """Measured over predicted prefill time, lately, at about `context`
        tokens of context (1 until a prefill pass ran there)."""
        recent = self._corrections.get(_range(context))
        return statistics.median(recent) if recent else 1.0

    def _probe_seconds(self, tokens: int, context: int, queries: int | None) -> float:
        queries = tokens if queries is None else queries
        return tokens * self.speed.per_token + queries * self.speed.per_context * context

    def prefill_seconds(self, tokens: int, context: int, queries: int | None = None) -> float:
        """Prefilling `tokens` prompt tokens (all rows together) at `context`
        tokens of context (the middle of the chunk), attention running
        `queries` queries (None: the tokens)."""
        return self._probe_seconds(tokens, context, queries) * self.correction(context)

    def seconds(self, tokens: int, context: int, queries: int | None = None) -> float:
        """A whole pass: decoding the lane's rows, and prefilling as above."""
        return self.decode_seconds + self.prefill_seconds(tokens, context, queries)

    def observe(self, tokens: int, context: int, seconds: float, new_shape: bool = False,
                queries: int | None = None) -> None:  # fmt: skip
        """A pass that prefilled `tokens` at `context` (attention running
        `queries` queries) took `seconds`; with `new_shape`, it first built
        kernels for its shape: what it took past the prediction is that
        build's cost, not the tokens'."""
        if tokens <= 0:
            self.decode_seconds += DECODE_WEIGHT * (seconds - self.decode_seconds)
            return
        if new_shape:
            extra = max(seconds - self.seconds(tokens, context, queries), 0.0)
            self.build_seconds += BUILD_WEIGHT * (extra - self.build_seconds)
            return
        predicted = self._probe_seconds(tokens, context, queries)
        if predicted <= 0:
            return
        low, high = CORRECTION_RANGE
        measured = max(seconds - self.decode_seconds, 0.0) / predicted
        high = min(high, MOST_GROWTH * self.correction(context))
        recent = self._corrections.setdefault(_range(context), deque(maxlen=RECENT_PASSES))
        recent.append(min(max(measured, low), high))


def _range(context: int) -> int:
    """The context range `context` falls in: 0 below CONTEXT_RANGE tokens,
    then one for each power of two."""
    return (context // CONTEXT_RANGE).bit_length()
