"""The memory budget: what the model costs, and what may run within the budget.

Pure arithmetic, no MLX: the numbers come from a probe at warm-up
(`engine.memory_probe`), and the scheduler (`engine.scheduler`) asks before
every admission and step.

What a state of the batch costs, in bytes:

- the weights, and the prefix cache (which shrinks before work is refused);
- the KV caches. mlx-lm keeps one rectangular cache for the whole batch, as
  long as its longest row, so a batch of R costs that may grow to T tokens
  each reserves R x T x (KV per token), and merging or filtering the batch
  copies it once more (KV_COPIES);
- the prefill working set: B prompts prefilled together in chunks of C tokens
  at a context of L tokens take B x C x (a + b x L) (activations and logits per
  chunk token, attention scores per chunk token and context token).

A request is admitted only when the batch with it, at its longest, fits; a
prompt prefills in chunks no larger than what fits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from smg_mlx.engine.types import Request

# Merging a new group into the batch, or dropping finished rows, copies the cache.
KV_COPIES = 2
# The cache grows in blocks of this many tokens.
KV_BLOCK = 256
# Chunks are halved down to this many tokens at the most.
MIN_CHUNK = 128
# The prefix cache keeps room for the batch prefilling in chunks this long.
ALLOWANCE_CHUNK = 512
# Estimates are multiplied by this, and by LEARN_FACTOR after each out-of-memory error.
SAFETY = 1.1
LEARN_FACTOR = 1.25
MAX_SAFETY = 2.0  # however many errors: past that, estimates are not what is wrong
# What MLX's backends say when an allocation fails.
_OUT_OF_MEMORY = ("out of memory", "insufficient memory", "unable to allocate", "malloc")


def format_bytes(n: float) -> str:
    """Bytes for a log line: "1.50 GiB", "12.0 MiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:.0f} B"


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and any(s in text for s in _OUT_OF_MEMORY)


@dataclass(frozen=True)
class MemoryModel:
    """What one model costs, measured at warm-up (bytes)."""

    weights: int  # the model's parameters
    kv_per_token: float  # one sequence's KV cache, per token
    prefill_per_token: float  # prefill working set per chunk token...
    prefill_per_context: float  # ...plus this for each token it attends to


@dataclass(frozen=True)
class Cost:
    """An admitted sequence as the budget sees it."""

    prompt: int  # prompt tokens
    total: int  # prompt plus max_tokens: the longest it can grow
    prefilling: bool  # its prompt is not all processed yet


class MemoryPlanner:
    """Decides what runs within `budget` bytes. Runs on the engine thread."""

    def __init__(
        self, model: MemoryModel, budget: int, *, max_chunk: int, prefill_rows: int
    ) -> None:
        self.model = model
        self.budget = budget
        self.max_chunk = max_chunk
        self.min_chunk = min(MIN_CHUNK, max_chunk)
        self.prefill_rows = prefill_rows
        self.safety = SAFETY
        self.longest_sequence = self._longest_sequence()

    # ---- estimates ----

    def kv_bytes(self, costs: Iterable[Cost]) -> float:
        """The batch cache at its largest, copies included."""
        totals = [s.total for s in costs]
        if not totals:
            return 0.0
        longest = math.ceil(max(totals) / KV_BLOCK) * KV_BLOCK
        return KV_COPIES * len(totals) * longest * self.model.kv_per_token * self.safety

    def prefill_bytes(self, costs: Iterable[Cost], chunk: int) -> float:
        """The working set of one prefill step of the costs still prefilling."""
        prompts = [s.prompt for s in costs if s.prefilling]
        if not prompts:
            return 0.0
        rows = min(len(prompts), self.prefill_rows)
        chunk = min(chunk, max(prompts))
        per_token = self.model.prefill_per_token + self.model.prefill_per_context * max(prompts)
        return rows * chunk * per_token * self.safety

    def need(self, costs: list[Cost], chunk: int | None = None) -> float:
        """Bytes the costs need, prefix cache aside, prefilling at `chunk`
        tokens (the smallest chunk by default)."""
        chunk = self.min_chunk if chunk is None else chunk
        return self.model.weights + self.kv_bytes(costs) + self.prefill_bytes(costs, chunk)

    # ---- decisions ----

    def prefix_allowance(self, costs: list[Cost]) -> int:
        """What the prefix cache may hold beside these costs, prefilling in
        chunks of ALLOWANCE_CHUNK, and keeping room for the cache of the longest
        to be copied in when it ends."""
        longest = max((s.total for s in costs), default=0)
        copy = longest * self.model.kv_per_token * self.safety
        need = self.need(costs, min(ALLOWANCE_CHUNK, self.max_chunk))
        return max(0, int(self.budget - need - copy))

    def fits(self, costs: list[Cost]) -> bool:
        return self.need(costs) <= self.budget

    def chunk(self, costs: list[Cost], prefix_bytes: int) -> int:
        """The largest prefill chunk (halving from the configured one) that fits."""
        chunk = self.max_chunk
        while chunk > self.min_chunk and (self.need(costs, chunk) + prefix_bytes > self.budget):
            chunk = max(self.min_chunk, chunk // 2)
        return chunk

    def _longest_sequence(self) -> int:
        """The most tokens (prompt plus output) one sequence may have, alone."""
        low, high = 0, 1
        while self.fits([Cost(high, high, True)]):
            low, high = high, high * 2
            if high > 2**40:
                return high
        while high - low > 1:
            middle = (low + high) // 2
            if self.fits([Cost(middle, middle, True)]):
                low = middle
            else:
                high = middle
        return low

    def learn(self) -> None:
        """An out-of-memory error: the estimates were short; raise them."""
        self.safety = min(self.safety * LEARN_FACTOR, MAX_SAFETY)
        self.longest_sequence = self._longest_sequence()


def cost(request: Request) -> Cost:
    """A request as the budget sees it when admitted."""
    prompt = len(request.spec.prompt)
    return Cost(prompt=prompt, total=prompt + request.spec.max_tokens, prefilling=True)
