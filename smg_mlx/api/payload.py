"""Work on one request's payload: on the event loop when it is small, else on
a thread of its own.

Parsing, checking and converting a message of megabytes, or building one,
takes tens to hundreds of milliseconds; on the event loop every other call
would wait that long, health checks included. Off the loop it still holds the
GIL (a parse is one long call into C), so one thread does all such work, one
piece at a time, and after each piece rests as long as it worked: the loop
(and gRPC's own thread) get the GIL at least half the time, and a health
check waits for at most the piece in progress.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Work on a payload up to this size (in bytes, or about) stays on the loop: it
# takes well under a millisecond, less than handing it over would.
INLINE_BYTES = 64 << 10


class PayloadWork:
    """Runs work on payloads; the large ones, one at a time, off the loop."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="payload")
        self._rested_at = 0.0  # (monotonic) when the thread may work again

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, work on a payload of about `size` bytes."""
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
