"""The engine loop: drain the inbox, decide, apply, report. One thread runs it and owns MLX.

`EngineCore.run()` loads the model and warms it up (`engine.start_up`), then
turns the loop until the inbox says stop or a step fails. It knows nothing of
gRPC or asyncio: the worker runs it behind its gRPC front door, and anything
else (a test, a follower rank) can run it with an `Inbox` and a `Sink` of its
own.

Each turn reads: take what arrived, ask the policy, step, report, then keep
what the requests that ended leave for the prefix cache. Deciding
(aborts, which waiting requests start, the prefill chunk, which prompt-cache
entries go, whether to stop) is rank 0's alone, and the policy itself lives
in `engine.schedule`; applying a turn to the batch is every rank's. With one
rank the two simply follow each other; with several (a model split over
machines, `engine.ranks.lockstep`) rank 0 shares each decided turn before all apply
it, so no follower ever decides anything.

With one rank, a step that fails does not end the engine: one that ran out
of memory despite the budget puts the batch back in the waiting room; any
other error ends that step's requests with an error and the batch starts
over. Only steps failing MAX_FAILED_STEPS_IN_A_ROW times in a row end it;
one that ran out of memory with several requests does not count: each such
step sheds load (fewer run after it than ran in it), so they end with a
request running alone.
With several ranks any failed step ends it: the ranks' batches could differ.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from smg_mlx.config import EngineConfig
from smg_mlx.engine import failures, start_up
from smg_mlx.engine.handoff import Inbox, Sink, TurnTimes
from smg_mlx.engine.memory.planner import is_out_of_memory
from smg_mlx.engine.schedule.bursts import WINDOWS_AT_MOST, BurstGatherer
from smg_mlx.engine.schedule.scheduler import Plan, Scheduler
from smg_mlx.engine.schedule.step_plan import Passes
from smg_mlx.engine.types import (
    CacheStats,
    Event,
    Memory,
    Request,
    SpeculationStats,
    StepReport,
    Turn,
    Unservable,
)
from smg_mlx.logs import error_line, one_line

if TYPE_CHECKING:
    from smg_mlx.engine.batch.batch import Batch
    from smg_mlx.engine.ranks.lockstep import Channel

log = logging.getLogger(__name__)

# Failed steps in a row (each contained: its batch put back or its requests
# ended) before the engine gives up: past that, the fault is not a step's.
MAX_FAILED_STEPS_IN_A_ROW = 3
# How often a loop with nothing to run looks again at requests waiting for
# their prefix to be read from disk (a finished read wakes it sooner).
READ_WAIT_SECONDS = 0.05
# An engine that has had nothing to do for SHAPES_QUIET_SECONDS builds the
# attention shapes prompts will meet (engine.batch.attention_shapes), for
# SHAPES_SECONDS at a time between looks at the inbox: a request arriving
# meanwhile waits at most about as long; one arriving between two of a
# client's requests never does.
SHAPES_QUIET_SECONDS = 0.5
SHAPES_SECONDS = 0.05
# A prompt still prefilling after this long logs how far it has come, and again
# as often: a long context on a small machine takes minutes.
PROGRESS_SECONDS = 10.0
# A turn that changed nothing reports the memory and prefix-cache figures of up
# to this long ago: reading them walks every layer's cache, on the engine
# thread, between two steps (metrics and GetServerInfo want them, not each step).
FIGURES_SECONDS = 0.25


class EngineCore:
    def __init__(
        self, config: EngineConfig, inbox: Inbox, sink: Sink, turns: TurnTimes | None = None
    ) -> None:
        """`turns`: where the loop marks its turns, for a watchdog elsewhere to read."""
        self.config = config
        self.inbox = inbox
        self.sink = sink
        self.turns = turns or TurnTimes()
        self._out_of_memory_steps = 0  # steps that ran out of memory, all told
        self._failed_steps = 0  # steps that failed otherwise, all told
        self._plan = Plan()  # the last turn's
        self._turn: Turn | None = None  # the last turn, while nothing has changed since
        # The last report's memory, prefix-cache and speculation figures, and when taken.
        self._figures: tuple[Memory, CacheStats, SpeculationStats] | None = None
        self._figures_at = 0.0
        self._counts = (0, 0, 0)  # running, prefilling, waiting when they were taken

    def run(self) -> None:
        """Serve until stopped or failed; returns once the batch is released."""
        try:
            # MLX is first imported there, on the thread that will own it.
            batch, scheduler, channel = start_up.start(self.config, self.inbox.wake)
        except BaseException as exc:  # noqa: BLE001 - reported; the caller decides what to do
            if isinstance(exc, (SystemExit, KeyboardInterrupt)):
                raise  # a signal to a rank that runs this on its main thread: it stops
            # The cause is the operator's to fix (the model, a flag): one line says
            # it; the traceback is for --log-level debug.
            log.debug("engine failed to start", exc_info=True)
            if isinstance(exc, Unservable):
                self.sink.failed(one_line(exc), permanent=True)
            else:
                said = error_line(exc)
                adapter = self.config.adapter_path
                if "[load_safetensors]" in said:  # (a restart reads it again: exit 1)
                    said += (
                        " (the adapter's weights file cannot be read: write or copy it again)"
                        if adapter is not None and str(adapter) in said
                        else " (a weights file that cannot be read: download the model again)"
                    )
                self.sink.failed(f"model load failed: {said}")
            return
        ranks = channel.size if channel is not None else 1
        try:
            self.sink.started(
                self._memory(batch, scheduler), ranks, batch.mode.value, _cache_stats(batch),
                batch.speculation,
            )
            if channel is not None and channel.rank > 0:
                self._follow(batch, channel)
            else:
                self._lead(batch, scheduler, channel)
        except BaseException as exc:  # noqa: BLE001 - reported; every request learns of it
            log.exception("engine failed")
            self.sink.failed(f"engine failure: {exc!r}; the worker must be restarted")
            batch.close()
        else:
            self.sink.stopped()
            # The prefix cache writes behind as it goes: little is left to flush.
            batch.close(self.inbox.flush_until)
        # Released on this thread: MLX objects outliving their thread can abort
        # the process at exit.

    # ---- rank 0 (or the only rank) ----

    @staticmethod
    def _progress(batch: Batch, due: float | None) -> float | None:
        """Log how far the prompts prefilling have come, if it is `due`; when
        to next (None while none prefills: a prefill is timed from its start,
        not from the last line before the worker went idle)."""
        if not batch.prefilling:
            return None
        now = time.monotonic()
        if due is None:
            return now + PROGRESS_SECONDS
        if now < due:
            return due
        for request_id, done, total in batch.prefills():
            log.info("request %r: %d of %d prompt tokens prefilled", request_id, done, total)
        return now + PROGRESS_SECONDS

    def _lead(self, batch: Batch, scheduler: Scheduler, channel: Channel | None) -> None:
        inbox, sink, turns = self.inbox, self.sink, self.turns
        turns.may_take(batch.slowest_step)
        window = self.config.burst_window_seconds
        watchdog = None
        if channel is not None:
            from smg_mlx.engine.ranks import lockstep

            watchdog = lockstep.Watchdog(self._peer_hung, batch.slowest_step)
            # Followers must hear from an idle rank 0 well before they give it up.
            window = min(window, lockstep.HEARTBEAT_SECONDS / WINDOWS_AT_MOST)
        bursts = BurstGatherer(window, batch.prefill_rows)
        failures = 0  # failed steps since the last good one
        sent: list[Event] = []  # the step's short-lane events, sent before its long lane ran
        progress_at: float | None = None  # the next prefill progress line

        def early(short: list[Event]) -> None:
            sent.extend(short)
            sink.step(self._report(batch, scheduler, short))

        settle = False  # the last turn ended requests and left the batch idle
        kept = False  # the last turn kept ended requests' caches after its report
        building = False  # the last idle turn built attention shapes, nothing having come
        quiet_since: float | None = None  # when the batch went idle, nothing having come since
        idle_turns = 0  # turns in a row that paused the other ranks
        reported_waits = 0  # requests waiting for memory, as last reported
        try:
            while True:
                turns.next()
                # A settling turn plans without taking what arrived: the requests
                # that ended left their entries after the last turn planned, and it
                # holds the cache to what memory and its cap allow. What arrives
                # meanwhile is the burst of their replacements, gathered below.
                # A running batch leaves the first of such a burst in the inbox
                # until the rest have come (BurstGatherer.holds), stepping on.
                hold = batch.size > 0 and bursts.holds(inbox.pending())
                requests, aborts = ([], set()) if settle else inbox.take(hold)
                if requests:
                    bursts.taken()
                tended = batch.tend_prefixes()
                turn, events = self._decide(batch, scheduler, requests, aborts)
                turns.started(turn.expected_seconds)
                if watchdog is not None:
                    watchdog.turn_started(turn.expected_seconds)
                    turn = channel.share(_paused(turn, batch, scheduler, idle_turns))
                    idle_turns = idle_turns + 1 if turn.pause else 0
                events += self._change(batch, turn)
                if turn.chunk is not None:
                    sink.stepping(turn.expected_seconds)
                passes = None
                sent.clear()
                try:
                    stepped, passes, rows, finished = self._step(batch, turn, early)
                except Exception as exc:
                    # (out of memory with several requests: load is shed, each such step
                    # running fewer than the last, `Scheduler.shed`)
                    failures += not (is_out_of_memory(exc) and batch.size > 1)
                    if channel is not None or failures >= MAX_FAILED_STEPS_IN_A_ROW:
                        raise
                    self._turn = None
                    stepped, rows, finished = self._contain(batch, scheduler, exc), 0, 0
                else:
                    stepped = stepped[len(sent) :]  # the rest went out early
                    if passes is not None:
                        failures = 0
                        scheduler.observe(passes, rows)
                if watchdog is not None:
                    watchdog.turn_ended()
                if finished:
                    bursts.ended(finished)
                    self._turn = None
                events += stepped
                seconds = passes.seconds if passes is not None else None
                idle = not batch.size and not scheduler
                # A turn reports what it changed, and who waits for memory when that changed.
                waits = self._plan.waiting_for_memory
                changed = (
                    turn.admit or turn.drop_cached or tended or kept or waits != reported_waits
                )
                if events or seconds is not None or changed:
                    reported_waits = waits
                    steady = not (changed or finished or idle or passes is None)
                    sink.step(
                        self._report(
                            batch, scheduler, events, seconds, rows, turn.admit, idle, steady
                        )
                    )
                kept = batch.keep_ended()  # what ended requests leave, once their ends are out
                if turn.stop:
                    return
                progress_at = self._progress(batch, progress_at)
                settle = idle and bool(finished or turn.remove)
                building = building and idle
                quiet_since = quiet_since if idle else None
                if settle:
                    continue
                if idle:
                    # With followers, an idle rank 0 turns again after the pause
                    # they sleep through (lockstep), or when work comes. It
                    # also wakes for the prefix cache's writes to disk, and builds
                    # attention shapes once nothing has come for a while.
                    now = time.monotonic()
                    quiet_since = now if quiet_since is None else quiet_since
                    due = [turn.pause or lockstep.IDLE_TURN_SECONDS] if watchdog is not None else []
                    due += [t for t in (batch.prefixes_due(),) if t is not None]
                    shapes = batch.shapes_queued
                    quiet_until = quiet_since + SHAPES_QUIET_SECONDS
                    due += [0.0 if building else quiet_until - now] if shapes else []
                    turns.ended()
                    came = inbox.wait(min(due, default=None))
                    building = not came and shapes and time.monotonic() >= quiet_until
                    quiet_since = None if came else quiet_since
                    if building:  # quiet since: on with the next few
                        turns.started(SHAPES_SECONDS)
                        batch.build_shapes(SHAPES_SECONDS)
                    elif came:
                        bursts.gather(inbox)
                elif not batch.size and not turn.admit and not batch.prefixes_busy:
                    turns.ended()
                    inbox.wait(READ_WAIT_SECONDS)  # requests wait for reads from disk
        finally:
            turns.ended()
            if watchdog is not None:
                watchdog.close()

    def _report(
        self,
        batch: Batch,
        scheduler: Scheduler,
        events: list[Event],
        seconds: float | None = None,
        rows: int = 0,
        admitted: tuple[Request, ...] = (),
        idle: bool = False,
        steady: bool = False,
    ) -> StepReport:
        """What a turn sends its requests, and the batch as it stands (`steady`:
        the turn changed nothing but its rows' tokens; where the rows running,
        prefilling and waiting are as many as before too, its figures may be
        FIGURES_SECONDS old)."""
        counts = (batch.running, batch.prefilling, batch.waiting + len(scheduler))
        now = time.monotonic()
        if (
            not steady
            or counts != self._counts
            or self._figures is None
            or now - self._figures_at >= FIGURES_SECONDS
        ):
            self._figures = (self._memory(batch, scheduler), _cache_stats(batch), batch.speculation)
            self._figures_at, self._counts = now, counts
        memory, cache, speculation = self._figures
        running, prefilling, waiting = counts
        return StepReport(
            events=tuple(events),
            step_seconds=seconds,
            batch_size=rows,
            running=running,
            prefilling=prefilling,
            waiting=waiting,
            admitted=tuple(r.key for r in admitted),
            memory=memory,
            idle=idle,
            cache=cache,
            speculation=speculation,
        )

    def _peer_hung(self, limit: float) -> None:
        """From the watchdog's thread: the engine thread is stuck in a collective."""
        self.sink.failed(
            f"a rank did not answer within {limit:.0f}s (hung or unreachable); the worker "
            "must be restarted with all its ranks"
        )

    def _decide(
        self, batch: Batch, scheduler: Scheduler, requests: list[Request], aborts: set[int]
    ) -> tuple[Turn, list[Event]]:
        """This turn's changes to the batch, and events for requests that end
        without reaching it (aborted or too big while waiting)."""
        events: list[Event] = []
        scheduler.add(requests)
        remove: tuple[int, ...] = ()
        if aborts:
            gone = [r.key for r in scheduler.remove(aborts)]
            batch.forget_resumed(gone)
            events += [Event(key, finish_reason="abort") for key in gone]
            remove = tuple(k for k in aborts if batch.holds(k))
        if self.inbox.stopping:
            return Turn(batch.size, remove, stop=True), events
        if self._turn is not None and not requests and not aborts and not len(scheduler):
            # Nothing arrived, left or prefills since a turn that changed
            # nothing: planning again would decide the same.
            return self._turn, events
        plan = self._plan = scheduler.schedule(
            batch.sequences(excluding=remove), batch.prefix_cache_bytes
        )
        batch.forget_resumed([r.key for r in plan.refuse])
        events += [failures.too_big(r, scheduler.planner) for r in plan.refuse]
        drop, _ = batch.cached_over(plan.prefix_allowance, plan.keep, plan.wanted)
        if batch.prefixes is not None:
            batch.prefixes.room = plan.prefix_allowance
        turn = Turn(
            batch.size,
            remove,
            tuple(drop),
            plan.admit,
            plan.long,
            plan.chunk,
            plan.long_chunks,
            plan.expected_seconds,
            move=plan.move,
            release=plan.release,
            spare_bytes=plan.spare_bytes,
        )
        changes = remove or drop or plan.admit or plan.refuse or plan.move
        steady = not changes and not batch.prefilling and not batch.waiting
        self._turn = turn if steady else None
        return turn, events

    def _contain(self, batch: Batch, scheduler: Scheduler, exc: Exception) -> list[Event]:
        """A step failed: counted, and contained (`engine.failures`)."""
        if is_out_of_memory(exc):
            self._out_of_memory_steps += 1
            return failures.put_back(batch, scheduler, exc)
        self._failed_steps += 1
        return failures.end_batch(batch, exc)

    def _memory(self, batch: Batch, scheduler: Scheduler) -> Memory:
        planner = scheduler.planner
        active, peak = batch.memory_in_use
        return Memory(
            budget=planner.budget,
            weights=planner.model.weights,
            kv=batch.kv_bytes,
            kv_per_token=planner.model.kv_per_token,
            prefill=int(self._plan.prefill_bytes),
            prefix_cache=batch.prefix_cache_bytes,
            active=active,
            peak=peak,
            longest_sequence=planner.longest_sequence,
            waiting_for_memory=self._plan.waiting_for_memory,
            out_of_memory_steps=self._out_of_memory_steps,
            failed_steps=self._failed_steps,
        )

    # ---- every rank ----

    @staticmethod
    def _change(batch: Batch, turn: Turn) -> list[Event]:
        """Apply a turn's changes to the batch (before its step): abort events
        and requests that could not start."""
        if batch.size != turn.size:
            raise RuntimeError(
                f"this rank's batch holds {batch.size} requests and rank 0's {turn.size}"
            )
        # Drops first: they name entries as they were when rank 0 decided.
        batch.drop_cached(turn.drop_cached)
        events = batch.remove(turn.remove)
        events += batch.move(turn.move)
        events += batch.admit(list(turn.admit), turn.long)
        batch.drop_cached(turn.release)
        return events

    @staticmethod
    def _step(
        batch: Batch, turn: Turn, early: Callable[[list[Event]], None] | None = None
    ) -> tuple[list[Event], Passes | None, int, int]:
        """Run a turn's step: its events, what its passes over the model took
        (None: no step), the sequences it ran on, and how many finished
        (`early`: see `Batch.step`)."""
        if turn.chunk is None:
            return [], None, 0, 0
        stepped, passes = batch.step(turn.chunk, turn.long_chunks, early, turn.spare_bytes)
        finished = sum(e.finish_reason is not None for e in stepped)
        return stepped, passes, batch.running + finished, finished

    # ---- the other ranks ----

    def _follow(self, batch: Batch, channel: Channel) -> None:
        """Apply rank 0's turns until it says stop."""
        from smg_mlx.engine.ranks import lockstep

        def rank_0_hung(limit: float) -> None:
            log.error("rank 0 sent nothing for %.0fs: it is gone, hung or unreachable; exiting",
                      limit)  # fmt: skip
            os._exit(1)  # the engine thread is stuck in a collective: nothing else ends it

        watchdog = lockstep.Watchdog(rank_0_hung, batch.slowest_step)
        try:
            while True:
                watchdog.turn_started()
                turn = channel.share()
                watchdog.turn_started(turn.expected_seconds)  # now that it is known
                self._change(batch, turn)
                self._step(batch, turn)
                batch.keep_ended()  # as rank 0 does, in the same order
                watchdog.turn_ended()
                if turn.stop:
                    return
                if turn.pause:  # rank 0 turns again no sooner, unless work comes
                    time.sleep(turn.pause)
        finally:
            watchdog.close()


def _paused(turn: Turn, batch: Batch, scheduler: Scheduler, idle_turns: int) -> Turn:
    """`turn`, with the other ranks' pause (`lockstep.pause`) where rank 0 will
    wait for work after it: nothing running, joining, leaving or waiting."""
    idle = not (batch.size or turn.admit or turn.remove or turn.chunk is not None or scheduler)
    if not idle:
        return turn
    from smg_mlx.engine.ranks import lockstep

    return replace(turn, pause=lockstep.pause(idle_turns))


def _cache_stats(batch: Batch) -> CacheStats:
    """The prefix cache's figures (all zero where it is off)."""
    return batch.prefixes.stats() if batch.prefixes is not None else CacheStats()
