"""A follower rank: the engine core alone, applying rank 0's turns, no gRPC server.

When several ranks serve one model, rank 0 is the worker the router sees;
every other rank runs this. It ends when rank 0 tells it to stop (exit 0), when
rank 0 dies or hangs (exit 1), or when the model cannot be served so (exit 2).
"""

from __future__ import annotations

import logging
import signal

from smg_mlx.config import EngineConfig
from smg_mlx.engine.core import EngineCore
from smg_mlx.engine.handoff import Inbox
from smg_mlx.engine.types import CacheStats, Memory, SpeculationStats, StepReport

log = logging.getLogger(__name__)


class _Outcome:
    """A sink that only remembers how the engine ended."""

    exit_code = 1

    def started(self, memory: Memory, ranks: int, mode: str, cache: CacheStats,
                speculation: SpeculationStats) -> None:  # fmt: skip
        # Once following, stopping this rank alone would fail every rank: rank 0
        # stops them all. (Until then a signal ends it, as a stuck start-up may need.)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _ignore)

    def stepping(self, expected_seconds: float) -> None:  # rank 0 only
        pass

    def step(self, report: StepReport) -> None:  # rank 0 only
        pass

    def stopped(self) -> None:
        log.info("rank 0 stopped the worker")
        self.exit_code = 0

    def failed(self, message: str, permanent: bool = False) -> None:
        log.error("%s", message)
        self.exit_code = 2 if permanent else 1  # permanent: no restart can cure it


def _ignore(signum: int, frame: object) -> None:
    log.warning("signal %d ignored: stop rank 0, and it stops every rank", signum)


def run(config: EngineConfig, rank: int) -> int:
    """Follow rank 0 until it stops; returns the exit code."""
    log.info("rank %d: serving %s with rank 0, which answers the clients", rank, config.model_path)
    outcome = _Outcome()
    try:
        # On this thread, which then owns MLX: nothing else here touches it.
        EngineCore(config, Inbox(), outcome).run()
    except SystemExit as stop:  # a signal while it loads (the launcher ending the ranks)
        log.info("rank %d: stopped while starting", rank)
        return stop.code if isinstance(stop.code, int) else 0
    return outcome.exit_code
