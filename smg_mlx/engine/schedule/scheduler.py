"""The scheduling policy: which waiting requests start, and in which lane.

Pure policy, no MLX: the engine loop hands it what arrived and what runs,
asks `Scheduler.schedule` once per turn, and applies the `Plan` (on every
rank, when the model is split over several). How much each pass of the step
prefills is `engine.schedule.step_plan`'s; the order requests are considered in,
`engine.schedule.waiting_room`'s. The rules:

- **Two lanes.** The batch runs long prompts in a lane of their own (an
  mlx-lm BatchGenerator each): mlx-lm pads every row of a batch to its
  longest one, so a chat beside a long prompt would decode at the long
  prompt's length and prefill beside its chunks.
- **Short before long.** A prompt is long when its prefill needs more than
  LONG_PROMPT_STEPS steps' budget (at no context). At most
  LONG_PREFILLS_AT_ONCE long prompts prefill at a time, in arrival order
  (the next starts once the last is prefilled, not in the step where its
  prompt ends, which would pad it): several at once finish no sooner in all,
  the first of them much later, and mlx-lm pads the newer one's cache to the
  older one's length. Shorter prompts start at the next step, the shortest
  first, while prompt rows are free and what the short prompts being
  prefilled have left adds up to no more than a long prompt (padded to each
  other, more would be a long prompt's work that a chat arriving behind them
  waits for). Their lane comes first in each step's budget; the long prompt's
  attention shapes stay those of a batch of one, which repeat. A prompt with
  little to prefill that is long all the same (a history resent from the
  prefix cache) goes to the long lane where no long prompt is prefilling:
  in the short one it would pad every chat's row to its length. Where one
  is, it starts in the short lane rather than wait.
- **Equal lengths only**, for a model whose outputs padding would change
  (`engine.batch.batch_check`): short prompts prefill side by side only while they
  have as many tokens left to prefill, so that mlx-lm pads none of them.
- **Memory.** A request starts only when the batch with it fits the memory
  budget (`MemoryPlanner`). One that does not fit waits without holding back
  smaller ones behind it; one that can never fit is refused. A request that
  starts from a cached prefix counts only the rest as prefill, and the entry
  it reuses stays in the prefix cache through the turn it starts in; where
  the batch has no room for both, the entry leaves the cache once the request
  has its copy (a request that fits alone never waits for its own entry).
- **No starvation.** A request that has waited AGING_SECONDS goes ahead of
  every younger one; if it still cannot start for memory, for a free slot or
  for the short prompts being prefilled, nothing younger starts before it.
  A long prompt prefilling moves every step, whatever the short lane takes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from smg_mlx.engine.memory.costs import PrefillSpeed
from smg_mlx.engine.memory.planner import Cost, MemoryPlanner, cost
from smg_mlx.engine.schedule.step_plan import LONG, Attended, Builds, Passes, StepPlan
from smg_mlx.engine.schedule.waiting_room import AGING_SECONDS, Prefixes, Waiting, WaitingRoom
from smg_mlx.engine.types import Request
from smg_mlx.logs import counted

log = logging.getLogger(__name__)

LONG_PREFILLS_AT_ONCE = 1
LONG_PROMPT_STEPS = 4
# Steps that succeed, after a step ran out of memory, before one more request
# may run at once (`Scheduler.shed`).
GROW_STEPS = 64


@dataclass(frozen=True, slots=True)
class Running:
    """A sequence in the batch, as the policy sees it."""

    cost: Cost
    remaining: int = 0  # prompt tokens still to prefill (0: decoding, or about to)
    context: int = 0  # tokens in its cache
    key: int = 0

    @property
    def long(self) -> bool:
        """In the long prompts' lane."""
        return self.cost.long


@dataclass(frozen=True)
class Plan:
    """One turn's decisions."""

    admit: tuple[Request, ...] = ()  # start now, in this order
    long: tuple[int, ...] = ()  # keys of those admitted that go to the long lane
    move: tuple[int, ...] = ()  # keys of decoding sequences that move to the long lane
    refuse: tuple[Request, ...] = ()  # can never fit in memory
    chunk: int | None = None  # the short lane's chunk per prompt row; None: no step
    long_chunks: tuple[int, ...] = ()  # the long lane's chunks, one call each (see _long_parts)
    prefix_allowance: int = 0  # bytes the prefix cache may keep
    keep: tuple[int, ...] = ()  # prefix-cache entries the requests admitted reuse
    release: tuple[int, ...] = ()  # of those, the ones that leave once they are copied
    wanted: tuple[int, ...] = ()  # prefix-cache entries requests still waiting reuse
    expected_seconds: float = 0.0  # how long the step should take
    prefill_bytes: float = 0.0  # the step's prefill working set (estimated)
    spare_bytes: float = 0.0  # what the step leaves free of the budget, as a working set
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
        builds: Builds | None = None,
        attended: Attended | None = None,
        prefixes: Prefixes | None = None,
        equal_lengths: bool = False,
    ) -> None:
        self.planner = planner
        self.steps = StepPlan(speed, planner.max_chunk, step_seconds, builds, attended)
        self.batch_size = batch_size
        self.prefill_rows = prefill_rows
        # Short prompts prefill side by side only with as many tokens left.
        self.equal_lengths = equal_lengths
        self._room = WaitingRoom(prefixes)
        # After a step ran out of memory with several requests: how many may run
        # at once (`shed`; None: no cap), and the steps run since it last grew.
        self._running_cap: int | None = None
        self._capped_steps = 0

    # ---- the waiting room ----

    def __len__(self) -> int:
        return len(self._room)

    def add(self, requests: Iterable[Request], now: float | None = None) -> None:
        self._room.add(requests, now)

    def put_back(self, requests: Sequence[Request]) -> None:
        """Requests that were running, back after an error: they go first, in order."""
        self._room.put_back(requests)

    def shed(self, running: int) -> int:
        """A step of `running` requests ran out of memory despite the estimates
        (what else holds the device's memory is not known: another process,
        say): at most half as many run at once, or one fewer where a cap was
        tried one wider; it grows by one every GROW_STEPS steps that succeed
        (`observe`). So steps that keep running out of memory shed load until
        one request runs alone, rather than failing at the same size again,
        and the worker finds its way back up when the memory is there again.
        Returns the cap."""
        fewer = running - 1 if self._running_cap is not None else running // 2
        self._running_cap, self._capped_steps = max(1, fewer), 0
        return self._running_cap

    def remove(self, keys: Iterable[int]) -> list[Request]:
        """Take these requests out of the room (aborted); those that were there."""
        return self._room.remove(keys)

    # ---- the decisions ----

    def observe(self, passes: Passes, rows: int) -> None:
        """The planned step ran over `rows` sequences, its passes taking `passes`."""
        self.steps.observe(passes, rows)
        if self._running_cap is not None:
            self._capped_steps += 1
            if self._capped_steps >= GROW_STEPS:  # (one more: the memory may be back)
                self._running_cap, self._capped_steps = self._running_cap + 1, 0
                if self._running_cap >= self.batch_size:
                    self._running_cap = None

    def schedule(
        self, running: Sequence[Running], prefix_bytes: int, now: float | None = None
    ) -> Plan:
        """Which waiting requests start beside `running`, and the step's chunks."""
        now = time.monotonic() if now is None else now
        prefilling = [r for r in running if r.cost.prefilling]
        # Prompt tokens past which a prompt is long.
        # (by the minimum chunk: where a slow device takes smaller ones, a question
        # would count as long and wait for the document before it)
        long = LONG_PROMPT_STEPS * self.steps.row_chunk(
            1, 0, builds=False, lane=LONG, amortized=False
        )
        admitted, to_long, released, refused, for_memory = self._admit(
            running, prefilling, long, now
        )
        wanted = tuple(self._room.wanted())
        starting_long = [w for w in admitted if w.request.key in to_long]
        starting_short = [w for w in admitted if w.request.key not in to_long]
        starting = [w.cost(w.request.key in to_long) for w in admitted]
        move = self._to_move(running, starting, long, for_memory)
        running = [_moved(r) if r.key in move else r for r in running]
        costs = [r.cost for r in running] + starting
        keep = tuple({w.reuse.entry for w in admitted if w.reuse.entry is not None})
        allowance = self.planner.prefix_allowance(costs)
        if not costs:
            self.steps.clear()
            return Plan(refuse=refused, prefix_allowance=allowance, wanted=wanted,
                        waiting_for_memory=for_memory)  # fmt: skip
        largest = self.planner.chunk(costs, min(prefix_bytes, allowance))
        shorts = [r for r in running if not r.long]
        needs = [r.remaining for r in shorts if r.remaining] + [
            w.prefill - 1 for w in starting_short if w.prefill > 1
        ]
        context = max(
            [r.context for r in shorts if r.cost.prefilling] + [w.cached for w in starting_short],
            default=0,
        )
        longs = [(r.remaining, r.context) for r in prefilling if r.long and r.remaining] + [
            (w.prefill - 1, w.cached) for w in starting_long if w.prefill > 1
        ]
        chunk, long_chunks = self.steps.plan(
            needs, context, bool(shorts or starting_short), longs[0] if longs else None,
            bool(starting_long or any(r.long for r in running)), largest,
        )  # fmt: skip
        # (the prefix cache holds what it may keep of what it holds now)
        spare = self.planner.budget - self.planner.need(costs, max((chunk, *long_chunks)))
        return Plan(
            admit=tuple(w.request for w in admitted),
            long=tuple(w.request.key for w in starting_long),
            move=move,
            refuse=refused,
            chunk=chunk,
            long_chunks=long_chunks,
            prefix_allowance=allowance,
            keep=keep,
            release=released,
            wanted=wanted,
            expected_seconds=self.steps.planned_seconds(),
            prefill_bytes=self.planner.prefill_bytes(costs, max((chunk, *long_chunks))),
            # (before the planner's margin, which an out-of-memory step widens:
            # a draft's catch-up pass measured against it takes the margin too)
            spare_bytes=max(0.0, spare - min(prefix_bytes, allowance)) / self.planner.safety,
            waiting_for_memory=for_memory,
        )

    def _to_move(
        self, running: Sequence[Running], starting: list[Cost], long_tokens: int, for_memory: int
    ) -> tuple[int, ...]:
        """The keys of decoding sequences of the short lane to move to the long
        lane now. mlx-lm pads every row of a lane to its longest: a stream grown
        long makes each chat beside it attend over, and hold memory for, as many
        tokens. Streams move once long (as a prompt of their length would be),
        where a shorter row stays behind or the long lane decodes too, all at
        once: one at a time, both lanes would run a pass every step until the
        last had moved, each as long as the one pass over all of them. The
        longest moves sooner where requests wait for memory its padding holds.
        Only while the long lane prefills nothing (they would be padded to that
        prompt), and as many as the batch fits with them there."""
        shorts = [r for r in running if not r.long] + [c for c in starting if not c.long]
        if any(r.long and r.cost.prefilling for r in running) or any(c.long for c in starting):
            return ()
        grown = sorted((r for r in running if not r.long and not r.cost.prefilling),
                       key=lambda r: -r.cost.length)  # fmt: skip
        long = [r for r in grown if r.cost.length > long_tokens]
        if long and (len(long) < len(shorts) or for_memory or any(r.long for r in running)):
            return self._moving(running, starting, long)
        if grown and for_memory:
            costs = [r.cost for r in running] + starting
            moved = self._moving(running, starting, grown[:1])
            after = [_moved(r).cost if r.key in moved else r.cost for r in running] + starting
            if moved and self.planner.need(after) < self.planner.need(costs):
                return moved
        return ()

    def _moving(
        self, running: Sequence[Running], starting: list[Cost], streams: list[Running]
    ) -> tuple[int, ...]:
        """The keys of `streams` (in order) that move while the batch fits with
        them in the long lane."""
        keys: list[int] = []
        for stream in streams:
            trial = {*keys, stream.key}
            moved = [_moved(r).cost if r.key in trial else r.cost for r in running] + starting
            if not self.planner.fits(moved):
                break
            keys.append(stream.key)
        return tuple(keys)

    def _admit(
        self, running: Sequence[Running], prefilling: list[Running], long_tokens: int, now: float
    ) -> tuple[list[Waiting], set[int], tuple[int, ...], tuple[Request, ...], int]:
        """Who starts now, the keys of those that go to the long lane, and the
        prefix-cache entries that leave once copied."""
        costs = [r.cost for r in running]
        slots = min(self.batch_size, self._running_cap or self.batch_size) - len(costs)
        if slots <= 0:
            return [], set(), (), (), 0
        rows = self.prefill_rows - sum(not r.long for r in prefilling)  # the short lane's
        longs = sum(r.long for r in prefilling)
        # A long prompt whose last chunk ran has its first token sampled at the
        # next step; until then it counts as prefilling, and none starts beside it.
        finishing = any(r.long and not r.remaining for r in prefilling)
        # Prompt tokens the short prompts being prefilled have still to go.
        together = sum(r.remaining for r in prefilling if not r.long)
        # How many tokens each short prompt being prefilled has left.
        left = {r.remaining for r in prefilling if not r.long and r.remaining}
        admitted: list[Waiting] = []
        to_long: set[int] = set()
        refused: list[Request] = []
        too_big: list[Cost] = []  # what did not fit: anything at least as big waits too
        for_memory = 0
        pinned: dict[int, int] = {}  # prefix-cache entries the admitted reuse: their bytes
        released: set[int] = set()  # entries that leave once the admitted have copied them
        wanted = self._room.wanted()  # entries the waiting reuse: how many reuse each
        for waiting in self._room.ranked(long_tokens, now):
            if slots <= 0:
                break
            if not self.planner.fits([cost(waiting.request)]):  # not even alone, from scratch
                refused.append(self._room.take(waiting).request)
                continue
            if self._room.fetching(waiting, now):
                continue
            self._room.refresh(waiting)
            long = waiting.prefill > long_tokens or (
                # Little to prefill, as a long history resent from the cache: in the
                # short lane it would pad every chat's row to its length.
                len(waiting.request.spec.prompt) > long_tokens
                and longs < LONG_PREFILLS_AT_ONCE
                and not finishing
            )
            new = waiting.cost(long)
            entry = waiting.reuse.entry
            # The entry it reuses stays through this turn beside its copy in the batch.
            pins = {**pinned, entry: waiting.reuse.nbytes} if entry is not None else pinned
            if long and (longs >= LONG_PREFILLS_AT_ONCE or finishing):
                continue  # its turn comes when the long prompt prefilling is done
            aged = now - waiting.arrived >= AGING_SECONDS
            # No prompt row free, or, prefilled beside the short prompts, it would
            # make one long prompt's worth of padded rows, or be padded where
            # the model must not be: it starts when they are done.
            unequal = self.equal_lengths and left and waiting.prefill - 1 not in left
            if not long and (
                rows <= 0 or unequal or (together and together + waiting.prefill > long_tokens)
            ):
                if aged:
                    break
                continue
            fits = self.planner.fits([*costs, new], sum(pins.values()))
            # Without room for the entry beside it, its row's copy is all it
            # needs of the entry, which leaves the cache then; unless others
            # waiting reuse it too (each would prefill it again) and rows
            # running will free the room: it waits with them.
            release = (
                not fits and entry is not None and entry not in pinned
                and (wanted[entry] <= 1 or not costs)
            )  # fmt: skip
            if release:
                fits, pins = self.planner.fits([*costs, new], sum(pinned.values())), pinned
            if any(_at_least(new, c) for c in too_big) or not fits:
                for_memory += 1
                too_big.append(new)
                if aged:
                    if not waiting.held_back:
                        waiting.held_back = True
                        log.warning(
                            "request %r has waited %.0fs for memory beside %s; it starts "
                            "before any younger one", waiting.request.request_id,
                            now - waiting.arrived, counted(len(running), "running request"),
                        )  # fmt: skip
                    break  # it holds its place: nothing younger starts before it
                continue
            costs.append(new)
            pinned = pins
            if entry is not None:
                wanted[entry] -= 1
            if release:
                released.add(entry)
            admitted.append(self._room.take(waiting))
            slots -= 1
            longs += long
            rows -= not long
            together += 0 if long else waiting.prefill
            if not long and waiting.prefill > 1:
                left.add(waiting.prefill - 1)
            if long:
                to_long.add(waiting.request.key)
                log.info(
                    "request %r: a long prompt starts (%d of %d tokens to prefill) after "
                    "%.1fs; waiting: %s",
                    waiting.request.request_id, waiting.prefill,
                    len(waiting.request.spec.prompt), now - waiting.arrived,
                    counted(len(self._room), "request"),
                )  # fmt: skip
        return admitted, to_long, tuple(released), tuple(refused), for_memory


def _at_least(a: Cost, b: Cost) -> bool:
    """Whether `a` costs the budget at least what `b` does, beside any batch."""
    return a.long == b.long and a.total >= b.total and a.prefill >= b.prefill and (
        a.prompt >= b.prompt
    )


def _moved(r: Running) -> Running:
    """A decoding sequence as it is once moved to the long lane: its tokens
    the prompt of a request put in again, its last one still to process."""
    cost = Cost(r.cost.length + 1, r.cost.total, 1, True)
    return Running(cost, 0, r.cost.length, r.key)
