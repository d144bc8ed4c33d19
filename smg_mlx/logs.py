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

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = _escaped(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a request line carries its fields as keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)  # escapes every control and non-ASCII character


def configure(level: str, format_name: str) -> None:
    """Send the worker's logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if format_name == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
