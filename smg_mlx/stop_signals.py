"""The signals that stop a worker, each as SIGTERM does (a drain, then exit 0)."""

from __future__ import annotations

import signal


def stop_signals() -> list[signal.Signals]:
    """SIGTERM (supervisors), SIGINT (Ctrl-C) and SIGHUP (the terminal it runs
    in closed), but SIGHUP only where it is not ignored: under `nohup` the
    operator asked the worker to outlive its terminal."""
    hang_up = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, signal.SIGINT, *hang_up]
