"""The signals that stop a worker, each as SIGTERM does (a drain, then exit 0)."""

from __future__ import annotations

import signal


def stop_signals() -> list[signal.Signals]:
    """SIGTERM (supervisors), SIGINT (Ctrl-C) and SIGHUP (the terminal it runs
    in closed), but SIGHUP only where it is not ignored: under `nohup` the
    operator asked the worker to outlive its terminal."""
    hang_up = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, signal.SIGINT, *hang_up]


def stop_quietly() -> None:
    """Until the event loop takes over (`server.run`), a stop signal ends the
    process with 0 and no traceback, as it does later: there is nothing to drain."""
    for sig in stop_signals():
        signal.signal(sig, _exit_zero)


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)
