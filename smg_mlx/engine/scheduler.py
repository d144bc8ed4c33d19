"""The scheduling policy: which waiting requests start, and how much each step prefills.

Pure policy, no MLX: the engine loop hands it what arrived and what runs,
asks `Scheduler.schedule` once per turn, and applies the `Plan` (on every
rank, when the model is split over several). The rules:

- **A step budget.** A step decodes every running stream once and prefills a
  chunk of each prompt being prefilled. The chunk is sized (by the
  `StepClock`) so that the step takes about `--step-budget-ms`: a running
  stream's pause between two tokens stays about that long, whatever arrives.
  mlx-lm pads every prompt row to one chunk length, so R rows at chunk c
  cost R x c tokens: the budget is split evenly over the rows. A step
  prefills at least MIN_STEP_TOKENS in all (SHAPE_BUILD_STEP_TOKENS where a
  new shape costs a kernel build), even past the budget: smaller steps would
  waste the accelerator more than they save anyone's time. Where the clock
  is far off for a shape (its steps took over SLOW_STEP budgets SLOW_TIMES
  times), that shape gets a smaller chunk from then on.
- **Few shapes.** Chunks are powers of two, and each ends where the batch's
  cache length is a multiple of it: the same attention shapes come back
  step after step and prompt after prompt. mlx's CUDA backend builds a cuDNN
  graph for every new one, which costs more than a large chunk's work there:
  a step of a shape not seen yet counts that cost (as the clock has
  measured it) against the budget, and does not teach the clock that its
  tokens cost that much, which would shrink the chunks into yet more new shapes.
- **Short before long.** A prompt is long when its prefill needs more than
  LONG_PROMPT_STEPS steps' budget (at no context). At most
  LONG_PREFILLS_AT_ONCE long prompts prefill at a time, in arrival order
  (the next starts once the last is prefilled): several at once finish no
  sooner in all, the first of them much later, and mlx-lm pads the newer
  one's cache to the older one's length. Shorter prompts start at the next
  step, the shortest first, while prompt rows are free and what the short
  prompts being prefilled have left adds up to no more than a long prompt
  (padded to each other, more would be a long prompt's work that a chat
  arriving behind them waits for); a long prompt being prefilled steps
  aside (its cache kept) until they have their first token, then comes back
  for at least one step before it steps aside again (and nothing starts in
  the step where its prompt ends, which would pad it). The short prompts'
  first steps are then short, and the long one's attention shapes stay
  those of a batch of one, which repeat.
- **Memory.** A request starts only when the batch with it fits the memory
  budget (`MemoryPlanner`). One that does not fit waits without holding back
  smaller ones behind it; one that can never fit is refused.
- **No starvation.** A request that has waited AGING_SECONDS goes ahead of
  every younger one; if it still cannot start for memory, for a free slot or
  for the short prompts being prefilled, nothing younger starts before it.
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
from smg_mlx.engine.step_clock import StepClock
from smg_mlx.engine.types import Request

log = logging.getLogger(__name__)

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
# A shape whose steps took over SLOW_STEP budgets SLOW_TIMES times (counting
# steps whose rows filled the chunk, a first, building one aside) gets a
# smaller chunk from then on: the clock's cost model (linear in the context)
# can be far off for some shapes, such as large chunks at long context on
# CUDA, and the same shapes come back prompt after prompt.
SLOW_STEP = 2.0
SLOW_TIMES = 2


# A prefill step's shape, as the backend's kernels see it: prompt rows, chunk,
# and the context before it.
Shape = tuple[int, int, int]


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
    aside: bool = False  # a long prompt set aside while short ones prefill
    fresh: bool = True  # no token yet


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
    set_aside: tuple[int, ...] = ()  # keys of long prompts that make way for the admitted
    resume: tuple[int, ...] = ()  # keys of long prompts set aside, back in the batch
    refuse: tuple[Request, ...] = ()  # can never fit in memory
    chunk: int | None = None  # prefill chunk per prompt row; None: no step
    prefix_allowance: int = 0  # bytes the prefix cache may keep
    expected_seconds: float = 0.0  # how long the step should take
    prefill_bytes: float = 0.0  # the step's prefill working set (estimated)
    waiting_for_memory: int = 0  # requests seen waiting for memory alone


class Scheduler:
    """Holds the waiting room and decides each turn. Runs on rank 0's engine thread."""

    def __init__(
        self,
        planner: MemoryPlanner,
        clock: StepClock,
        *,
        batch_size: int,
        prefill_rows: int,
        step_seconds: float,
        shape_builds: bool = False,
        cached_prefix: Callable[[Sequence[int]], int] = lambda prompt: 0,
    ) -> None:
        self.planner = planner
        self.clock = clock
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
        # The planned step's prompt tokens, their mean context, and its shape.
        self._measured: tuple[int, int, Shape | None] = (0, 0, None)
        self._built: set[Shape] = set()  # prefill shapes that have run
        self._slow: Counter[Shape] = Counter()  # steps of each shape far over the budget

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

    def row_chunk(self, rows: int, context: int, builds: bool = True) -> int:
        """The largest chunk each of `rows` prompt rows may prefill in one step
        within the budget, at `context` tokens of context (`builds`: counting
        what a shape not seen yet costs to build)."""
        floor = next(
            s for s in self._sizes if s * rows >= self.min_step_tokens or s == self._sizes[-1]
        )
        for size in reversed(self._sizes):
            if size <= floor:
                return floor
            shape = (rows, aligned(size, context), context) if builds else None
            if self._slow[shape] >= SLOW_TIMES:
                continue
            if self._expected(rows * size, context + size // 2, shape) <= self.step_seconds:
                return size
        return floor

    def _is_new(self, shape: Shape | None) -> bool:
        """Whether a step of `shape` builds kernels first (None: no prefill)."""
        return self.shape_builds and shape is not None and shape not in self._built

    def _expected(self, tokens: int, context: int, shape: Shape | None) -> float:
        """A step's seconds, `tokens` prompt tokens at mean context `context`;
        one of a shape not built yet adds what a build costs."""
        seconds = self.clock.seconds(tokens, context)
        return seconds + self.clock.build_seconds if self._is_new(shape) else seconds

    def schedule(
        self, running: Sequence[Running], prefix_bytes: int, now: float | None = None
    ) -> Plan:
        """Which waiting requests start beside `running`, and the step's chunk."""
        now = time.monotonic() if now is None else now
        prefilling = [r for r in running if r.cost.prefilling]
        # Prompt tokens past which a prompt is long.
        long = LONG_PROMPT_STEPS * self.row_chunk(1, 0, builds=False)
        aside = [r for r in prefilling if r.aside]
        shorts = any(r.fresh and r.cost.prompt <= long and not r.aside for r in running)
        # Long prompts set aside come back once the short ones have their first
        # token; nothing starts beside them in that step.
        resume = aside if not shorts else []
        # A long prompt whose last chunk just ran joins the decoding rows at the
        # next step; a prompt starting beside it now would be padded to its length.
        finishing = any(not r.remaining and r.cost.prompt > long for r in prefilling)
        admitted, refused, for_memory = ([], (), 0) if resume or finishing else self._admit(
            running, prefilling, long, shorts, now
        )
        set_aside = []
        if any(w.prefill <= long for w in admitted):
            set_aside = [
                r for r in prefilling if r.remaining and r.cost.prompt > long and not r.aside
            ]
        costs = [r.cost for r in running] + [w.cost for w in admitted]
        allowance = self.planner.prefix_allowance(costs)
        if not costs:
            self._measured = (0, 0, None)
            return Plan(refuse=refused, prefix_allowance=allowance, waiting_for_memory=for_memory)
        away = {id(r) for r in aside + set_aside} - {id(r) for r in resume}
        rows = [r for r in prefilling if id(r) not in away]
        needs = [r.remaining for r in rows if r.remaining] + [
            w.prefill - 1 for w in admitted if w.prefill > 1
        ]
        context = max([r.context for r in rows] + [w.cached for w in admitted], default=0)
        chunk = self.planner.chunk(costs, min(prefix_bytes, allowance))
        tokens, shape, part = 0, None, 0
        if needs:
            chunk = aligned(min(chunk, self.row_chunk(len(needs), context)), context)
            part = min(chunk, max(needs))  # every row is padded to the longest one's part
            tokens = len(needs) * part
            shape = (len(needs), chunk, context)
        self._measured = (tokens, context + part // 2 if tokens else 0, shape)
        return Plan(
            admit=tuple(w.request for w in admitted),
            set_aside=tuple(r.key for r in set_aside),
            resume=tuple(r.key for r in resume),
            refuse=refused,
            chunk=chunk,
            prefix_allowance=allowance,
            expected_seconds=self._expected(*self._measured),
            prefill_bytes=self.planner.prefill_bytes(costs, chunk),
            waiting_for_memory=for_memory,
        )

    def observe(self, seconds: float, rows: int) -> None:
        """The planned step ran in `seconds` over `rows` sequences."""
        tokens, context, shape = self._measured
        new = self._is_new(shape)
        if log.isEnabledFor(logging.DEBUG):  # every step: not even the arguments otherwise
            log.debug(
                "step %.1f ms (expected %.1f): %d rows, %d prompt tokens at context %d%s",
                seconds * 1e3, self._expected(*self._measured) * 1e3, rows, tokens, context,
                ", a new shape" if new else "",
            )  # fmt: skip
        self.clock.observe(tokens, context, seconds, new_shape=new)
        # Only a step whose rows fill the chunk tells what that chunk costs.
        fills = shape is not None and tokens == shape[0] * shape[1]
        if fills and not new and seconds > SLOW_STEP * self.step_seconds:
            if len(self._slow) >= SHAPES_REMEMBERED:
                self._slow.clear()
            self._slow[shape] += 1
        if new:
            if len(self._built) >= SHAPES_REMEMBERED:
                self._built.clear()
            self._built.add(shape)

    def _admit(
        self,
        running: Sequence[Running],
        prefilling: list[Running],
        long_tokens: int,
        shorts: bool,
        now: float,
    ) -> tuple[list[Waiting], tuple[Request, ...], int]:
        """Who starts now (`shorts`: short prompts have no first token yet, and a
        long prompt does not start beside them)."""
        costs = [r.cost for r in running]
        slots = min(self.batch_size - len(costs), self.prefill_rows - len(prefilling))
        longs = sum(r.cost.prompt > long_tokens for r in prefilling)
        # Prompt tokens the short prompts being prefilled have still to go.
        together = sum(r.remaining for r in prefilling if r.cost.prompt <= long_tokens)
        admitted: list[Waiting] = []
        refused: list[Request] = []
        too_big: list[Cost] = []  # what did not fit: anything at least as big waits too
        for_memory = 0
        long_started = False
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
            if long and (longs >= LONG_PREFILLS_AT_ONCE or shorts):
                continue  # its turn comes when the long prompt prefilling is done
            if not long and long_started:
                continue  # next turn, when the long one steps aside: no padding to its length
            if not long and together and together + waiting.prefill > long_tokens:
                # Prefilled beside them, it would make one long prompt's worth of
                # padded rows: it starts when they are done.
                if now - waiting.arrived >= AGING_SECONDS:
                    break
                continue
            if any(_at_least(new, c) for c in too_big) or not self.planner.fits([*costs, new]):
                for_memory += 1
                too_big.append(new)
                if now - waiting.arrived >= AGING_SECONDS:
                    break  # it holds its place: nothing younger starts before it
                continue
            costs.append(new)
            admitted.append(self._room.pop(waiting.request.key))
            slots -= 1
            longs += long
            together += 0 if long else waiting.prefill
            long_started = long_started or long
            shorts = shorts or not long
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
