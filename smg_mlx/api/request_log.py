"""One log line per finished request, and the JSON log format (`--log-format json`)."""

from __future__ import annotations

import json
import logging

from smg_mlx.api.jobs import Job

log = logging.getLogger("smg_mlx.requests")


def request_ended(job: Job, outcome: str) -> None:
    """Log what an operator asks about a request: its id, sizes, latency and end."""
    fields = {
        "request_id": job.request_id,
        "prompt_tokens": len(job.spec.prompt),
        "completion_tokens": len(job.tokens),
        "cached_tokens": job.cached_tokens,
        "ttft_ms": (
            None
            if job.first_token_at is None
            else round((job.first_token_at - job.arrived_at) * 1000, 1)
        ),
        "duration_ms": round((job.ended_at - job.arrived_at) * 1000, 1),
        "finish_reason": outcome,
    }
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    log.info("request done %s", text, extra={"fields": fields})


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
        return json.dumps(entry)
