"""Progress lines for start-up's long steps: a large model on a slow device
takes minutes to check and warm up, and a log that goes quiet for that long
reads as a hung worker. A step ticks as it goes; a line comes out at most
every EVERY_SECONDS, so fast starts print none of them."""

from __future__ import annotations

import logging
import time

EVERY_SECONDS = 5.0


class Progress:
    """How far one start-up step (`step`, as its lines begin) has come: `done`
    of `total` `unit` (a total of None: not known ahead)."""

    def __init__(self, log: logging.Logger, step: str, unit: str,
                 total: int | None = None) -> None:  # fmt: skip
        self._log = log
        self._step = step
        self._unit = unit
        self._every = EVERY_SECONDS
        self.total = total
        self.done = 0
        self.began = time.perf_counter()
        self._due = self.began + self._every

    @property
    def seconds(self) -> float:
        """Since the step began."""
        return time.perf_counter() - self.began

    def advance(self, by: int = 1) -> None:
        self.done += by
        self.tick()

    def tick(self) -> None:
        """Log how far the step has come, if a line is due."""
        now = time.perf_counter()
        if now < self._due:
            return
        self._due = now + self._every
        of = "" if self.total is None else f" of {self.total}"
        seconds = now - self.began
        self._log.info("%s: %d%s %s, %.0fs", self._step, self.done, of, self._unit, seconds)
