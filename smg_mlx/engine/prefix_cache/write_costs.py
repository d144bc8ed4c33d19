"""What the disk tier's writes cost the engine thread, and which of them pay
for it while requests run (`engine.prefix_cache.disk_tier`).

A write's arrays are copied out, handed to the writer thread (waiting for the
copies) and freed on the engine thread, between steps. On a fast accelerator
that takes longer than prefilling a short entry again, and a worker serving a
stream of new prompts would spend a third of its time writing entries no hit
could repay. So while requests run, an entry goes to disk only where one hit
on it saves WRITE_PAYBACK times what a write costs, as the latest writes
measured (those made while idle too: an estimate that only the writes it lets
through could lower would stick where one write was slow); the rest wait for a
turn with none running (an entry dropped from memory meanwhile is not written).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

WRITE_PAYBACK = 2.0
# The latest write's share of the running measure.
WEIGHT = 0.3


class WriteCosts:
    """A write's engine-thread seconds, as measured."""

    def __init__(self) -> None:
        self.seconds: float | None = None  # None: not measured yet (a write pays)
        self._said = False

    def measured(self, seconds: float) -> None:
        """A write took `seconds` of the engine thread."""
        self.seconds = (
            seconds if self.seconds is None else self.seconds + WEIGHT * (seconds - self.seconds)
        )

    def pays(self, saving: float) -> bool:
        """Whether a write whose hit saves `saving` seconds of prefill pays for
        itself while requests run (said once where one does not)."""
        if self.seconds is None or saving >= WRITE_PAYBACK * self.seconds:
            return True
        if not self._said:
            self._said = True
            log.info(
                "prompt cache: while requests run, entries whose hit saves under %gx what a "
                "write costs the engine wait for an idle moment to go to disk (a write costs "
                "%.1f ms, measured; a hit on this entry would save %.1f ms of prefill)",
                WRITE_PAYBACK, 1e3 * self.seconds, 1e3 * saving,
            )  # fmt: skip
        return False
