"""What each pass of a step prefills, within the step budget (pure, no MLX).

The scheduler (`engine.schedule.scheduler`) decides who runs; this is how much. A
step runs the short lane once (every running stream decodes, and each short
prompt being prefilled takes a chunk), then the long lane once for each chunk
of the long prompt that fits what is left: each call is a pass over the
model. The rules:

- **A step budget.** Chunks are sized so that the step takes about
  `--step-budget-ms`: a running stream's pause between two tokens stays about
  that long, whatever arrives. Each lane has a `StepClock`, which learns from
  that lane's passes alone what a pass costs. mlx-lm pads every prompt row to
  one chunk length, so R rows at chunk c cost R x c tokens: the short lane's
  share is split evenly over its rows. The long lane gets several chunks of at
  most `--prefill-step-size` rather than one larger one (large chunks at long
  context are slow on some backends). Each lane prefills at least
  MIN_STEP_TOKENS (SHAPE_BUILD_STEP_TOKENS where a new shape costs a kernel
  build), even past the budget: smaller steps would waste the accelerator more
  than they save anyone's time, and a long prompt always moves. On a machine
  so slow that fewer tokens' work already takes AMORTIZED decoding passes (a
  large model on a CPU: 128 tokens take seconds), a chunk of those wastes
  little, and keeps a running stream's pause near the budget. Where the clock
  is far off for a shape (a pass with it took over SLOW_STEP budgets SLOW_TIMES
  times), that shape gets a smaller chunk from then on.
- **Few shapes.** Chunks are powers of two, and each ends where the batch's
  cache length is a multiple of it: the same attention shapes come back step
  after step and prompt after prompt. Only the prompts' last piece, where it
  is no more than a chunk, goes in one pass wherever it ends: a pass costs a
  fixed time besides its tokens, and a resent history's new tokens would
  otherwise take two. On mlx's CUDA backend, which builds a cuDNN graph for
  each new shape, passes run in a few padded shapes (`engine.batch.attention_shapes`).
  There the clocks count a pass's attention by the queries it runs, padding
  included: a prompt's short last chunk costs about as much attention as the
  window it is padded to, and counted by its tokens it would make the full
  chunks look slow. A pass that still meets a shape not built yet counts that
  cost (as the clock has measured it) against the budget, and does not teach
  the clock that its tokens cost that much, which would shrink the chunks
  into yet more new shapes.
- **A long prompt's last pass.** A prompt's first token is sampled in the
  pass after its last chunk (`engine.batch.joining`); that pass joins the
  step of the last chunk where the budget holds it (until it runs, the prompt
  counts as prefilling, and no other long prompt starts).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from smg_mlx.engine.memory.costs import PrefillSpeed
from smg_mlx.engine.schedule.step_clock import StepClock

log = logging.getLogger(__name__)

# The lanes: each an mlx-lm BatchGenerator, which pads every row of its batch
# to the longest one; long prompts run in a lane of their own.
SHORT, LONG = 0, 1
MIN_STEP_TOKENS = 128
# mlx's CUDA backend builds a cuDNN graph for each new attention shape, which
# costs as much as prefilling hundreds of tokens: fewer, larger steps there.
SHAPE_BUILD_STEP_TOKENS = 512
# A chunk below the minimum is taken where its prompt work alone costs this
# many passes that only decode (what every pass costs besides its tokens).
AMORTIZED = 4
SMALLEST_CHUNK = 16
# Shapes remembered as slow; past this many the memory starts over.
SLOW_REMEMBERED = 1024
# A shape whose passes took over SLOW_STEP budgets SLOW_TIMES times (counting
# passes where its rows filled the chunk and no shape was built) gets a
# smaller chunk from then on: the clock's cost model (one correction for a
# range of contexts) can be far off for some shapes, such as large chunks at
# long context on CUDA, and the same shapes come back prompt after prompt.
SLOW_STEP = 2.0
SLOW_TIMES = 2


# A prefill's shape, as the backend's kernels see it: prompt rows, chunk, and
# the context before it.
Shape = tuple[int, int, int]
# Whether a pass of (rows, tokens a row, context before) builds kernels first
# (engine.batch.attention_shapes).
Builds = Callable[[int, int, int], bool]
# The queries a row of such a pass runs attention for, padding included
# (engine.batch.attention_shapes).
Attended = Callable[[int, int, int], int]


@dataclass(frozen=True, slots=True)
class Part:
    """What one pass over the model prefills: its prompt tokens (all rows),
    their mean context, and its shape."""

    tokens: int
    context: int
    shape: Shape

    @classmethod
    def of(cls, rows: int, tokens: int, chunk: int, context: int) -> Part:
        """A pass of `rows` prompt rows prefilling `tokens` each, in chunks
        of `chunk`, after `context` tokens."""
        return cls(rows * tokens, context + tokens // 2, (rows, chunk, context))

    @property
    def fills(self) -> bool:
        """Whether its rows fill the chunk: only then it tells what that chunk costs."""
        return self.tokens == self.shape[0] * self.shape[1]


@dataclass(frozen=True, slots=True)
class Passes:
    """What a step's passes over the model took, in seconds: the short lane's
    (None: it did not run), then each of the long lane's."""

    short: float | None = None
    long: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        return (self.short or 0.0) + sum(self.long)


def chunk_sizes(largest: int) -> list[int]:
    """Chunk sizes: the powers of two from SMALLEST_CHUNK below `largest`, and it."""
    sizes = [largest]
    while sizes[0] // 2 >= SMALLEST_CHUNK:
        sizes.insert(0, 1 << ((sizes[0] - 1).bit_length() - 1))
    return sizes


def aligned(chunk: int, length: int) -> int:
    """The chunk that takes a cache of `length` tokens to the next multiple of `chunk`."""
    return chunk - length % chunk


class StepPlan:
    """Each step's passes, planned and then learnt from. Engine thread only."""

    def __init__(
        self, speed: PrefillSpeed, max_chunk: int, step_seconds: float,
        builds: Builds | None = None, attended: Attended | None = None,
    ) -> None:  # fmt: skip
        # Each lane's passes are timed, and learnt from, on their own.
        self.clocks = (StepClock(speed), StepClock(speed))
        self.step_seconds = step_seconds
        self.builds = builds
        self.attended = attended
        self.min_step_tokens = SHAPE_BUILD_STEP_TOKENS if builds else MIN_STEP_TOKENS
        self._sizes = chunk_sizes(max_chunk)
        # The planned step's passes in each lane, with what each prefills.
        self._planned: tuple[tuple[Part | None, ...], ...] = ((), ())
        self._new: set[Part] = set()  # the planned passes that build first
        self._slow: Counter[Shape] = Counter()  # passes of each shape far over the budget

    def plan(
        self, short: list[int], context: int, short_lane: bool,
        long: tuple[int, int] | None, long_lane: bool, largest: int,
    ) -> tuple[int, tuple[int, ...]]:  # fmt: skip
        """Plan the step's passes: the short lane's prompt rows with `short`
        tokens left each at `context` (`short_lane`: the lane runs at all),
        the long prompt's (tokens left, context) if one is prefilling
        (`long_lane`: the lane runs at all), chunks at most `largest`. Returns
        the short lane's chunk per row and the long lane's chunks."""
        chunk = largest
        parts: tuple[Part | None, ...] = (None,) if short_lane else ()
        if short:
            size = min(chunk, self.row_chunk(len(short), context))
            chunk = self._piece(SHORT, len(short), size, context, max(short), 0.0)
            part = min(chunk, max(short))  # every row is padded to the longest one's part
            parts = (Part.of(len(short), part, chunk, context),)
        spent = sum(self.pass_seconds(SHORT, part) for part in parts)
        long_parts = self.long_parts(*long, largest, spent) if long else ()
        # A pass after the prompt's last chunk (None) prefills nothing: any chunk will do.
        long_chunks = tuple((part or long_parts[0]).shape[1] for part in long_parts)
        if not long_parts and long_lane:
            long_parts = (None,)  # its decoding rows
        self._planned = (parts, long_parts)
        self._new = {p for p in (*parts, *long_parts) if self._is_new(p)}
        return chunk, long_chunks

    def clear(self) -> None:
        """No step this turn."""
        self._planned = ((), ())
        self._new = set()

    def row_chunk(
        self,
        rows: int,
        context: int,
        builds: bool = True,
        spent: float = 0.0,
        lane: int = SHORT,
        amortized: bool = True,
    ) -> int:
        """The largest chunk each of `rows` prompt rows of `lane` may prefill
        in one pass within the step's budget, at `context` tokens of context
        (`builds`: counting what a shape not seen yet costs to build), after
        `spent` seconds of the step's other passes; `amortized`: below the
        minimum where that wastes little (`_amortized`)."""
        floor = next(
            s for s in self._sizes
            if s * rows >= self.min_step_tokens or s == self._sizes[-1]
            or (amortized and self._amortized(lane, rows, s, context))
        )  # fmt: skip
        for size in reversed(self._sizes):
            if size <= floor:
                return floor
            shape = (rows, aligned(size, context), context) if builds else None
            if self._slow[shape] >= SLOW_TIMES:
                continue
            part = Part(rows * size, context + size // 2, shape)
            if spent + self.pass_seconds(lane, part) <= self.step_seconds:
                return size
        return floor

    def _amortized(self, lane: int, rows: int, size: int, context: int) -> bool:
        """Whether `rows` rows' chunks of `size` cost AMORTIZED passes that only
        decode, at least (as the clocks know them: not before such passes ran;
        never where each new shape costs a build)."""
        decoding = max(clock.decode_seconds for clock in self.clocks)
        if self.builds is not None or decoding <= 0:
            return False
        prefill = self.clocks[lane].prefill_seconds(rows * size, context + size // 2)
        return prefill >= AMORTIZED * decoding

    def _piece(
        self, lane: int, rows: int, size: int, context: int, left: int, spent: float
    ) -> int:
        """The chunk of a pass of `rows` prompt rows of `lane` at `context`,
        at most `size`, with `left` tokens to go: all of them where they fit
        and the budget (after `spent` seconds) holds the pass, else to the
        next multiple of `size`."""
        chunk = aligned(size, context)
        if chunk < left <= size:
            whole = Part.of(rows, left, left, context)
            if spent + self.pass_seconds(lane, whole) <= self.step_seconds:
                return left
        return chunk

    def _is_new(self, part: Part | None) -> bool:
        """Whether a pass prefilling `part` builds kernels first (None: no prefill)."""
        if self.builds is None or part is None or part.shape is None:
            return False
        return self.builds(*_per_row(part))

    def _queries(self, part: Part) -> int | None:
        """The queries `part`'s attention runs, padding included (None: its tokens)."""
        if self.attended is None or part.shape is None:
            return None
        rows, tokens, context = _per_row(part)
        return rows * self.attended(rows, tokens, context)

    def pass_seconds(self, lane: int, part: Part | None) -> float:
        """What a pass of `lane` takes: its decoding rows, and `part`'s
        prefill; one of a shape not built yet adds what a build costs."""
        clock = self.clocks[lane]
        if part is None:
            return clock.decode_seconds
        seconds = clock.seconds(part.tokens, part.context, self._queries(part))
        return seconds + clock.build_seconds if self._is_new(part) else seconds

    def prefill_seconds(self, tokens: int, context: int) -> float:
        """What prefilling `tokens` prompt tokens of one prompt after `context`
        would take, as the long lane's clock has learnt it, range by range."""
        seconds, step = 0.0, self._sizes[-1]
        for start in range(context, context + tokens, step):
            part = min(step, context + tokens - start)
            seconds += self.clocks[LONG].prefill_seconds(part, start + part // 2)
        return seconds

    def planned_seconds(self) -> float:
        """What the planned step should take."""
        return sum(
            self.pass_seconds(lane, part)
            for lane, parts in enumerate(self._planned)
            for part in parts
        )

    def long_parts(
        self, remaining: int, context: int, largest: int, spent: float
    ) -> tuple[Part | None, ...]:
        """What the long prompt prefills this step, a chunk a pass:
        `remaining` tokens to go from `context`, after `spent` seconds of the
        step's other passes. One chunk, and where the budget holds more than
        one of the largest (`largest`), more of those while the step stays
        within it; smaller chunks come one a step. After its last chunk, one
        more pass (None) where the budget holds it: a prompt's first token is
        sampled in the pass after its last chunk, and until then no other long
        prompt starts, so without it the next would wait for a step of its own."""
        parts: list[Part | None] = []
        size = min(largest, self.row_chunk(1, context, spent=spent, lane=LONG))
        while remaining > 0:
            chunk = self._piece(LONG, 1, size, context, remaining, spent)
            tokens = min(chunk, remaining)
            part = Part.of(1, tokens, chunk, context)
            seconds = self.pass_seconds(LONG, part)
            if parts and (size < largest or spent + seconds > self.step_seconds):
                break
            parts.append(part)
            spent += seconds
            remaining -= part.tokens
            context += part.tokens
        if remaining <= 0 and spent + self.pass_seconds(LONG, None) <= self.step_seconds:
            parts.append(None)
        return tuple(parts)

    def observe(self, passes: Passes, rows: int) -> None:
        """The planned step ran over `rows` sequences, its passes taking `passes`."""
        planned = self._planned
        took = ((passes.short,) if passes.short is not None else (), passes.long)
        if log.isEnabledFor(logging.DEBUG):  # every step: not even the arguments otherwise
            parts = [p for lane in planned for p in lane if p is not None]
            tokens = sum(p.tokens for p in parts)
            context = sum(p.tokens * p.context for p in parts) // tokens if tokens else 0
            log.debug(
                "step %.1f ms (expected %.1f): %d rows, %d prompt tokens at context %d "
                "in %d prefills; passes %s ms%s",
                passes.seconds * 1e3, self.planned_seconds() * 1e3, rows, tokens, context,
                len(parts), " + ".join(f"{t * 1e3:.0f}" for lane in took for t in lane),
                ", new shapes" if self._new else "",
            )  # fmt: skip
        for lane, (parts, times) in enumerate(zip(planned, took, strict=True)):
            if len(parts) != len(times):
                continue  # not the step planned: nothing to learn from it
            for part, seconds in zip(parts, times, strict=True):
                self._learn(lane, part, seconds)

    def _learn(self, lane: int, part: Part | None, seconds: float) -> None:
        """A pass of `lane` prefilling `part` took `seconds`."""
        if part is None:
            self.clocks[lane].observe(0, 0, seconds)
            return
        new = part in self._new
        self.clocks[lane].observe(
            part.tokens, part.context, seconds, new_shape=new, queries=self._queries(part)
        )
        if not new and part.fills and seconds > SLOW_STEP * self.step_seconds:
            if len(self._slow) >= SLOW_REMEMBERED:
                self._slow.clear()
            self._slow[part.shape] += 1


def _per_row(part: Part) -> tuple[int, int, int]:
    """`part`'s prompt rows, the tokens each prefills, and the context before."""
    rows, chunk, context = part.shape
    return rows, min(chunk, part.tokens // rows), context
