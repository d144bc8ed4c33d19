"""Every stream pacing rule, in one place.

Each stream message costs the event loop (gRPC, in this process, under the
GIL) time the engine thread then waits for, and costs the client as much
again. So tokens travel in chunks:

- a request's first token, and its end, go at once;
- otherwise a chunk carries `tokens_per_message` tokens: --stream-interval at light
  load, growing with the load so that all streams together send about
  MESSAGES_PER_SECOND messages, but never holding a token more than about
  MAX_CHUNK_SECONDS (when steps are that slow, every token goes alone, and
  tokens held go before a step the scheduler expects to take them past it);
- --stream-interval 1 sends every token alone, at any load;
- no chunk carries more tokens than one message may hold (--max-response-bytes):
  a stream whose reader fell behind catches up in several.

Two halves apply these rules, on two threads:

- `StreamPublisher` is the engine's `Sink`, on the engine thread. It hands
  step reports to the event loop at once when they carry a first token, an
  end or an abort, or any token while each goes alone; else on its cadence:
  every `tokens_per_message` steps, or sooner where the next step would take
  the tokens held past MAX_CHUNK_SECONDS (each hand-off is an event-loop
  wake-up). Its only way to the loop is `call_soon_threadsafe`.
- `chunks()` runs on the event loop, one per stream: it waits until
  `tokens_per_message` new tokens are there and sends them as one chunk; at
  a hand-off of the cadence, a stream whose oldest token would wait past
  MAX_CHUNK_SECONDS for the next one sends what it holds (`Job.hurry`): one
  counting its chunk from a hand-off out of step with the cadence (one a
  start or an end made, or a chunk size that moved with the steps' jitter)
  would otherwise hold its first tokens through two cadences. When
  steps get so slow that each token goes alone, a stream asleep for a larger
  chunk sends what it holds (`Job.pace`): else a token held from the fast
  steps would wait through several slow ones.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from smg_mlx.api import responses
from smg_mlx.api.jobs import Job
from smg_mlx.engine.types import CacheStats, Memory, SpeculationStats, StepReport
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

# A message takes gRPC and the loop a few tenths of a millisecond of the GIL,
# which an engine thread whose steps are bound by the host (a small model on a
# GPU) waits for: at this rate, a few percent of its time.
MESSAGES_PER_SECOND = 100
# The default step budget (EngineConfig): a stream waits that long anyway while prompts prefill.
MAX_CHUNK_SECONDS = 0.15


def tokens_per_message(minimum: int, running: int, step_seconds: float) -> int:
    """Tokens per stream message: `minimum` at light load, growing so that
    `running` streams send about MESSAGES_PER_SECOND messages in all, but at
    most MAX_CHUNK_SECONDS of steps' worth (at least 1). A minimum of 1 asks
    for every token alone."""
    if minimum == 1 or step_seconds <= 0:
        return minimum
    by_budget = math.ceil(running / (MESSAGES_PER_SECOND * step_seconds))
    by_time = int(MAX_CHUNK_SECONDS / step_seconds)
    return max(1, min(max(minimum, by_budget), by_time))


class Receiver(Protocol):
    """The event-loop side of the engine (`EngineClient`); called on the loop."""

    def started(self, memory: Memory, ranks: int, mode: str, cache: CacheStats,
                speculation: SpeculationStats) -> None: ...  # fmt: skip

    def deliver(self, reports: list[StepReport], per_message: int, cadence: bool) -> None: ...

    def stopped(self) -> None: ...

    def failed(self, message: str, permanent: bool = False) -> None: ...


def poster(loop: asyncio.AbstractEventLoop) -> Callable[..., None]:
    """`post(callback, *args)`: call it on `loop`, from any thread (nothing, once
    the loop is gone: nobody is listening)."""

    def post(callback: Callable[..., None], *args: object) -> None:
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass

    return post


class StreamPublisher:
    """The engine's sink: forwards its reports to the receiver through `post`
    (`poster(loop)` on the worker's event loop; in the engine's own process,
    `api.engine_child`, a call that crosses the pipe), paced."""

    def __init__(self, post: Callable[..., None], receiver: Receiver, minimum: int) -> None:
        self._post = post
        self._receiver = receiver
        self._minimum = minimum
        self._per_message = minimum  # tokens per message now
        self._held: list[StepReport] = []
        # Steps, and their seconds, since the last hand-off of the cadence (module doc).
        self._steps = 0
        self._seconds = 0.0

    def _flush(self, cadence: bool = False) -> None:
        if cadence:
            self._steps, self._seconds = 0, 0.0
        if self._held:
            self._post(self._receiver.deliver, self._held, self._per_message, cadence)
            self._held = []

    def started(self, memory: Memory, ranks: int, mode: str, cache: CacheStats,
                speculation: SpeculationStats) -> None:  # fmt: skip
        self._post(self._receiver.started, memory, ranks, mode, cache, speculation)

    def stepping(self, expected_seconds: float) -> None:
        # Tokens held through a step would wait for it too: past about
        # MAX_CHUNK_SECONDS they go now (the step before was short, this one
        # will not be: a long prompt's chunk, a new prompt's first step). If
        # such steps send each token alone, the streams send them now too.
        if self._held and self._seconds + expected_seconds > MAX_CHUNK_SECONDS:
            running = self._held[-1].running
            if tokens_per_message(self._minimum, running, expected_seconds) == 1:
                self._per_message = 1
            self._flush(cadence=True)

    def step(self, report: StepReport) -> None:
        self._held.append(report)
        if report.step_seconds is not None:
            self._per_message = tokens_per_message(
                self._minimum, report.running, report.step_seconds
            )
            self._steps += 1
            self._seconds += report.step_seconds
        urgent = any(e.first or e.ends for e in report.events)
        # With each token alone, tokens a step sends before its end (the short
        # lane's, before a long prompt's chunks) go then: were they held to
        # its end only now and then, a stream's gaps would be uneven.
        alone = self._per_message == 1 and bool(report.events)
        if report.idle or self._steps >= self._per_message:
            self._flush(cadence=True)
        elif urgent or alone:
            self._flush()

    def stopped(self) -> None:
        self._flush()
        self._post(self._receiver.stopped)

    def failed(self, message: str, permanent: bool = False) -> None:
        # Tokens still held are not sent: every request ends with the failure,
        # and this may run on the lockstep watchdog's thread (handoff.Sink).
        self._post(self._receiver.failed, message, permanent)


async def chunks(
    job: Job, stream: bool, per_message: Callable[[], int], most: int, each_alone: bool = False
) -> AsyncIterator[pb.GenerateResponse]:
    """The chunks of one Generate call (none unless `stream`), until the job
    ends; the final message is the caller's. `per_message()` gives the tokens
    per message now; `most` is the most one message may carry; `each_alone`:
    every token goes in a message of its own (--stream-interval 1)."""
    # The engine hands tokens over more often than every `per_message()` steps
    # (any step where some stream starts or ends is handed over at once), so
    # each stream still waits for its own `per_message()` tokens.
    sent = 0
    while True:
        job.changed.clear()
        if job.error:
            return
        # What arrived since the last chunk goes in one chunk, except the first
        # token and, under --stream-interval 1, every token: those go alone even
        # when a handler woken late finds several. (Slow steps make chunks of
        # one too, but tokens that waited for a message go in one.) More may
        # land while a chunk is sent, so look again before finishing.
        due = 1 if sent == 0 or job.finish_reason or job.hurried else per_message()
        if stream and len(job.tokens) - sent >= due:
            alone = sent == 0 or each_alone
            end = sent + 1 if alone else min(len(job.tokens), sent + most)
            message, sent = responses.chunk(job, sent, end), end
            job.hurried = False
            yield message
            job.streamed = sent
            continue
        if job.finish_reason:
            return
        # Non-streaming requests need waking only at the end.
        job.wake_at = sent + due if stream else None
        await job.changed.wait()
