"""The engine's own process: the worker spawns it (`engine_process`) and it
runs `EngineCore` on its main thread, the one that owns MLX.

Why a process of its own: a step's Python holds the GIL, and on a GPU a small
model's steps are bound by that Python. In the worker's process the event loop
and gRPC took their share of the same GIL for every request and stream
message, and the engine thread waited for each. Here they share none.

It is spawned as the worker starts, and imports MLX while the worker finds
the model. One pipe joins the two processes; (name, args) tuples cross it:

- in: first ("start", (config,)), the model to serve; then, read by a relay
  thread, an `Inbox` method to call (submit, abort, stop, hurry);
- out: a `streaming.Receiver` method for the worker to call on its event loop
  (started, deliver, stopped, failed), paced here by the same
  `StreamPublisher` as an engine thread's; and ("log", record): this
  process's log records, which the worker logs as its own.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from smg_mlx.api.streaming import StreamPublisher
from smg_mlx.engine import start_up
from smg_mlx.engine.core import EngineCore
from smg_mlx.engine.handoff import Inbox, TurnTimes
from smg_mlx.engine.types import CacheStats, Memory, SpeculationStats, StepReport

log = logging.getLogger(__name__)

# Signals that stop the worker: this process ignores them (the worker asks it to
# stop through the pipe), from its start (`engine_process` spawns it with them blocked).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# The worker's process gone without a stop (killed): how long a serving engine
# may take to end its step and close its prefix cache before this process exits.
ORPHAN_SECONDS = 10.0


class PipeEnd:
    """One end of the pipe: (name, args) messages, sent whole from any thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def send(self, name: str, *args: object) -> None:
        """Nothing once the other side is gone: where this side reads, it learns so."""
        with self._lock:
            try:
                self._conn.send((name, args))
            except OSError:
                pass

    def recv(self) -> tuple[str, tuple] | None:
        """The next message; None once the other side is gone."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None


class PipeReceiver:
    """The worker's `streaming.Receiver`, seen from here: each call crosses the pipe
    (sent by the engine thread, the relay, and with several ranks a watchdog)."""

    def __init__(self, pipe: PipeEnd) -> None:
        self._pipe = pipe
        self.serving = False  # `started` was sent

    def started(self, memory: Memory, ranks: int, mode: str, cache: CacheStats,
                speculation: SpeculationStats) -> None:  # fmt: skip
        self.serving = True
        self._pipe.send("started", memory, ranks, mode, cache, speculation)

    def deliver(self, reports: list[StepReport], per_message: int, cadence: bool) -> None:
        self._pipe.send("deliver", reports, per_message, cadence)

    def stopped(self) -> None:
        self._pipe.send("stopped")

    def failed(self, message: str, permanent: bool = False) -> None:
        self._pipe.send("failed", message, permanent)


class PipeLogs(logging.handlers.QueueHandler):
    """Hands each log record, its message and traceback made text, to the worker."""

    def __init__(self, pipe: PipeEnd) -> None:
        super().__init__(queue=None)
        self._pipe = pipe
        # The worker's handlers add the time, level and logger; the message is
        # all to make text here (basicConfig would add its own prefix).
        self.setFormatter(logging.Formatter("%(message)s"))

    def enqueue(self, record: logging.LogRecord) -> None:
        self._pipe.send("log", record)


def _call(callback: Callable[..., None], *args: object) -> None:
    callback(*args)


def _relay(pipe: PipeEnd, inbox: Inbox, receiver: PipeReceiver) -> None:
    """The worker's calls, made on the inbox, until the pipe closes. Closed with
    no stop asked, the worker was killed: nobody can be served any more."""
    while (message := pipe.recv()) is not None:
        name, args = message
        getattr(inbox, name)(*args)
    if inbox.stopping:
        return
    if not receiver.serving:  # a model still loading is not worth waiting for
        os._exit(1)
    log.warning("the worker's process is gone: stopping the engine")
    inbox.stop()
    exit_later = threading.Timer(ORPHAN_SECONDS, os._exit, (1,))
    exit_later.daemon = True
    exit_later.start()


def serve(conn: Connection, stream_interval: int, log_level: int, turns: TurnTimes) -> None:
    """The child's entry point: once the worker sends ("start", config), serve
    that model through `conn` until stopped, marking its turns in `turns`
    (shared with the worker, whose watchdog reads them)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # Those sent while it imported (a Ctrl-C to the terminal's group) are dropped now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    pipe = PipeEnd(conn)
    receiver = PipeReceiver(pipe)
    logging.basicConfig(level=log_level, handlers=[PipeLogs(pipe)], force=True)
    # While the worker finds the model and loads its tokenizer.
    try:
        start_up.import_mlx()
    except Exception:  # noqa: BLE001 - the same import fails in `EngineCore.run`, which says why
        pass
    message = pipe.recv()
    if message is None or message[0] != "start":  # stopped (or gone) before it started
        os._exit(0)
    inbox = Inbox()
    relay = threading.Thread(
        target=_relay, args=(pipe, inbox, receiver), name="engine-inbox", daemon=True
    )
    relay.start()
    publisher = StreamPublisher(_call, receiver, stream_interval)
    EngineCore(message[1][0], inbox, publisher, turns).run()
    logging.shutdown()
    # As `cli.exit_process`: MLX's per-thread state must not meet interpreter finalization.
    os._exit(0)
