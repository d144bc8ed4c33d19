"""How long an engine step takes: the time side of the scheduler's step budget.

Pure arithmetic, no MLX. A step decodes every running sequence once and
prefills a chunk of each prompt being prefilled; its prefill part costs about
`tokens x (a + b x context)` seconds: `a` for each prompt token (the weights'
matrix work), `b` for each token of context it attends to. The start-up probe
(`engine.memory_probe`) measures `a` and `b`; the steps the engine then runs
correct them, since a probe of short prompts cannot see what a long context
or a first-seen batch shape costs on this device.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

# The correction is the median of the last few prefill steps: one slow step (a
# shape the backend compiles kernels for on first use) does not shrink the
# chunks after it, and a context that keeps growing is followed within a step
# or two.
RECENT_STEPS = 3
# A step's correction is taken within these bounds of the probe's estimate...
CORRECTION_RANGE = (0.1, 10.0)
# ...and at most this many times the correction before it: a run of steps that
# build kernels for new shapes (on CUDA, each costs more than a small chunk's
# work) must not teach the clock that every token costs that much.
MOST_GROWTH = 2.0
# Weight of each new decode-only step in the decode time's moving average, and
# of each first-seen shape's extra time in the shape build's.
DECODE_WEIGHT = 0.2
BUILD_WEIGHT = 0.3


@dataclass(frozen=True)
class PrefillSpeed:
    """What prefilling costs on this device, measured at start-up (seconds)."""

    per_token: float  # per prompt token
    per_context: float  # more per prompt token, per token of context it attends to


class StepClock:
    """Predicts a step's seconds; learns from the steps that ran. Engine thread only."""

    def __init__(self, speed: PrefillSpeed) -> None:
        self.speed = speed
        self.decode_seconds = 0.0  # a step that only decodes, as of late
        # What a prefill shape the backend has not built kernels for adds to
        # its step, as of late (only where the scheduler says a shape is new).
        self.build_seconds = 0.0
        self._corrections: deque[float] = deque(maxlen=RECENT_STEPS)

    @property
    def correction(self) -> float:
        """Measured over predicted prefill time, lately (1 until a prefill step ran)."""
        return statistics.median(self._corrections) if self._corrections else 1.0

    def _probe_seconds(self, tokens: int, context: int) -> float:
        return tokens * (self.speed.per_token + self.speed.per_context * context)

    def prefill_seconds(self, tokens: int, context: int) -> float:
        """Prefilling `tokens` prompt tokens (all rows together) at `context`
        tokens of context (the middle of the chunk)."""
        return self._probe_seconds(tokens, context) * self.correction

    def seconds(self, tokens: int, context: int) -> float:
        """A whole step: decoding the batch, and prefilling as above."""
        return self.decode_seconds + self.prefill_seconds(tokens, context)

    def observe(self, tokens: int, context: int, seconds: float, new_shape: bool = False) -> None:
        """A step that prefilled `tokens` at `context` took `seconds`; with
        `new_shape`, it first built kernels for its shape: what it took past
        the prediction is that build's cost, not the tokens'."""
        if tokens <= 0:
            self.decode_seconds += DECODE_WEIGHT * (seconds - self.decode_seconds)
            return
        if new_shape:
            extra = max(seconds - self.seconds(tokens, context), 0.0)
            self.build_seconds += BUILD_WEIGHT * (extra - self.build_seconds)
            return
        predicted = self._probe_seconds(tokens, context)
        if predicted <= 0:
            return
        low, high = CORRECTION_RANGE
        measured = max(seconds - self.decode_seconds, 0.0) / predicted
        high = min(high, MOST_GROWTH * self.correction)
        self._corrections.append(min(max(measured, low), high))
