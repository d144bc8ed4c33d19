"""Work on one request's payload: on the event loop when it is small, else on
a thread of its own; and giving back the memory a burst of payloads took.

Parsing, checking and converting a message of megabytes, or building one,
takes tens to hundreds of milliseconds; on the event loop every other call
would wait that long, health checks included. Off the loop it still holds the
GIL (a parse is one long call into C), so one thread does all such work, one
piece at a time, and after each piece rests as long as it worked: the loop
(and gRPC's own thread) get the GIL at least half the time, and a health
check waits for at most the piece in progress.

A refused request outlives its refusal: gRPC keeps the exception that ended
the call, whose traceback holds the handlers' frames and so the request's
bytes and token ids, in a reference cycle that only Python's full collection
frees, and an idle worker may not run one for hours. So once payloads of
RECLAIM_BYTES have been worked on, the first quiet second runs a full
collection and hands the freed pages back to the system (malloc_trim, where
the C library has it).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Work on a payload up to this size (in bytes, or about) stays on the loop: it
# takes well under a millisecond, less than handing it over would.
INLINE_BYTES = 64 << 10
# Payload bytes worked on that make memory worth reclaiming, and how long
# payload work must pause first: a full collection holds the GIL for tens of
# milliseconds, which is better spent after a burst than during it.
RECLAIM_BYTES = 16 << 20
RECLAIM_QUIET_SECONDS = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, which returns the free pages of every malloc arena
    to the system (others return them by themselves, or have no such call)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


class PayloadWork:
    """Runs work on payloads; the large ones, one at a time, off the loop."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="payload")
        self._rested_at = 0.0  # (monotonic) when the thread may work again
        self._unreclaimed = 0  # payload bytes worked on since memory was reclaimed
        self._quiet_at = 0.0  # (monotonic) when the current burst counts as over
        self._reclaim: asyncio.TimerHandle | None = None
        self._trim = _malloc_trim()

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, work on a payload of about `size` bytes."""
        self._count(size)
        if size <= INLINE_BYTES:
            return fn(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._paced, fn, *args)

    def _paced(self, fn: Callable[..., T], *args: Any) -> T:
        # On the payload thread. The rest comes before the next piece, so that
        # each result is handed back as soon as it is ready.
        time.sleep(max(0.0, self._rested_at - time.monotonic()))
        started = time.monotonic()
        try:
            return fn(*args)
        finally:
            ended = time.monotonic()
            self._rested_at = ended + (ended - started)

    def _count(self, size: int) -> None:
        # On the loop.
        self._unreclaimed += size
        if self._unreclaimed < RECLAIM_BYTES:
            return
        self._quiet_at = time.monotonic() + RECLAIM_QUIET_SECONDS
        if self._reclaim is None:
            self._reclaim = asyncio.get_running_loop().call_later(
                RECLAIM_QUIET_SECONDS, self._when_quiet
            )

    def _when_quiet(self) -> None:
        loop = asyncio.get_running_loop()
        wait = self._quiet_at - time.monotonic()
        if wait > 0:
            self._reclaim = loop.call_later(wait, self._when_quiet)
            return
        self._reclaim = None
        self._unreclaimed = 0
        loop.run_in_executor(self._thread, self._reclaim_memory)

    def _reclaim_memory(self) -> None:
        # On the payload thread: malloc_trim runs without the GIL (ctypes
        # releases it), the collection with it, wherever it runs.
        gc.collect()
        if self._trim is not None:
            self._trim(0)
