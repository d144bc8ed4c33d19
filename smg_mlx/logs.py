"""The worker's log formats: plain text or one JSON object per line.

Log lines carry what clients sent (request ids, for one), so neither format
lets a message span lines: a request id with a newline in it cannot forge a
line of its own.
"""

from __future__ import annotations

import json
import logging
import sys

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _escaped(text: str) -> str:
    """Control characters and line separators written as escapes (`\\n`, `\\u2028`)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


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
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self._rank,
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)  # escapes every control and non-ASCII character


def configure(level: str, format_name: str, rank: int | None = None) -> None:
    """Send the worker's logs to stderr in the chosen format; `rank`: which of
    several processes serving one model this one is."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = JsonFormatter if format_name == "json" else TextFormatter
    handler.setFormatter(formatter(rank))
    logging.basicConfig(level=level.upper(), handlers=[handler])
