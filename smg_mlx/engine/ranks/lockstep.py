"""Several ranks serving one model in lockstep, over mx.distributed (uses MLX).

Rank 0 decides everything that changes the batch (which requests join, which
leave, the prefill chunk, which prompt-cache entries go, when to stop) and
shares each turn's decisions before any rank applies them; every rank then
applies the same turn, so their batches, caches and random generators stay
equal without any rank deciding on its own.

The decisions travel over the group's own collectives (`all_sum`), on the
engine thread's stream: the model's collectives run there too, and messages
issued on another stream would interleave with them on the ring backend's
sockets. A peer that dies makes the next collective raise; one that hangs
blocks it forever, so a watchdog bounds how long a turn may take.

A rank waiting in a collective keeps a core busy (MLX's ring backend polls
its sockets). An idle rank 0 therefore sends its turns with a pause, which
the other ranks sleep through before they wait for the next, and waits as
long itself unless work comes: a request reaching an idle worker waits for
them at most that long. Pauses start short (the next request often follows
the last closely) and double to IDLE_TURN_SECONDS. (The turns also tell the
others that rank 0 is alive.)
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from smg_mlx.engine.handoff import TurnTimes
from smg_mlx.engine.ranks.launched import launched_rank

# The longest rank 0 goes without a turn while it gathers a burst of requests:
# the others must hear from it well before they give it up (HANG_SECONDS).
HEARTBEAT_SECONDS = 1.0
IDLE_TURN_SECONDS = 0.02
FIRST_PAUSE_SECONDS = 0.001
# A turn is shared in one collective of this many bytes when it fits, in two
# (its size, then itself) when not.
INLINE_BYTES = 1024
_SIZE_BYTES = 8
# A turn that takes longer means a hung peer; slower models get more (see Watchdog).
HANG_SECONDS = 5.0


class Channel:
    """Rank 0's decisions, shared with every rank of `group`."""

    def __init__(self, group: mx.distributed.Group, stream: mx.Stream) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._stream = stream

    def _sum(self, values: np.ndarray) -> np.ndarray:
        total = mx.distributed.all_sum(mx.array(values), group=self.group, stream=self._stream)
        return np.array(total)

    def share(self, value: Any = None) -> Any:
        """Rank 0's `value`, on every rank (the others pass nothing). One
        collective when it is small, as most turns are; two otherwise."""
        data = pickle.dumps(value) if self.rank == 0 else b""
        first = np.zeros(_SIZE_BYTES + INLINE_BYTES, dtype=np.uint8)
        first[:_SIZE_BYTES] = np.frombuffer(len(data).to_bytes(_SIZE_BYTES, "little"), np.uint8)
        if len(data) <= INLINE_BYTES:
            first[_SIZE_BYTES : _SIZE_BYTES + len(data)] = np.frombuffer(data, dtype=np.uint8)
        first = self._sum(first)
        size = int.from_bytes(first[:_SIZE_BYTES].tobytes(), "little")
        if size == 0:  # rank 0 never sends nothing: what a closed socket sums to
            raise ConnectionError(
                "rank 0's turn came empty: rank 0 is gone (its process ended or its "
                "connection closed)"
            )
        if size <= INLINE_BYTES:
            return pickle.loads(first[_SIZE_BYTES : _SIZE_BYTES + size].tobytes())
        rest = np.zeros(size, dtype=np.uint8)
        if self.rank == 0:
            rest[:] = np.frombuffer(data, dtype=np.uint8)
        return pickle.loads(self._sum(rest).tobytes())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        data = pickle.dumps(value)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = len(data)
        sizes = self._sum(sizes)
        start = int(sizes[: self.rank].sum())
        buffer = np.zeros(int(sizes.sum()), dtype=np.uint8)
        buffer[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
        buffer = self._sum(buffer)
        ends = np.cumsum(sizes)
        return [pickle.loads(buffer[e - n : e].tobytes()) for n, e in zip(sizes, ends, strict=True)]


def pause(idle_turns: int) -> float:
    """The pause of an idle turn after `idle_turns` idle turns in a row."""
    return min(IDLE_TURN_SECONDS, FIRST_PAUSE_SECONDS * 2 ** min(idle_turns, 16))


def group() -> mx.distributed.Group | None:
    """The group of ranks a launcher started, or None for a worker on its own."""
    rank = launched_rank()
    if rank is None:
        return None
    found = mx.distributed.init()
    if found.size() == 1 and rank > 0:
        raise RuntimeError(
            f"this process was started as rank {rank}, but mx.distributed found no other "
            "rank: check the launcher's backend (mlx.launch --backend ring, jaccl, nccl or mpi)"
        )
    return found if found.size() > 1 else None


def same_random_state(channel: Channel) -> None:
    """Seed every rank's random generator alike: unseeded sampling draws from
    it, and each rank samples the same tokens itself."""
    seed = channel.share(int.from_bytes(os.urandom(4), "little") if channel.rank == 0 else None)
    mx.random.seed(seed)


class Watchdog:
    """Calls `on_hang` (once, from its own thread) when a turn has taken longer
    than HANG_SECONDS, or three times the slowest turn expected or seen,
    whichever is more (`TurnTimes.overdue`)."""

    def __init__(self, on_hang: Callable[[float], None], expected_seconds: float) -> None:
        self._on_hang = on_hang
        self._turns = TurnTimes()
        self._turns.may_take(expected_seconds)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="lockstep-watchdog", daemon=True).start()

    def turn_started(self, expected_seconds: float = 0.0) -> None:
        """A turn begins (or its length is now known): it may take three times
        `expected_seconds` too."""
        self._turns.started(expected_seconds)

    def turn_ended(self) -> None:
        self._turns.ended()

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            if (overdue := self._turns.overdue(HANG_SECONDS)) is not None:
                self._on_hang(overdue.limit)
                return
