"""The worker's log formats: plain text or one JSON object per line.

Log lines carry what clients sent (request ids, for one), so neither format
lets a message span lines: a request id with a newline in it cannot forge a
line of its own.

In JSON, lines that reach stderr without passing through logging (gRPC's
core reports failed binds and TLS handshakes so, native libraries and
Python's last words too) are made JSON objects by a relay: a child process
reading the process's stderr, since a thread would lose what a crash leaves
unread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from datetime import datetime
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The logger of the line that says the worker is ready (SERVING), shown at any
# --log-level: what an operator, or a script, waits for.
READY = "smg_mlx.ready"


def _escaped(text: str) -> str:
    """Control characters and line separators written as escapes (`\\n`, `\\u2028`)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def host_port(host: str, port: int) -> str:
    """An address as gRPC takes it and a reader expects it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def one_line(text: object) -> str:
    """`text` (an exception, another library's message) on one line, each run
    of whitespace one space: a log line or a status detail must not span lines.
    A line that ends a sentence without a full stop (the next begins with a
    capital) gets one, so that two sentences do not run together."""
    lines = [" ".join(line.split()) for line in str(text).splitlines()]
    joined = ""
    for line in filter(None, lines):
        if joined[-1:].isalnum() and line[0].isupper():
            joined += "."
        joined += f" {line}" if joined else line
    return joined


def format_bytes(n: float) -> str:
    """Bytes for a log line: "1.50 GiB", "12.0 MiB", "3,072.0 TiB"."""
    units = (("TiB", 2**40, ",.1f"), ("GiB", 2**30, ".2f"), ("MiB", 2**20, ".1f"),
             ("KiB", 2**10, ".1f"))  # fmt: skip
    for unit, scale, form in units:
        if abs(n) >= scale:
            return f"{n / scale:{form}} {unit}"
    return f"{n:.0f} B"


def counted(number: int, noun: str, plural: str = "") -> str:
    """`number` with `noun`, plural unless it is 1: "1 request", "3 entries"."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def error_line(exc: BaseException) -> str:
    """`exc` as "Type: message", on one line."""
    return f"{type(exc).__name__}: {one_line(exc)}"


class TextFormatter(logging.Formatter):
    """One line per message; a traceback, written by the worker itself, follows it."""

    def __init__(self, rank: int | None = None) -> None:
        # A model split over several ranks: each line says which one wrote it.
        where = "" if rank is None else f"rank {rank} "
        super().__init__(TEXT_FORMAT.replace("%(name)s", where + "%(name)s"))

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = _escaped(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a request line carries its fields as keys."""

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self._rank = {} if rank is None else {"rank": rank}

    def format(self, record: logging.LogRecord) -> str:
        # ISO 8601 with milliseconds and the UTC offset, as log stores parse it.
        time = datetime.fromtimestamp(record.created).astimezone()
        entry = {
            "time": time.isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self._rank,
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)  # escapes every control and non-ASCII character


# absl's line, as gRPC's core writes it: "E1126 10:33:13.701155 6369 file.cc:83] text".
ABSL_LINE = re.compile(r"([DIWEF])\d{4} [\d:.]+\s+\d+ [^\]]*\] (.*)")
ABSL_LEVELS = {"D": "DEBUG", "I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
_relay: subprocess.Popen | None = None  # kept from the garbage collector


def foreign_line(line: str, formatter: JsonFormatter) -> str:
    """One line written to stderr by something other than logging, as the
    worker's own JSON lines are written."""
    found = ABSL_LINE.fullmatch(line)
    level, logger = (ABSL_LEVELS[found[1]], "grpc") if found else ("WARNING", "stderr")
    record = logging.makeLogRecord(
        {"name": logger, "levelname": level, "msg": found[2] if found else line}
    )
    return formatter.format(record)


def relay(rank: int | None) -> None:
    """The relay's loop: stdin's lines out to stdout as JSON, until every writer
    has gone. Signals are the worker's to act on."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    formatter = JsonFormatter(rank)
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="backslashreplace").rstrip()
        if line:
            sys.stdout.write(foreign_line(line, formatter) + "\n")
            sys.stdout.flush()


def _relay_stderr(rank: int | None) -> TextIO:
    """Point this process's stderr at a relay; returns a stream to the real
    stderr for the worker's own lines, which need no relaying."""
    global _relay
    real = os.dup(2)
    read, write = os.pipe()
    _relay = subprocess.Popen(
        [sys.executable, "-m", "smg_mlx.logs", *([] if rank is None else [str(rank)])],
        stdin=read,
        stdout=real,
        stderr=real,
    )
    os.dup2(write, 2)
    os.close(write)
    os.close(read)
    return os.fdopen(real, "w", buffering=1, errors="backslashreplace")


def configure(level: str, format_name: str, rank: int | None = None) -> None:
    """Send the worker's logs to stderr in the chosen format; `rank`: which of
    several processes serving one model this one is."""
    if format_name == "json":
        handler = logging.StreamHandler(_relay_stderr(rank))
        handler.setFormatter(JsonFormatter(rank))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TextFormatter(rank))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger(READY).setLevel(logging.INFO)
    # grpcio says at debug which event loop each call found: a line a call, nothing to act on.
    logging.getLogger("grpc._cython.cygrpc").setLevel(max(logging.INFO, logging.root.level))


if __name__ == "__main__":
    relay(int(sys.argv[1]) if len(sys.argv) > 1 else None)
