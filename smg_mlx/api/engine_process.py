"""The engine in a child process (`engine_child` says why): the worker's end of its pipe.

An `EngineProcess` is the worker's inbox (what it calls is sent to the child)
and, on a thread of its own, the reader of the child's reports, which it hands
to the event loop as the engine thread's `StreamPublisher` would. The child
dying (a crash, a kill by the system for memory) is reported as a failure.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterable
from multiprocessing import resource_tracker
from multiprocessing.connection import wait

from smg_mlx.api import engine_child
from smg_mlx.api.streaming import Receiver, poster
from smg_mlx.config import EngineConfig
from smg_mlx.engine.handoff import TurnTimes
from smg_mlx.engine.types import Request

# After the pipe closes, how long to wait for the child's exit code before saying it died.
EXIT_CODE_SECONDS = 5.0


def _death(exit_code: int | None) -> str:
    """Why the engine's process ended without a word, for a log line and every
    request it held."""
    if exit_code is not None and exit_code < 0:
        name = signal.Signals(-exit_code).name
        why = " (the system kills the largest process when memory runs out)"
        return f"the engine process was killed by {name}{why if name == 'SIGKILL' else ''}"
    return f"the engine process ended unexpectedly (exit code {exit_code})"


class EngineProcess:
    """Spawns the engine's process at once, then talks to it. Its Inbox methods
    may be called from any thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        receiver: Receiver,
        stream_interval: int,
        turns: TurnTimes,
    ) -> None:
        """`turns`: where the engine marks its loop's turns (shared memory)."""
        # Spawned, not forked: a fork copies the threads' locks in whatever state
        # they are (gRPC's among them) without the threads.
        context = multiprocessing.get_context("spawn")
        conn, child_end = context.Pipe()
        self._pipe = engine_child.PipeEnd(conn)
        # Two threads asking for the exit code could both try to reap the child;
        # the loser would read it as still running.
        self._reaping = threading.Lock()
        self._serving = False  # the child reported `started`
        self.process = context.Process(
            target=engine_child.serve,
            args=(
                child_end, stream_interval, logging.getLogger("smg_mlx").getEffectiveLevel(), turns
            ),
            name="smg-mlx-engine",
            daemon=True,
        )
        # Stop signals blocked in the child from its start, before its imports
        # (seconds; a KeyboardInterrupt there would print a traceback):
        # `engine_child.serve` ignores them, then unblocks them. Here they are
        # only held back meanwhile. multiprocessing's resource tracker, which a
        # spawn starts first where none runs, unblocks them as it starts: so first.
        resource_tracker.ensure_running()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, engine_child.STOP_SIGNALS)
        try:
            self.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        child_end.close()  # else the pipe never reads as closed when the child dies
        threading.Thread(
            target=self._read, args=(loop, receiver), name="engine-reports", daemon=True
        ).start()

    def start(self, config: EngineConfig) -> None:
        """Load and serve `config`'s model (the child has imported MLX meanwhile)."""
        self._pipe.send("start", config)

    def submit(self, request: Request) -> None:
        self._pipe.send("submit", request)

    def abort(self, keys: Iterable[int]) -> None:
        self._pipe.send("abort", list(keys))

    def stop(self, flush_seconds: float = 0.0) -> None:
        if not self._serving:
            # Importing MLX or loading weights is not worth waiting for, and the
            # child holds the worker's stderr: whoever reads it would wait too.
            self.process.kill()
            return
        self._pipe.send("stop", flush_seconds)

    def hurry(self) -> None:
        self._pipe.send("hurry")

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` for the child to end."""
        if wait([self.process.sentinel], timeout):
            # Its pipes close a moment before it can be reaped: wait for that.
            with self._reaping:
                self.process.join()

    def is_alive(self) -> bool:
        return self._exit_code() is None

    def _exit_code(self) -> int | None:
        with self._reaping:
            return self.process.exitcode

    def _read(self, loop: asyncio.AbstractEventLoop, receiver: Receiver) -> None:
        """Hand the child's reports to the loop until its pipe closes; then,
        unless it had said it stopped or failed, report it died."""
        post = poster(loop)
        while (message := self._pipe.recv()) is not None:
            name, args = message
            if name == "log":
                record = args[0]
                logging.getLogger(record.name).handle(record)
            else:
                self._serving = self._serving or name == "started"
                post(getattr(receiver, name), *args)
        self.join(EXIT_CODE_SECONDS)
        # After any report it sent: a receiver that has ended ignores this.
        post(receiver.failed, _death(self._exit_code()))
