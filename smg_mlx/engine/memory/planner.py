"""The memory budget: what the model costs, and what may run within the budget.

Pure arithmetic, no MLX: the numbers come from a probe at warm-up
(`engine.memory.probe`), and the scheduler (`engine.schedule.scheduler`) asks before
every admission and step.

What a state of the batch costs, in bytes:

- the weights, and the prefix cache (which gives way before work waits);
- the KV caches. Each lane (`engine.schedule.scheduler`: short prompts and long ones)
  is an mlx-lm batch that keeps one rectangular cache, as long as its longest
  row, for every row alive. A row lives at most as many passes of its lane as
  it has tokens left to process (each pass processes at least one of every
  row's), and grows by one token a pass once prefilled: a lane reserves, at
  its largest over its rows' lives, the rows still alive x the longest of
  them x (KV per token). A chat beside a long stream is charged the stream's
  length while the chat lives, not the length the stream may reach. Merging
  a new group into a lane or dropping finished rows copies that lane's cache
  once more, one lane at a time;
- the prefill working set: B prompts prefilled together in chunks of C tokens,
  the last of them attending to L tokens, take B x (C x (a + b x L) + c x (L + C))
  (activations and logits per chunk token, attention scores or masks per chunk
  token and context token, and copies of the keys a row attends to, where
  attention runs on padded copies: `engine.batch.attention_shapes`). The lanes
  prefill one after the other: the larger lane's set counts. A prompt that
  starts from a cached prefix prefills only the rest.

A request is admitted only when the batch with it, at its largest, fits; a
prompt prefills in chunks no larger than what fits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from smg_mlx.engine.memory.costs import MemoryModel
from smg_mlx.engine.types import Request

# The cache grows in blocks of this many tokens.
KV_BLOCK = 256
# Chunks are halved down to this many tokens at the most.
MIN_CHUNK = 128
# A draft model's catch-up pass the prefix cache leaves room for: its tokens
# (at the longest sequence's context). Where memory is short, passes shrink.
CATCH_UP_TOKENS = 256
# Estimates are multiplied by this, and by LEARN_FACTOR after each out-of-memory error.
SAFETY = 1.1
LEARN_FACTOR = 1.25
MAX_SAFETY = 2.0  # however many errors: past that, estimates are not what is wrong
# What MLX's backends say when an allocation fails.
_OUT_OF_MEMORY = ("out of memory", "insufficient memory", "unable to allocate", "malloc")


def is_out_of_memory(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and any(s in text for s in _OUT_OF_MEMORY)


@dataclass(frozen=True)
class Cost:
    """A sequence as the budget sees it."""

    prompt: int  # prompt tokens: the most context a prefill chunk attends to
    total: int  # prompt plus max_tokens: the longest it can grow
    prefill: int  # prompt tokens still to prefill (0: all processed)
    long: bool = False  # in the long prompts' lane
    generated: int = 0  # tokens generated after `prompt`

    @property
    def prefilling(self) -> bool:
        return self.prefill > 0

    @property
    def length(self) -> int:
        """The most tokens its cache holds now (a prompt counted whole)."""
        return self.prompt + self.generated

    @property
    def passes(self) -> int:
        """The most passes of its lane it stays for: each processes at least
        one of its tokens, and one more hands out the last."""
        return self.prefill + self.total - self.length + 1


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
        """The lanes' caches at their largest, one lane's copy included."""
        per_token, per_row = self.model.kv_per_token, self.model.row_bytes
        lanes = [_lane_tokens(lane) * per_token + len(lane) * per_row for lane in _lanes(costs)]
        return (sum(lanes) + max(lanes)) * self.safety

    def prefill_bytes(self, costs: Iterable[Cost], chunk: int) -> float:
        """The working set of one prefill pass of the costs still prefilling,
        in the lane that needs more."""
        most = 0.0
        for lane in _lanes(s for s in costs if s.prefilling):
            if not lane:
                continue
            rows = min(len(lane), self.prefill_rows)
            tokens = min(chunk, max(s.prefill for s in lane))
            context = max(s.prompt for s in lane)
            most = max(most, rows * pass_bytes(self.model, tokens, context))
        return most * self.safety

    def catch_up_bytes(self, costs: Iterable[Cost]) -> float:
        """A draft model's catch-up pass of CATCH_UP_TOKENS at the longest
        sequence's context (0 without a draft)."""
        if not self.model.draft_width:
            return 0.0
        context = max((s.length for s in costs), default=0)
        return draft_pass_bytes(self.model, CATCH_UP_TOKENS, context, self.safety)

    def need(self, costs: list[Cost], chunk: int | None = None, extra: int = 0) -> float:
        """Bytes the costs need, prefix cache aside but for `extra` bytes of
        it, prefilling at `chunk` tokens (the smallest chunk by default)."""
        chunk = self.min_chunk if chunk is None else chunk
        return self.model.weights + self.kv_bytes(costs) + self.prefill_bytes(costs, chunk) + extra

    # ---- decisions ----

    def prefix_allowance(self, costs: list[Cost]) -> int:
        """What the prefix cache may hold beside these costs, prefilling in
        full chunks (smaller ones would cost every prompt more passes). A
        sequence that ends is copied in as its lane's rows are: the lane's
        copy (`kv_bytes`) has room for both. Room for a draft model's
        catch-up pass is left too (`catch_up_bytes`)."""
        need = self.need(costs, self.max_chunk) + self.catch_up_bytes(costs)
        return max(0, int(self.budget - need))

    def fits(self, costs: list[Cost], extra: int = 0) -> bool:
        """Whether the costs fit beside `extra` bytes of the prefix cache."""
        return self.need(costs, extra=extra) <= self.budget

    def chunk(self, costs: list[Cost], prefix_bytes: int) -> int:
        """The largest prefill chunk (halving from the configured one) that fits."""
        chunk = self.max_chunk
        while chunk > self.min_chunk and (self.need(costs, chunk) + prefix_bytes > self.budget):
            chunk = max(self.min_chunk, chunk // 2)
        return chunk

    def _longest_sequence(self) -> int:
        """The most tokens (prompt plus output) one sequence may have, alone."""
        low, high = 0, 1
        while self.fits([Cost(high, high, high)]):
            low, high = high, high * 2
            if high > 2**40:
                return high
        while high - low > 1:
            middle = (low + high) // 2
            if self.fits([Cost(middle, middle, middle)]):
                low = middle
            else:
                high = middle
        return low

    def learn(self) -> None:
        """An out-of-memory error: the estimates were short; raise them."""
        self.safety = min(self.safety * LEARN_FACTOR, MAX_SAFETY)
        self.longest_sequence = self._longest_sequence()


def pass_bytes(model: MemoryModel, tokens: int, context: int) -> float:
    """One row's prefill pass working set: `tokens` prompt tokens, the last
    attending to `context` (padded by up to a pass: the keys it copies)."""
    per_token = model.prefill_per_token + model.prefill_per_context * context
    return tokens * per_token + model.prefill_row_per_key * (context + tokens)


def draft_pass_bytes(model: MemoryModel, tokens: int, context: int, safety: float) -> float:
    """A draft model's catch-up pass: `tokens` after `context`, at its width
    (`MemoryModel.draft_width`) times `safety`."""
    return model.draft_width * safety * pass_bytes(model, tokens, context + tokens)


def _lanes(costs: Iterable[Cost]) -> tuple[list[Cost], list[Cost]]:
    """The costs in the short lane, and those in the long one."""
    lanes: tuple[list[Cost], list[Cost]] = ([], [])
    for s in costs:
        lanes[s.long].append(s)
    return lanes


def _lane_tokens(lane: list[Cost]) -> int:
    """The most rows x tokens a lane's cache holds over its rows' lives (see
    the module's docstring). The cache is at its largest just before a row
    leaves: then every row that lives longer is alive, the longest of them no
    longer than its total nor than the longest now grown by a token a pass."""
    most = rows = total = length = 0
    # (passes, total, length) of each, read once: this runs for every request
    # the scheduler weighs, over every row.
    lives = [(s.passes, s.total, s.length) for s in lane]
    lives.sort(reverse=True)
    for passes, its_total, its_length in lives:
        rows += 1
        total, length = max(total, its_total), max(length, its_length)
        longest = min(total, length + passes - 1)
        most = max(most, rows * (-(-longest // KV_BLOCK)) * KV_BLOCK)
    return most


def cost(request: Request, cached: int = 0, long: bool = False) -> Cost:
    """A request as the budget sees it when admitted, `cached` of its prompt
    tokens from the prefix cache."""
    prompt = len(request.spec.prompt)
    return Cost(prompt, prompt + request.spec.max_tokens, prompt - cached, long)
