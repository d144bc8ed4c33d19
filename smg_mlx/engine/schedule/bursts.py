"""Burst gathering: requests that arrive together start as one group.

Requests started one or two at a time stay out of step for good: each group
costs a prefill call and a merge into the batch, and ends in a step of its
own. So when an idle engine wakes to a new request, it waits while more keep
coming, each within one window of the last, and starts them together. A
running batch never waits, but where requests just ended, the first of their
replacements (clients' next turns, arriving over a few milliseconds) are let
in once as many have come as ended, or WINDOWS_AT_MOST windows after the
last end: the batch steps on meanwhile, and one prefill pass starts them all.
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

    def holds(self, pending: int) -> bool:
        """Whether a running engine leaves the `pending` requests in the inbox
        for another step: fewer have come than just ended, and the rest may
        still be coming (within the reach of the last end). Started apart, the
        first few would cost a prefill pass of their own, and their group
        would stay out of step with the rest for good."""
        if not self._window or not pending or pending >= min(self._ended, self._group):
            return False
        return time.monotonic() - self._ended_at <= self._reach

    def taken(self) -> None:
        """The requests that came were taken: the burst is no longer awaited."""
        self._ended = 0

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
