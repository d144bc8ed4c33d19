"""Burst gathering: an idle engine starts requests that arrive together as one group.

Requests started one or two at a time stay out of step for good: each group
costs a prefill call and a merge into the batch, and ends in a step of its
own. So when an idle engine wakes to a new request, it waits while more keep
coming, each within one window of the last, and starts them together. A
running batch never waits: new requests join it at the next step.
"""

from __future__ import annotations

import logging
import time

from smg_mlx.engine.handoff import Inbox

log = logging.getLogger(__name__)

# The whole wait is at most this many windows, however steady the trickle.
WINDOWS_AT_MOST = 5


class BurstGatherer:
    """Decides how long an idle engine waits for the rest of a burst."""

    def __init__(self, window_seconds: float, group_size: int) -> None:
        self._window = window_seconds
        self._group = group_size
        self._reach = window_seconds * WINDOWS_AT_MOST
        # Requests that ended one shortly after another, and when the last did:
        # their replacements (clients' next turns) are the burst to wait for.
        self._ended = 0
        self._ended_at = 0.0

    def ended(self, count: int) -> None:
        """`count` requests finished in the step just run."""
        now = time.monotonic()
        recent = now - self._ended_at <= self._reach
        self._ended = (self._ended if recent else 0) + count
        self._ended_at = now

    def gather(self, inbox: Inbox) -> None:
        """Called when the idle engine wakes: waits until a prefill group's worth
        is here, or as many as just ended, or the requests stop coming."""
        expected = self._ended if time.monotonic() - self._ended_at <= self._reach else 0
        self._ended = 0
        if not self._window:
            return
        wanted = min(expected or self._group, self._group)
        started = time.monotonic()
        deadline = started + self._reach
        seen = inbox.pending()
        while 0 < seen < wanted and not inbox.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            now_pending = inbox.wait_for_more(seen, min(self._window, left))
            if now_pending == seen:  # the burst is over, or an abort came
                break
            seen = now_pending
        log.debug("burst of %d gathered in %.1f ms", seen, 1e3 * (time.monotonic() - started))
