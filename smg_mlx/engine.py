"""The engine thread and its hand-off to the asyncio side.

One thread owns MLX: it loads the model, runs every BatchGenerator call, and
is the only one that touches MLX arrays (MLX keeps per-stream state
thread-local). This module is imported by the asyncio side and must not import
mlx: the MLX work lives in `engine_loop`, imported on the engine thread.

Hand-offs, all lock-light:
- requests in: a deque plus a wake-up event (the thread sleeps when idle, and
  on waking gathers a burst for a moment, see `Engine._gather_burst`);
- aborts in: a set of job keys the thread drains each step;
- tokens out: one `call_soon_threadsafe` per step carrying every request's
  new tokens, which lands in each Job and wakes its RPC handler.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smg_mlx.config import EngineConfig
from smg_mlx.request_translation import GenerationSpec

if TYPE_CHECKING:
    from smg_mlx.engine_loop import BatchLoop

log = logging.getLogger(__name__)

_keys = itertools.count(1)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the top alternatives at one step."""

    logprob: float
    top_ids: tuple[int, ...]
    top_values: tuple[float, ...]


@dataclass(slots=True)
class Event:
    """What one engine step produced for one job."""

    job: Job
    token: int | None = None  # None for aborts and failures
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    first: bool = False  # the job's first token


@dataclass(eq=False)
class Job:
    """One request in flight. Written only on the event loop (by `Event`s)."""

    request_id: str
    spec: GenerationSpec
    key: int = field(default_factory=lambda: next(_keys))
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set `changed` once this many tokens are here (or the job ends): a handler
    # that waits for a group of tokens is not woken for each one.
    wake_at: int = 1
    # Event-loop clock readings, for TTFT, inter-token latency and duration.
    arrived_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    token_gaps: list[float] = field(default_factory=list)
    ended_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def apply(self, event: Event, now: float) -> None:
        if self.done:  # e.g. an abort racing a natural finish
            return
        if event.token is not None:
            self.tokens.append(event.token)
            self.cached_tokens = event.cached_tokens
            if self.first_token_at is None:
                self.first_token_at = now
            else:
                self.token_gaps.append(now - self.last_token_at)
            self.last_token_at = now
            if event.logprobs is not None:
                self.logprobs.append(event.logprobs)
        self.finish_reason = event.finish_reason
        self.error = event.error
        if self.done or len(self.tokens) >= self.wake_at:
            self.changed.set()


# Every stream message costs the event loop (gRPC, in this process, under the
# GIL) time the engine thread then waits for, and the client as much again:
# on a 2-core VM, 16 streams made 0.72 of the bare engine's tokens/s with a
# message per 2 tokens (~2000 messages/s) and 0.87 with one per 16 (~270/s).
# So the worker keeps to about this many stream messages per second in all...
MESSAGES_PER_SECOND = 300
# ...but a token never waits for more than about this long.
MAX_CHUNK_SECONDS = 0.1


def chunk_tokens(minimum: int, running: int, step_seconds: float) -> int:
    """Tokens per stream message: `minimum` (--stream-interval) at light load,
    growing so that `running` streams send about MESSAGES_PER_SECOND messages
    in all, capped at MAX_CHUNK_SECONDS of steps. A minimum of 1 asks for every
    token alone, at any load."""
    if minimum == 1 or step_seconds <= 0:
        return minimum
    by_budget = math.ceil(running / (MESSAGES_PER_SECOND * step_seconds))
    by_time = int(MAX_CHUNK_SECONDS / step_seconds)
    return max(minimum, min(by_budget, by_time))


# An idle engine gathers a burst for at most this many burst windows in all.
BURST_WINDOWS_AT_MOST = 5


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class EngineUnavailable(RuntimeError):
    """The engine cannot take work (not ready, failed, or stopping)."""


class Engine:
    """Owns the engine thread; every public method is called from the event loop."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.state = EngineState.STARTING
        self.failure: str | None = None
        # As last seen by the engine thread: sequences being prefilled or decoded,
        # and all BatchGenerator holds (queued too; equal to our jobs unless a slot leaked).
        self.running = 0
        self.generator_sequences = 0
        self.prefix_cache_bytes = 0
        # Tokens per stream message now (the engine thread adapts it to the load).
        self.chunk_tokens = config.stream_interval
        self._loop = loop
        self._inbox: deque[Job] = deque()
        self._aborts: set[int] = set()
        self._abort_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ready: asyncio.Future[None] = loop.create_future()
        self._failure_listeners: list[Callable[[str], None]] = []
        self._step_listeners: list[Callable[[float, int], None]] = []
        self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
        self._burst_reach = config.burst_window_seconds * BURST_WINDOWS_AT_MOST
        # Test hook: when set, the engine thread raises this before its next step.
        self.inject_failure: BaseException | None = None

    # ---- called on the event loop ----

    def start(self) -> None:
        self._thread.start()

    async def wait_ready(self) -> None:
        """Returns once the model is loaded and warmed up; raises if loading failed."""
        await asyncio.shield(self._ready)

    def on_failure(self, listener: Callable[[str], None]) -> None:
        self._failure_listeners.append(listener)

    def submit(self, job: Job) -> None:
        if self.state is not EngineState.READY or self._stop:
            raise EngineUnavailable(self.failure or f"the engine is {self.state.value}")
        self._inbox.append(job)
        self._wake.set()

    def abort(self, jobs: Iterable[Job]) -> None:
        with self._abort_lock:
            self._aborts.update(job.key for job in jobs)
        self._wake.set()

    def stop(self) -> None:
        """Ask the thread to end; jobs it still holds end with finish_reason "abort"."""
        self._stop = True
        self._wake.set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _set_ready(self) -> None:
        self.state = EngineState.READY
        if not self._ready.done():
            self._ready.set_result(None)

    def _set_failed(self, message: str, during_load: bool) -> None:
        self.state = EngineState.FAILED
        self.failure = message
        if during_load and not self._ready.done():
            self._ready.set_exception(EngineUnavailable(message))
        for listener in self._failure_listeners:
            listener(message)

    def _set_stopped(self) -> None:
        self.state = EngineState.STOPPED

    def on_step(self, listener: Callable[[float, int], None]) -> None:
        """Call `listener(step_seconds, batch_size)` on the event loop after each step."""
        self._step_listeners.append(listener)

    def _deliver(self, events: list[Event], steps: Iterable[tuple[float, int]] = ()) -> None:
        now = time.monotonic()
        for event in events:
            event.job.apply(event, now)
        for step in steps:
            for listener in self._step_listeners:
                listener(*step)

    # ---- the engine thread ----

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is gone: nobody is listening
            pass

    def _run(self) -> None:
        try:
            from smg_mlx.engine_loop import BatchLoop  # first MLX import, on this thread

            batch = BatchLoop(self.config)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, which exits
            log.exception("engine failed to start")
            self._post(self._set_failed, f"model load failed: {exc!r}", True)
            return
        self._post(self._set_ready)
        held: list[Job] = []
        try:
            self._serve(batch, held)
        except BaseException as exc:  # noqa: BLE001 - every job learns of it
            log.exception("engine thread failed")
            message = f"engine failure: {exc!r}; the worker must be restarted"
            jobs = held + batch.jobs() + list(self._inbox)
            self._post(self._deliver, [Event(job, error=message) for job in jobs])
            self._post(self._set_failed, message, False)
            return
        # Stopped: whatever is still here ends as aborted.
        jobs = batch.jobs() + list(self._inbox)
        self._post(self._deliver, [Event(job, finish_reason="abort") for job in jobs])
        batch.close()
        self._post(self._set_stopped)

    def _gather_burst(self, expected: int) -> None:
        """Called when the idle engine wakes up: waits while requests keep coming
        (each within the burst window of the last), until `expected` of them or a
        prefill group's worth are here, or BURST_WINDOWS_AT_MOST windows have passed.

        Requests started one or two at a time stay out of step for good: each
        group costs a prefill call and a merge into the batch, and ends in a step
        of its own; a burst started together runs, and ends, in lock-step (with
        a 5 ms window on 2 CPU cores: 0.84 -> 0.92 of the bare engine's tokens/s
        at 4 streams, 0.71 -> 0.95 at 8). A running batch never waits: requests
        join it at the next step.
        `expected`: how many jobs ended just before the engine went idle, whose
        replacements (a client's next turn) are the burst to wait for.
        """
        window = self.config.burst_window_seconds
        wanted = min(expected or self.config.prefill_batch_size, self.config.prefill_batch_size)
        started = time.monotonic()
        deadline = started + window * BURST_WINDOWS_AT_MOST
        seen = len(self._inbox)
        while 0 < seen < wanted and not self._stop:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.clear()  # a submit after this line sets it again
            if len(self._inbox) == seen:
                self._wake.wait(min(window, left))
            if len(self._inbox) == seen:  # the burst is over, or an abort came
                break
            seen = len(self._inbox)
        log.debug("burst of %d gathered in %.1f ms", seen, 1e3 * (time.monotonic() - started))

    def _serve(self, batch: BatchLoop, held: list[Job]) -> None:
        # Tokens are handed over every `chunk_tokens` steps: each hand-off
        # costs the event loop a wake-up and every stream a gRPC message, which
        # under load is time taken from the engine. First tokens and endings
        # never wait.
        pending: list[Event] = []
        steps: list[tuple[float, int]] = []
        # Jobs that ended one shortly after another (each within a burst's
        # reach of the last), and when the last of them did.
        ended, ended_at = 0, 0.0
        while not self._stop:
            # Clear before looking at the inbox: a submit after this line sets
            # it again, so no wake-up is lost.
            self._wake.clear()
            with self._abort_lock:
                aborts, self._aborts = self._aborts, set()
            held[:] = []
            while self._inbox:
                held.append(self._inbox.popleft())
            control: list[Event] = []  # aborts and failed starts: never held back
            if aborts:
                control += [Event(j, finish_reason="abort") for j in held if j.key in aborts]
                held[:] = [j for j in held if j.key not in aborts]
                control += [Event(j, finish_reason="abort") for j in batch.remove(aborts)]
            if held:
                control += batch.admit(held)
                held[:] = []
            if self.inject_failure is not None:
                raise self.inject_failure
            urgent = bool(control)
            if batch.has_work:
                started = time.perf_counter()
                stepped = batch.step()
                seconds = time.perf_counter() - started
                finished = sum(e.finish_reason is not None for e in stepped)
                # Those still running plus those that finished in this step.
                steps.append((seconds, batch.running + finished))
                if finished:
                    now = time.monotonic()
                    ended = (ended if now - ended_at <= self._burst_reach else 0) + finished
                    ended_at = now
                pending += stepped
                urgent = urgent or finished > 0 or any(e.first for e in stepped)
            self.running = batch.running
            self.generator_sequences = batch.generator_sequences
            self.prefix_cache_bytes = batch.prefix_cache_bytes
            if steps:
                self.chunk_tokens = chunk_tokens(
                    self.config.stream_interval, self.running, steps[-1][0]
                )
            if urgent or len(steps) >= self.chunk_tokens or not batch.has_work:
                # Held tokens first: an abort must follow its job's last tokens.
                if pending or control or steps:
                    self._post(self._deliver, pending + control, steps)
                pending, steps = [], []
            if not batch.has_work:
                self._wake.wait()
                if self.config.burst_window_seconds:
                    just_ended = time.monotonic() - ended_at <= self._burst_reach
                    self._gather_burst(ended if just_ended else 0)
                ended = 0
        if pending or steps:
            self._post(self._deliver, pending, steps)
