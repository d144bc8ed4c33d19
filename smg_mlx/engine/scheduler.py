"""The scheduling policy: which waiting requests start, and how much each step prefills.

Pure policy, no MLX: the engine loop hands it what arrived and what runs,
asks `Scheduler.schedule` once per turn, and applies the `Plan` (on every
rank, when the model is split over several). The rules:

- **Two lanes.** The batch runs long prompts in a lane of their own (an
  mlx-lm BatchGenerator each): mlx-lm pads every row of a batch to its
  longest one, so a chat beside a long prompt would decode at the long
  prompt's length and prefill beside its chunks.
- **A step budget.** A step runs the short lane once (every running stream
  decodes, and each short prompt being prefilled takes a chunk), then the
  long lane once for each chunk of the long prompt that fits what is left:
  each call is a pass over the model. Chunks are sized so that the step
  takes about `--step-budget-ms`: a running stream's pause between two
  tokens stays about that long, whatever arrives. Each lane has a
  `StepClock`, which learns from that lane's passes alone what a pass
  costs. mlx-lm pads every prompt row to one chunk length, so R rows at
  chunk c cost R x c tokens: the short lane's share is split evenly over its
  rows. The long lane gets several chunks of at most `--prefill-step-size`
  rather than one larger one (large chunks at long context are slow on some
  backends). Each lane prefills at least MIN_STEP_TOKENS
  (SHAPE_BUILD_STEP_TOKENS where a new shape costs a kernel build), even past
  the budget: smaller steps would waste the accelerator more than they save
  anyone's time, and a long prompt always moves. Where the clock is far off
  for a shape (a pass with it took over SLOW_STEP budgets SLOW_TIMES times),
  that shape gets a smaller chunk from then on.
- **Few shapes.** Chunks are powers of two, and each ends where the batch's
  cache length is a multiple of it: the same attention shapes come back
  step after step and prompt after prompt. mlx's CUDA backend builds a cuDNN
  graph for every new one, which costs more than a large chunk's work there:
  a pass of a shape not seen yet counts that cost (as the clock has
  measured it) against the budget, and does not teach the clock that its
  tokens cost that much, which would shrink the chunks into yet more new shapes.
- **Short before long.** A prompt is long when its prefill needs more than
  LONG_PROMPT_STEPS steps' budget (at no context). At most
  LONG_PREFILLS_AT_ONCE long prompts prefill at a time, in arrival order
  (the next starts once the last is prefilled, not in the step where its
  prompt ends, which would pad it; that step takes one more pass where its
  budget holds it, which moves the prompt into its lane's decoding rows, so
  the next starts at the next step): several at once finish no sooner in
  all, the first of them much later, and mlx-lm pads the newer one's cache
  to the older one's length. Shorter prompts start at the next step, the
  shortest first, while prompt rows are free and what the short prompts
  being prefilled have left adds up to no more than a long prompt (padded
  to each other, more would be a long prompt's work that a chat arriving
  behind them waits for). Their lane comes first in each step's budget;
  the long prompt's attention shapes stay those of a batch of one, which
  repeat.
- **Memory.** A request starts only when the batch with it fits the memory
  budget (`MemoryPlanner`). One that does not fit waits without holding back
  smaller ones behind it; one that can never fit is refused.
- **No starvation.** A request that has waited AGING_SECONDS goes ahead of
  every younger one; if it still cannot start for memory, for a free slot or
  for the short prompts being prefilled, nothing younger starts before it.
  A long prompt prefilling moves every step, whatever the short lane takes.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from smg_mlx.engine.memory import Cost, MemoryPlanner, cost
from smg_mlx.engine.step_clock import PrefillSpeed, StepClock
from smg_mlx.engine.types import Request

log = logging.getLogger(__name__)

# The lanes: each an mlx-lm BatchGenerator, which pads every row of its batch
# to the longest one; long prompts run in a lane of their own.
SHORT, LONG = 0, 1
LONG_PREFILLS_AT_ONCE = 1
LONG_PROMPT_STEPS = 4
MIN_STEP_TOKENS = 128
# mlx's CUDA backend builds a cuDNN graph for each new attention shape, which
# costs as much as prefilling hundreds of tokens: fewer, larger steps there.
SHAPE_BUILD_STEP_TOKENS = 512
AGING_SECONDS = 10.0
SMALLEST_CHUNK = 16
# Prefill shapes remembered as built; past this many (engine.batch sizes mlx's
# CUDA graph cache to hold as many) the memory starts over.
SHAPES_REMEMBERED = 1024
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


@dataclass(frozen=True, slots=True)
class Part:
    """What one pass over the model prefills: its prompt tokens (all rows),
    their mean context, and its shape."""

    tokens: int
    context: int
    shape: Shape

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


@dataclass(frozen=True, slots=True)
class Running:
    """A sequence in the batch, as the policy sees it."""

    cost: Cost
    remaining: int = 0  # prompt tokens still to prefill (0: decoding, or about to)
    context: int = 0  # tokens in its cache
    key: int = 0
    long: bool = False  # in the long prompts' lane


@dataclass(slots=True)
class Waiting:
    """A request in the waiting room."""

    request: Request
    order: int  # arrival order (requests put back after an error go first)
    arrived: float  # time.monotonic()
    prefill: int  # prompt tokens to prefill, after the prefix cache's share
    cached: int  # prompt tokens the prefix cache holds
    cost: Cost = field(init=False)

    def __post_init__(self) -> None:
        self.cost = cost(self.request)


@dataclass(frozen=True)
class Plan:
    """One turn's decisions."""

    admit: tuple[Request, ...] = ()  # start now, in this order
    long: tuple[int, ...] = ()  # keys of those admitted that go to the long lane
    refuse: tuple[Request, ...] = ()  # can never fit in memory
    chunk: int | None = None  # the short lane's chunk per prompt row; None: no step
    long_chunks: tuple[int, ...] = ()  # the long lane's chunks, one call each (see _long_parts)
    prefix_allowance: int = 0  # bytes the prefix cache may keep
    expected_seconds: float = 0.0  # how long the step should take
    prefill_bytes: float = 0.0  # the step's prefill working set (estimated)
    waiting_for_memory: int = 0  # requests seen waiting for memory alone


class Scheduler:
    """Holds the waiting room and decides each turn. Runs on rank 0's engine thread."""

    def __init__(
        self,
        planner: MemoryPlanner,
        speed: PrefillSpeed,
        *,
        batch_size: int,
        prefill_rows: int,
        step_seconds: float,
        shape_builds: bool = False,
        cached_prefix: Callable[[Sequence[int]], int] = lambda prompt: 0,
    ) -> None:
        self.planner = planner
        # Each lane's passes are timed, and learnt from, on their own.
        self.clocks = (StepClock(speed), StepClock(speed))
        self.batch_size = batch_size
        self.prefill_rows = prefill_rows
        self.step_seconds = step_seconds
        self.shape_builds = shape_builds
        self.min_step_tokens = SHAPE_BUILD_STEP_TOKENS if shape_builds else MIN_STEP_TOKENS
        self._cached_prefix = cached_prefix
        self._sizes = chunk_sizes(planner.max_chunk)
        self._room: dict[int, Waiting] = {}  # by request key
        self._order = itertools.count()
        self._put_back = itertools.count(-(2**62))  # ahead of every arrival
        # The planned step's passes in each lane, with what each prefills.
        self._planned: tuple[tuple[Part | None, ...], ...] = ((), ())
        self._built: set[Shape] = set()  # prefill shapes that have run
        self._slow: Counter[Shape] = Counter()  # passes of each shape far over the budget

    # ---- the waiting room ----

    def __len__(self) -> int:
        return len(self._room)

    def add(self, requests: Iterable[Request], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for request in requests:
            self._enter(request, next(self._order), now)

    def put_back(self, requests: Sequence[Request]) -> None:
        """Requests that were running, back after an error: they go first, in order."""
        for request in requests:
            self._enter(request, next(self._put_back), -math.inf)

    def _enter(self, request: Request, order: int, arrived: float) -> None:
        prompt = request.spec.prompt
        cached = self._cached_prefix(prompt)
        self._room[request.key] = Waiting(request, order, arrived, len(prompt) - cached, cached)

    def remove(self, keys: Iterable[int]) -> list[Request]:
        """Take these requests out of the room (aborted); those that were there."""
        return [w.request for k in keys if (w := self._room.pop(k, None)) is not None]

    # ---- the decisions ----

    def row_chunk(
        self,
        rows: int,
        context: int,
        builds: bool = True,
        spent: float = 0.0,
        lane: int = SHORT,
    ) -> int:
        """The largest chunk each of `rows` prompt rows of `lane` may prefill
        in one pass within the step's budget, at `context` tokens of context
        (`builds`: counting what a shape not seen yet costs to build), after
        `spent` seconds of the step's other passes."""
        floor = next(
            s for s in self._sizes if s * rows >= self.min_step_tokens or s == self._sizes[-1]
        )
        for size in reversed(self._sizes):
            if size <= floor:
                return floor
            shape = (rows, aligned(size, context), context) if builds else None
            if self._slow[shape] >= SLOW_TIMES:
                continue
            part = Part(rows * size, context + size // 2, shape)
            if spent + self._pass_seconds(lane, part) <= self.step_seconds:
                return size
        return floor

    def _is_new(self, shape: Shape | None) -> bool:
        """Whether a pass of `shape` builds kernels first (None: no prefill)."""
        return self.shape_builds and shape is not None and shape not in self._built

    def _pass_seconds(self, lane: int, part: Part | None) -> float:
        """What a pass of `lane` takes: its decoding rows, and `part`'s
        prefill; one of a shape not built yet adds what a build costs."""
        clock = self.clocks[lane]
        if part is None:
            return clock.decode_seconds
        seconds = clock.seconds(part.tokens, part.context)
        return seconds + clock.build_seconds if self._is_new(part.shape) else seconds

    def _planned_seconds(self) -> float:
        """What the planned step should take."""
        return sum(
            self._pass_seconds(lane, part)
            for lane, parts in enumerate(self._planned)
            for part in parts
        )

    def schedule(
        self, running: Sequence[Running], prefix_bytes: int, now: float | None = None
    ) -> Plan:
        """Which waiting requests start beside `running`, and the step's chunks."""
        now = time.monotonic() if now is None else now
        prefilling = [r for r in running if r.cost.prefilling]
        # Prompt tokens past which a prompt is long.
        long = LONG_PROMPT_STEPS * self.row_chunk(1, 0, builds=False, lane=LONG)
        admitted, refused, for_memory = self._admit(running, prefilling, long, now)
        costs = [r.cost for r in running] + [w.cost for w in admitted]
        allowance = self.planner.prefix_allowance(costs)
        if not costs:
            self._planned = ((), ())
            return Plan(refuse=refused, prefix_allowance=allowance, waiting_for_memory=for_memory)
        chunk = largest = self.planner.chunk(costs, min(prefix_bytes, allowance))
        starting_long = [w for w in admitted if w.prefill > long]
        starting_short = [w for w in admitted if w.prefill <= long]
        shorts = [r for r in running if not r.long]
        needs = [r.remaining for r in shorts if r.remaining] + [
            w.prefill - 1 for w in starting_short if w.prefill > 1
        ]
        short: tuple[Part | None, ...] = (None,) if shorts or starting_short else ()
        if needs:
            context = max(
                [r.context for r in shorts if r.cost.prefilling]
                + [w.cached for w in starting_short],
                default=0,
            )
            chunk = aligned(min(chunk, self.row_chunk(len(needs), context)), context)
            part = min(chunk, max(needs))  # every row is padded to the longest one's part
            short = (Part(len(needs) * part, context + part // 2, (len(needs), chunk, context)),)
        longs = [(r.remaining, r.context) for r in prefilling if r.long and r.remaining] + [
            (w.prefill - 1, w.cached) for w in starting_long
        ]
        spent = sum(self._pass_seconds(SHORT, part) for part in short)
        long_parts = self._long_parts(*longs[0], largest, spent) if longs else ()
        # A pass after the prompt's last chunk (None) prefills nothing: any chunk will do.
        long_chunks = tuple((part or long_parts[0]).shape[1] for part in long_parts)
        if not long_parts and (starting_long or any(r.long for r in running)):
            long_parts = (None,)  # its decoding rows
        self._planned = (short, long_parts)
        return Plan(
            admit=tuple(w.request for w in admitted),
            long=tuple(w.request.key for w in starting_long),
            refuse=refused,
            chunk=chunk,
            long_chunks=long_chunks,
            prefix_allowance=allowance,
            expected_seconds=self._planned_seconds(),
            prefill_bytes=self.planner.prefill_bytes(costs, max((chunk, *long_chunks))),
            waiting_for_memory=for_memory,
        )

    def _long_parts(
        self, remaining: int, context: int, largest: int, spent: float
    ) -> tuple[Part | None, ...]:
        """What the long prompt prefills this step, a chunk a pass:
        `remaining` tokens to go from `context`, after `spent` seconds of the
        step's other passes. One chunk, and where the budget holds more than
        one of the largest (`largest`), more of those while the step stays
        within it; smaller chunks come one a step. After its last chunk, one
        more pass (None) where the budget holds it: mlx-lm moves a prompt into
        its decoding rows in the pass after its last chunk, and until then no
        other long prompt may start (it would be padded to this one's length),
        so without it the next would wait for a step of its own."""
        parts: list[Part | None] = []
        size = min(largest, self.row_chunk(1, context, spent=spent, lane=LONG))
        while remaining > 0:
            chunk = aligned(size, context)
            tokens = min(chunk, remaining)
            part = Part(tokens, context + tokens // 2, (1, chunk, context))
            seconds = self._pass_seconds(LONG, part)
            if parts and (size < largest or spent + seconds > self.step_seconds):
                break
            parts.append(part)
            spent += seconds
            remaining -= part.tokens
            context += part.tokens
        if remaining <= 0 and spent + self._pass_seconds(LONG, None) <= self.step_seconds:
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
                passes.seconds * 1e3, self._planned_seconds() * 1e3, rows, tokens, context,
                len(parts), " + ".join(f"{t * 1e3:.0f}" for lane in took for t in lane),
                ", new shapes" if any(self._is_new(p.shape) for p in parts) else "",
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
        new = self._is_new(part.shape)
        self.clocks[lane].observe(part.tokens, part.context, seconds, new_shape=new)
        if new:
            if len(self._built) >= SHAPES_REMEMBERED:
                self._built.clear()
            self._built.add(part.shape)
        elif part.fills and seconds > SLOW_STEP * self.step_seconds:
            if len(self._slow) >= SHAPES_REMEMBERED:
                self._slow.clear()
            self._slow[part.shape] += 1

    def _admit(
        self, running: Sequence[Running], prefilling: list[Running], long_tokens: int, now: float
    ) -> tuple[list[Waiting], tuple[Request, ...], int]:
        """Who starts now."""
        costs = [r.cost for r in running]
        slots = self.batch_size - len(costs)
        rows = self.prefill_rows - sum(not r.long for r in prefilling)  # the short lane's
        longs = sum(r.long for r in prefilling)
        # A long prompt whose last chunk ran joins its lane's decoding rows at
        # the next step; one starting now would be padded to its length.
        finishing = any(r.long and not r.remaining for r in prefilling)
        # Prompt tokens the short prompts being prefilled have still to go.
        together = sum(r.remaining for r in prefilling if not r.long)
        admitted: list[Waiting] = []
        refused: list[Request] = []
        too_big: list[Cost] = []  # what did not fit: anything at least as big waits too
        for_memory = 0
        if slots <= 0:
            return [], (), 0
        ranked = sorted(self._room.values(), key=lambda w: self._rank(w, long_tokens, now))
        for waiting in ranked:
            if slots <= 0:
                break
            new = waiting.cost
            if not self.planner.fits([new]):
                refused.append(self._room.pop(waiting.request.key).request)
                continue
            long = waiting.prefill > long_tokens
            if long and (longs >= LONG_PREFILLS_AT_ONCE or finishing):
                continue  # its turn comes when the long prompt prefilling is done
            aged = now - waiting.arrived >= AGING_SECONDS
            # No prompt row free, or, prefilled beside the short prompts, it would
            # make one long prompt's worth of padded rows: it starts when they are done.
            if not long and (rows <= 0 or (together and together + waiting.prefill > long_tokens)):
                if aged:
                    break
                continue
            if any(_at_least(new, c) for c in too_big) or not self.planner.fits([*costs, new]):
                for_memory += 1
                too_big.append(new)
                if aged:
                    break  # it holds its place: nothing younger starts before it
                continue
            costs.append(new)
            admitted.append(self._room.pop(waiting.request.key))
            slots -= 1
            longs += long
            rows -= not long
            together += 0 if long else waiting.prefill
            if long:
                log.info(
                    "request %r: a long prompt starts (%d tokens to prefill) after %.1fs; "
                    "%d request(s) wait",
                    waiting.request.request_id, waiting.prefill, now - waiting.arrived,
                    len(self._room),
                )  # fmt: skip
        return admitted, tuple(refused), for_memory

    @staticmethod
    def _rank(waiting: Waiting, long_tokens: int, now: float) -> tuple[int, int, int]:
        """Aged requests first, in arrival order; then short prompts, the
        shortest first; then long ones, in arrival order."""
        if now - waiting.arrived >= AGING_SECONDS:
            return 0, 0, waiting.order
        if waiting.prefill <= long_tokens:
            return 1, waiting.prefill, waiting.order
        return 2, 0, waiting.order


def _at_least(a: Cost, b: Cost) -> bool:
    """Whether `a` costs the budget at least what `b` does, beside any batch."""
    return a.total >= b.total and a.prompt >= b.prompt
