"""A Generate request as the event loop sees it: what the engine made of it so far."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from smg_mlx.engine.types import Event, Failure, GenerationSpec, Request, TokenLogprobs

_keys = itertools.count(1)


@dataclass(eq=False)
class Job:
    """One request in flight. Only the event loop reads or writes a Job: the
    engine's events reach it through `EngineClient`, on the loop."""

    request_id: str
    spec: GenerationSpec
    key: int = field(default_factory=lambda: next(_keys))
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    failure: Failure | None = None  # why it ended with an error (from the engine)
    # The error is the worker's, not this request's (the engine failed, or the
    # worker stopped before the request had a token): another worker may serve it.
    retry_elsewhere: bool = False
    streamed: int = 0  # tokens sent to the client so far
    cached_tokens: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # `changed` is set once this many tokens are here (None: only at the end),
    # or the job ends; the stream's pacing (api.streaming) moves it.
    wake_at: int | None = 1
    # The stream sends what it holds, whatever its chunk's count (api.streaming:
    # its oldest token would wait too long for the next hand-off).
    hurried: bool = False
    # Event-loop clock readings, for the wait, TTFT, inter-token latency and duration.
    arrived_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # it joined the batch
    first_token_at: float | None = None
    last_token_at: float = 0.0
    token_gaps: list[float] = field(default_factory=list)
    ended_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def request(self) -> Request:
        """What the engine is handed."""
        return Request(self.key, self.spec, self.request_id)

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
        self.failure = event.failure if event.error else None
        self._wake_if_due()

    def pace(self, per_message: int) -> None:
        """Chunks are now `per_message` tokens: a stream asleep until a larger
        chunk's worth arrives wakes for this one instead (steps slowed down: the
        tokens it holds would otherwise wait several slow steps)."""
        if self.wake_at is not None:
            self.wake_at = min(self.wake_at, self.streamed + per_message)
            self._wake_if_due()

    def hurry(self) -> None:
        """A stream holding tokens sends them now (api.streaming)."""
        if self.wake_at is not None and len(self.tokens) > self.streamed:
            self.hurried = True
            self.changed.set()

    def _wake_if_due(self) -> None:
        if self.done or (self.wake_at is not None and len(self.tokens) >= self.wake_at):
            self.changed.set()

    def end(
        self,
        *,
        finish_reason: str | None = None,
        error: str | None = None,
        retry_elsewhere: bool = False,
        failure: Failure = Failure.STEP,
    ) -> None:
        """End the job without the engine (it stopped or failed)."""
        self.retry_elsewhere = retry_elsewhere
        event = Event(self.key, finish_reason=finish_reason, error=error, failure=failure)
        self.apply(event, time.monotonic())
