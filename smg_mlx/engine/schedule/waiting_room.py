"""The requests waiting to start, and what the prefix cache spares each (pure, no MLX).

The scheduler (`engine.schedule.scheduler`) takes them from here in the order `ranked`
gives: those that have waited AGING_SECONDS first, in arrival order; then
short prompts, the shortest first; then long ones, in arrival order.
Requests put back after an error go ahead of every arrival.

What the prefix cache spares a request is read when it arrives and again,
where the cache has changed since, when it is considered; a request whose
prefix the cache's disk tier holds more of than memory waits while it is read
back (`Prefixes.fetch`), at most until the read's deadline; where the read
fails, for the next file that holds more than memory.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from smg_mlx.engine.memory.planner import Cost, cost
from smg_mlx.engine.types import Request

AGING_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Reuse:
    """What the prefix cache's memory tier would spare a prompt now."""

    tokens: int = 0  # prompt tokens it holds
    entry: int | None = None  # the entry they come from
    nbytes: int = 0  # that entry's size


class Fetch(Protocol):
    """A read of a prefix-cache entry from disk into memory, under way."""

    @property
    def done(self) -> bool:
        """Read and in memory, or failed."""

    @property
    def failed(self) -> bool:
        """Done without the entry (its file was bad or unreadable, and is gone)."""

    @property
    def deadline(self) -> float:
        """time.monotonic() past which a request stops waiting for it."""


class Prefixes(Protocol):
    """What the prefix cache spares prompts; the engine's batch answers."""

    @property
    def version(self) -> int:
        """Changes whenever what `reuse` says may have changed."""

    def reuse(self, prompt: Sequence[int]) -> Reuse: ...

    def fetch(self, prompt: Sequence[int], reuse: Reuse) -> Fetch | None:
        """Start (or join) reading back from disk an entry that spares `prompt`
        more than `reuse`, where that is faster than prefilling; None if none."""


class NoPrefixes:
    """No prefix cache."""

    version = 0

    def reuse(self, prompt: Sequence[int]) -> Reuse:
        return Reuse()

    def fetch(self, prompt: Sequence[int], reuse: Reuse) -> Fetch | None:
        return None


@dataclass(slots=True)
class Waiting:
    """A request in the waiting room."""

    request: Request
    order: int  # arrival order (requests put back after an error go first)
    arrived: float  # time.monotonic()
    reuse: Reuse  # what the prefix cache spares it (as of `version`)
    version: int
    fetch: Fetch | None = None  # its prefix being read back from disk
    held_back: bool = False  # it has waited for memory long enough to hold back younger ones

    @property
    def cached(self) -> int:
        """Prompt tokens the prefix cache holds."""
        return self.reuse.tokens

    @property
    def prefill(self) -> int:
        """Prompt tokens to prefill, after the prefix cache's share."""
        return len(self.request.spec.prompt) - self.reuse.tokens

    def cost(self, long: bool) -> Cost:
        return cost(self.request, self.cached, long)


class WaitingRoom:
    """The requests waiting to start, by key. Runs on rank 0's engine thread."""

    def __init__(self, prefixes: Prefixes | None = None) -> None:
        self._prefixes = prefixes or NoPrefixes()
        self._room: dict[int, Waiting] = {}
        self._order = itertools.count()
        self._put_back = itertools.count(-(2**62))  # ahead of every arrival

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
        prefixes = self._prefixes
        reuse = prefixes.reuse(prompt)
        fetch = prefixes.fetch(prompt, reuse)
        self._room[request.key] = Waiting(request, order, arrived, reuse, prefixes.version, fetch)

    def wanted(self) -> Counter[int]:
        """The prefix-cache entries waiting requests reuse (as last looked
        up), and how many reuse each."""
        return Counter(w.reuse.entry for w in self._room.values() if w.reuse.entry is not None)

    def remove(self, keys: Iterable[int]) -> list[Request]:
        """Take these requests out of the room (aborted); those that were there."""
        return [w.request for k in keys if (w := self._room.pop(k, None)) is not None]

    def take(self, waiting: Waiting) -> Waiting:
        """`waiting` leaves the room: it starts, or is refused."""
        return self._room.pop(waiting.request.key)

    def fetching(self, waiting: Waiting, now: float) -> bool:
        """Whether `waiting` still waits for its prefix to be read back from disk."""
        fetch = waiting.fetch
        if fetch is None:
            return False
        if not fetch.done and now < fetch.deadline:
            return True
        waiting.fetch = None
        if not fetch.failed:
            return False
        # Another file may still hold more of the prompt than memory does.
        self.refresh(waiting)
        waiting.fetch = self._prefixes.fetch(waiting.request.spec.prompt, waiting.reuse)
        return waiting.fetch is not None

    def refresh(self, waiting: Waiting) -> None:
        """What the prefix cache spares `waiting` now, if it may have changed."""
        version = self._prefixes.version
        if waiting.version != version:
            waiting.reuse = self._prefixes.reuse(waiting.request.spec.prompt)
            waiting.version = version

    def ranked(self, long_tokens: int, now: float) -> list[Waiting]:
        """Who is considered first (see the module's doc); prompts of more
        than `long_tokens` to prefill are long."""
        return sorted(self._room.values(), key=lambda w: self._rank(w, long_tokens, now))

    @staticmethod
    def _rank(waiting: Waiting, long_tokens: int, now: float) -> tuple[int, int, int]:
        """Aged requests first, in arrival order; then short prompts, the
        shortest first; then long ones, in arrival order."""
        if now - waiting.arrived >= AGING_SECONDS:
            return 0, 0, waiting.order
        if waiting.prefill <= long_tokens:
            return 1, waiting.prefill, waiting.order
        return 2, 0, waiting.order
