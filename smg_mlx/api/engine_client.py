"""The event loop's handle on the engine: its thread, its inbox, and the jobs it serves."""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable

from smg_mlx.api.engine_process import EngineProcess
from smg_mlx.api.jobs import Job
from smg_mlx.api.streaming import MAX_CHUNK_SECONDS, StreamPublisher, poster
from smg_mlx.config import EngineConfig
from smg_mlx.engine.core import EngineCore
from smg_mlx.engine.handoff import Inbox, TurnTimes
from smg_mlx.engine.types import CacheStats, Failure, Memory, SpeculationStats, StepReport

UNSTARTED_AT_STOP = (
    "the worker is shutting down and this request had no token yet: send it to another worker"
)
log = logging.getLogger(__name__)

# How often the watchdog looks at the engine's turns (`EngineClient._watch`).
WATCH_SECONDS = 0.5


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineUnavailable(RuntimeError):
    """The engine cannot take work (not ready, failed, or stopping);
    `permanent`: it never will with this model."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class EngineClient:
    """Runs an `EngineCore` on a thread of its own and serves its jobs.

    Every method but `join` (which blocks) runs on the event loop: the engine
    thread's reports reach `started`, `deliver`, `stopped` and `failed`
    through the loop (`api.streaming.StreamPublisher`), never directly.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stream_interval: int,
        own_process: bool = False,
        watchdog_seconds: float = 0.0,
    ) -> None:
        """`own_process`: the engine runs on the main thread of a child process,
        spawned now (`engine_process`), not on a thread of this one.
        `watchdog_seconds`: once serving, an engine stuck in a turn for longer
        than that, or three times its slowest (`TurnTimes.overdue`), fails (0: never)."""
        self.state = EngineState.STARTING
        self.failure: str | None = None
        # As of the last report: sequences being prefilled or decoded, of those
        # being prefilled, requests not started, the memory budget's state, and
        # tokens per stream message.
        self.running = 0
        self.prefilling = 0
        self.waiting = 0
        self.memory: Memory | None = None
        self.cache = CacheStats()  # the prefix cache's tiers
        self.speculation = SpeculationStats()
        self.ranks = 1  # processes serving the model together
        # How requests are batched (engine.batch.batch_check); "loading" until started.
        self.mode = "loading"
        self.tokens_per_message = stream_interval
        self.each_alone = stream_interval == 1  # every token in a message of its own
        self._jobs: dict[int, Job] = {}
        self._loop = loop
        self._stream_interval = stream_interval
        self._stopping = False
        self._ready: asyncio.Future[None] = loop.create_future()
        self._failure_listeners: list[Callable[[str], None]] = []
        self._step_listeners: list[Callable[[list[float], list[int]], None]] = []
        self._watchdog_seconds = watchdog_seconds
        self._turns = TurnTimes()
        self._inbox: Inbox | EngineProcess = (
            EngineProcess(loop, self, stream_interval, self._turns) if own_process else Inbox()
        )
        # What runs the engine: its process from now on, or the thread `start` makes.
        self._runner: threading.Thread | EngineProcess | None = self._inbox if own_process else None

    def start(self, config: EngineConfig) -> None:
        """Load `config`'s model on a new engine thread (or in the engine's
        process), which then serves. (The model is known only once the worker
        is listening: it may be downloaded.)"""
        if isinstance(self._inbox, EngineProcess):
            self._inbox.start(config)
            return
        publisher = StreamPublisher(poster(self._loop), self, self._stream_interval)
        core = EngineCore(config, self._inbox, publisher, self._turns)
        self._runner = threading.Thread(target=core.run, name="mlx-engine", daemon=True)
        self._runner.start()

    async def wait_ready(self) -> None:
        """Returns once the model is loaded and warmed up; raises if loading failed."""
        await asyncio.shield(self._ready)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        self._failure_listeners.append(listener)

    def on_step(self, listener: Callable[[list[float], list[int]], None]) -> None:
        """Call `listener(step_seconds, batch_sizes)` with the model steps of each
        hand-over from the engine."""
        self._step_listeners.append(listener)

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise EngineUnavailable(UNSTARTED_AT_STOP)
        if self.state is not EngineState.READY:
            raise EngineUnavailable(self.failure or f"the engine is {self.state.value}")
        self._jobs[job.key] = job
        self._inbox.submit(job.request())

    def abort(self, jobs: Iterable[Job]) -> None:
        self._inbox.abort(job.key for job in jobs)

    def abandon(self, job: Job) -> None:
        """The client of `job` left before it ended: aborted, and no longer
        counted among the requests a stop turns away or aborts."""
        self.abort([job])
        self._jobs.pop(job.key, None)

    def abort_all(self) -> None:
        """At a stop, past its grace: every job the engine holds is aborted and
        ends now, not at the engine's next step, which a long prompt's chunk on
        a slow machine may hold for seconds. One with tokens ends with
        finish_reason "abort"; one without, with an error another worker may
        take it from (UNAVAILABLE: the router retries it)."""
        self.abort(self._jobs.values())
        for job in self._jobs.values():
            if job.tokens:
                job.end(finish_reason="abort")
            else:
                _turn_away(job)
        self._jobs.clear()

    def refuse_waiting(self) -> int:
        """At a stop: the jobs not yet in the batch end now, as `abort_all`
        ends those without a token, rather than wait out the grace for a
        place they might never get (the router retries them on another
        worker at once), and so do jobs submitted after it. Returns how many."""
        self._stopping = True
        waiting = [job for job in self._jobs.values() if job.started_at is None]
        self.abort(waiting)
        for job in waiting:
            _turn_away(job)
            del self._jobs[job.key]
        return len(waiting)

    def stop(self, flush_seconds: float = 0.0) -> None:
        """Ask the engine to end, its prefix cache writing to disk for at most
        `flush_seconds`; jobs it still holds end with finish_reason "abort"."""
        self._stopping = True
        self._inbox.stop(flush_seconds)

    def hurry(self) -> None:
        """At a stop, end the prefix cache's writes to disk now."""
        self._inbox.hurry()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread (or process) to end (call off the loop);
        True if it has."""
        if self._runner is None:  # never started
            return True
        self._runner.join(timeout)
        return not self._runner.is_alive()

    def kill(self) -> None:
        """End the engine's process at once (a thread cannot be: it ends with this process)."""
        if isinstance(self._runner, EngineProcess):
            self._runner.process.kill()

    # ---- the engine's reports, on the loop ----

    @property
    def longest_sequence(self) -> int:
        """The most tokens (prompt and output) one request may have in memory."""
        return self.memory.longest_sequence if self.memory else 0

    @property
    def kv_per_token(self) -> float:
        """What one token's keys and values take as stored, in bytes."""
        return self.memory.kv_per_token if self.memory else 0.0

    def started(self, memory: Memory, ranks: int, mode: str, cache: CacheStats,
                speculation: SpeculationStats) -> None:  # fmt: skip
        self.memory = memory
        self.cache = cache
        self.speculation = speculation
        self.ranks = ranks
        self.mode = mode
        self.state = EngineState.READY
        if not self._ready.done():
            self._ready.set_result(None)
        if self._watchdog_seconds > 0:
            limit = self._turns.limit(self._watchdog_seconds)
            log.info(
                "watchdog: a step running past %.3gs counts as the engine stuck "
                "(--watchdog-seconds %g%s)", limit, self._watchdog_seconds,
                "" if limit <= self._watchdog_seconds
                else "; three times the slowest step expected, a full prefill chunk, is longer",
            )  # fmt: skip
            self._loop.call_later(WATCH_SECONDS, self._watch)

    def _watch(self) -> None:
        """Fail an engine stuck in a turn, or one that has not taken up a request
        handed over (`TurnTimes.overdue`): its requests would wait forever, and
        health would go on saying SERVING. Its process is ended first (its
        memory freed for the worker's restart)."""
        if self._ended:
            return
        handed_over = min((j.arrived_at for j in self._jobs.values() if j.started_at is None),
                          default=None)  # fmt: skip
        overdue = self._turns.overdue(self._watchdog_seconds, handed_over)
        if overdue is None:
            self._loop.call_later(WATCH_SECONDS, self._watch)
            return
        self.kill()
        what = "one step has run" if overdue.turn else "a request handed to it has waited"
        self.failed(
            f"the engine is stuck: {what} {overdue.seconds:.0f}s, past its limit of "
            f"{overdue.limit:.0f}s (--watchdog-seconds {self._watchdog_seconds:g}, or three "
            "times its slowest step)"
        )

    @property
    def _ended(self) -> bool:
        # A watchdog's failure can come before the engine thread's last reports.
        return self.state in (EngineState.FAILED, EngineState.STOPPED)

    def deliver(self, reports: list[StepReport], per_message: int, cadence: bool) -> None:
        if self._ended:
            return
        # Steps so slow that each token goes alone (a long prompt's chunk): a
        # stream asleep for a larger chunk sends what it holds now. Smaller
        # changes follow the steps' jitter: not worth more messages.
        if per_message == 1 < self.tokens_per_message:
            for job in self._jobs.values():
                job.pace(per_message)
        self.tokens_per_message = per_message
        now = time.monotonic()
        for key in (key for report in reports for key in report.admitted):
            job = self._jobs.get(key)
            if job is not None:
                job.started_at = now
        for event in (event for report in reports for event in report.events):
            job = self._jobs.get(event.key)
            if job is not None:
                job.apply(event, now)
                if event.ends:
                    del self._jobs[event.key]
        stepped = [r for r in reports if r.step_seconds is not None]
        if cadence and stepped:
            # A stream that would hold its oldest token past MAX_CHUNK_SECONDS
            # by waiting for its chunk (the next hand-off of the cadence) sends it now.
            step = stepped[-1].step_seconds
            for job in self._jobs.values():
                if (len(job.tokens) - job.streamed + per_message) * step > MAX_CHUNK_SECONDS:
                    job.hurry()
        if stepped:
            seconds = [r.step_seconds for r in stepped]
            sizes = [r.batch_size for r in stepped]
            for listener in self._step_listeners:
                listener(seconds, sizes)
        self.running = reports[-1].running
        self.prefilling = reports[-1].prefilling
        self.waiting = reports[-1].waiting
        self.memory = reports[-1].memory
        self.cache = reports[-1].cache
        self.speculation = reports[-1].speculation

    def stopped(self) -> None:
        if self._ended:
            return
        self.state = EngineState.STOPPED
        self._end_all(finish_reason="abort")

    def failed(self, message: str, permanent: bool = False) -> None:
        if self._ended:
            return
        self.state = EngineState.FAILED
        self.failure = message
        if not self._ready.done():
            self._ready.set_exception(EngineUnavailable(message, permanent))
        self._end_all(error=message, retry_elsewhere=True)
        for listener in self._failure_listeners:
            listener(message)

    def _end_all(self, **how: str | bool) -> None:
        for job in self._jobs.values():
            job.end(**how)
        self._jobs.clear()


def _turn_away(job: Job) -> None:
    """End a job that had no token at a stop, for another worker to serve."""
    job.end(error=UNSTARTED_AT_STOP, retry_elsewhere=True, failure=Failure.STOPPING)
