"""Everything that crosses between the engine thread and the rest of the process.

One thread owns MLX (it keeps per-stream state thread-local). It meets the
other threads in exactly three places, all here:

- in, through an `Inbox`: `Request`s, abort keys and a stop flag. Any thread
  may write; only the engine thread drains it, once per loop turn.
- out, through a `Sink`: the engine thread calls it with immutable values
  (`StepReport`s of `Event`s) and state changes. What a sink does with them
  is its own business; the gRPC worker's sink forwards them to the event loop
  (`api.streaming.StreamPublisher`), a test's may just keep them. (One
  exception: with a model split over several ranks, a watchdog thread reports
  `failed` when the engine thread is stuck waiting for a hung rank.)
- `TurnTimes`: when the engine loop's turn under way began, for a watchdog to
  tell a stuck engine from a busy one.

Nothing else is shared: no MLX array, cache or model object ever leaves the
engine thread.
"""

from __future__ import annotations

import math
import multiprocessing
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple, Protocol

from smg_mlx.engine.types import CacheStats, Memory, Request, SpeculationStats, StepReport


class Inbox:
    """Requests, aborts and stop, handed to the engine thread.

    `submit`, `abort`, `wake` and `stop` may be called from any thread; `take`,
    `pending`, `wait` and `wait_for_more` only from the engine thread.
    """

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()
        self._aborts: set[int] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._flush_until = 0.0  # see `stop`
        self._hurried = False  # see `hurry`

    def submit(self, request: Request) -> None:
        self._requests.append(request)
        self._wake.set()

    def abort(self, keys: Iterable[int]) -> None:
        with self._lock:
            self._aborts.update(keys)
        self._wake.set()

    def wake(self) -> None:
        """Wake the engine loop without handing it anything (work finished elsewhere)."""
        self._wake.set()

    def stop(self, flush_seconds: float = 0.0) -> None:
        """Ask the engine loop to end after its current turn; the prefix cache
        then writes to disk what it has not yet for at most `flush_seconds`."""
        self._flush_until = time.monotonic() + flush_seconds
        self._stopping = True
        self._wake.set()

    def hurry(self) -> None:
        """End the prefix cache's writes at a stop now, wherever they are (a
        second stop signal)."""
        self._hurried = True

    def flush_until(self) -> float:
        """The time.monotonic() by which the writes at a stop end, asked as they
        go; -inf once `hurry` ended them (which the writes tell apart from a
        grace the requests in flight took)."""
        return -math.inf if self._hurried else self._flush_until

    @property
    def stopping(self) -> bool:
        return self._stopping

    def take(self, hold: bool = False) -> tuple[list[Request], set[int]]:
        """Everything submitted and aborted since the last call. `hold`: the
        requests stay for a later call (and `wait` does not sleep), unless an
        abort came, which may name one of them."""
        with self._lock:
            hold = hold and not self._aborts
            # Clear first: a submit or abort after this line sets it again, so
            # `wait` never sleeps through one.
            if not hold:
                self._wake.clear()
            aborts, self._aborts = self._aborts, set()
        requests = []
        while not hold and self._requests:
            requests.append(self._requests.popleft())
        return requests, aborts

    def pending(self) -> int:
        """Requests submitted and not yet taken."""
        return len(self._requests)

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until something arrives (or was already there since the last
        `take`); whether it did (else `timeout` passed)."""
        return self._wake.wait(timeout)

    def wait_for_more(self, seen: int, timeout: float) -> int:
        """Sleep until more than `seen` requests are pending, or an abort or stop
        comes, or `timeout` passes; returns how many are pending. A `wake` (work
        finished elsewhere, such as the disk tier opening) does not end it."""
        until = time.monotonic() + timeout
        while (left := until - time.monotonic()) > 0:
            self._wake.clear()  # (before the check: what comes after it sets it again)
            if len(self._requests) != seen or self._aborts or self._stopping:
                break
            self._wake.wait(left)
        return len(self._requests)


class Sink(Protocol):
    """Where the engine reports. Every method is called on the engine thread."""

    def started(self, memory: Memory, ranks: int, mode: str, cache: CacheStats,
                speculation: SpeculationStats) -> None:  # fmt: skip
        """The model is loaded and warmed up on `ranks` processes: requests can be
        served (of at most `memory.longest_sequence` tokens each), batched as
        `mode` says (`engine.batch.batch_check`); the prefix cache holds what
        `cache` says (the disk tier's entries from earlier runs); `speculation`
        says what proposes, if anything (its counts all 0)."""

    def stepping(self, expected_seconds: float) -> None:
        """A step is about to run, expected to take `expected_seconds`."""

    def step(self, report: StepReport) -> None:
        """One loop turn's events and the batch's state after it."""

    def stopped(self) -> None:
        """The loop ended on `Inbox.stop`; requests it still held were dropped
        unfinished and are the caller's to end."""

    def failed(self, message: str, permanent: bool = False) -> None:
        """Loading or a step failed; the engine thread ends and takes no more work.
        Requests it held are the caller's to end. `permanent`: the model cannot
        be served at all (`types.Unservable`), so restarting would not help.
        (With several ranks, a watchdog thread calls it when the engine thread
        is stuck waiting for a hung rank.)"""


class Overdue(NamedTuple):
    """An engine stuck (`TurnTimes.overdue`): for `seconds`, past `limit`; in a
    turn (`turn`), or else with a request handed over that no turn took up."""

    seconds: float
    limit: float
    turn: bool


class TurnTimes:
    """When the engine loop's turn under way began (a turn: taking what
    arrived, deciding, and the step), what the scheduler expects it to take,
    the slowest turn so far, and when the last one began. The engine thread
    writes them; a watchdog reads them from another thread or process: they
    live in shared memory, so a turn costs no message."""

    # Slots of the shared array.
    _SINCE, _EXPECTED, _SLOWEST, _BEGAN = range(4)

    def __init__(self) -> None:
        self._times = multiprocessing.RawArray("d", 4)  # since is 0 between turns

    def may_take(self, seconds: float) -> None:
        """Turns may take `seconds` (the slowest step the scheduler plans)."""
        self._times[self._SLOWEST] = max(self._times[self._SLOWEST], seconds)

    def next(self) -> None:
        """The turn under way (if any) ends, and the next begins (no moment
        between them for a watchdog to find the loop between turns)."""
        times, now = self._times, time.monotonic()
        if since := times[self._SINCE]:
            times[self._SLOWEST] = max(times[self._SLOWEST], now - since)
        times[self._SINCE] = times[self._BEGAN] = now
        times[self._EXPECTED] = 0.0

    def started(self, expected_seconds: float = 0.0) -> None:
        """A turn begins, or the one under way now expects `expected_seconds`."""
        times = self._times
        if not times[self._SINCE]:
            times[self._SINCE] = times[self._BEGAN] = time.monotonic()
        times[self._EXPECTED] = expected_seconds

    def ended(self) -> None:
        """The turn under way (if any) ended."""
        times = self._times
        if since := times[self._SINCE]:
            times[self._SLOWEST] = max(times[self._SLOWEST], time.monotonic() - since)
            times[self._SINCE] = 0.0

    def limit(self, least: float) -> float:
        """How long a turn may run before it counts as stuck: `least` seconds,
        or three times the slowest turn expected or seen, whichever is more."""
        _, expected, slowest, _ = self._times[:]
        return max(least, 3 * max(slowest, expected))

    def overdue(self, least: float, handed_over: float | None = None) -> Overdue | None:
        """Where the engine is stuck, how long for and the limit it passed: a
        turn under way, or a request `handed_over` at that time (monotonic)
        with no turn begun since, for longer than `least` seconds or three
        times the slowest turn expected or seen, whichever is more."""
        since, _, _, began = self._times[:]
        limit = self.limit(least)
        now = time.monotonic()
        if since and now - since > limit:
            return Overdue(now - since, limit, turn=True)
        if handed_over is not None and began < handed_over and now - handed_over > limit:
            return Overdue(now - handed_over, limit, turn=False)
        return None
