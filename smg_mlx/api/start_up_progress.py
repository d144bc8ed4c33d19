"""Start-up's quiet spans said in the log (event loop).

From `loading DIR` to `SERVING` some steps log nothing for seconds: reading
the tokenizer (transformers importing), the engine's process importing MLX,
on a busy host ten seconds and more. A log that goes quiet that long reads as
a hung worker. While start-up lasts, whenever nothing has been logged for
EVERY_SECONDS, a line says what the worker is waiting on and for how long it
has been starting; until the engine logs its first line, after which its own
steps say how far they have come as often.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

EVERY_SECONDS = 5.0
ENGINE = "smg_mlx.engine"  # the engine's loggers (in its process or the worker's)


class StartUpProgress(logging.Handler):
    """Notes when anything is logged under `smg_mlx` (the engine's process's
    lines too: they are logged here as they come), and says `waiting_on`
    after a quiet span."""

    def __init__(self, log: logging.Logger, waiting_on: str) -> None:
        super().__init__()
        self.waiting_on = waiting_on  # what start-up waits on now, as a line says it
        self._log = log
        self._began = self._last = time.monotonic()
        self._engine_loads = False
        self._over = False

    def engine_loads(self) -> None:
        """The engine was asked to load the model: start-up waits on it until it
        logs its first line; from there its own steps say how far they have come."""
        self.waiting_on = "the engine (importing MLX, then loading the weights)"
        self._engine_loads = True

    def emit(self, record: logging.LogRecord) -> None:
        self._last = time.monotonic()
        self._over = self._over or (self._engine_loads and record.name.startswith(ENGINE))

    async def _say_when_quiet(self) -> None:
        while not self._over:
            await asyncio.sleep(max(0.0, self._last + EVERY_SECONDS - time.monotonic()))
            now = time.monotonic()
            if now - self._last >= EVERY_SECONDS and not self._over:
                self._log.info("still starting, %.0fs: %s", now - self._began, self.waiting_on)


@contextlib.asynccontextmanager
async def said_while_quiet(log: logging.Logger, waiting_on: str) -> AsyncIterator[StartUpProgress]:
    """Inside, quiet spans are said (`StartUpProgress`); set `waiting_on` as
    start-up moves on."""
    progress = StartUpProgress(log, waiting_on)
    watched = logging.getLogger("smg_mlx")
    watched.addHandler(progress)
    saying = asyncio.ensure_future(progress._say_when_quiet())
    try:
        yield progress
    finally:
        saying.cancel()
        watched.removeHandler(progress)
