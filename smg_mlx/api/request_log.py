"""One log line per finished or refused request, with its fields for the JSON log format."""

from __future__ import annotations

import json
import logging

from smg_mlx.api.jobs import Job

log = logging.getLogger("smg_mlx.requests")

# Ids a client chose are logged at most this long, what a refusal told it at most the next.
MAX_LOGGED_ID = 128
MAX_LOGGED_DETAILS = 400
# Statuses that refuse a request for what it asked: the client's to fix. (Not the
# worker's state: UNAVAILABLE while it loads or drains, RESOURCE_EXHAUSTED while it
# is full, which its metrics count, answer every call then.)
REFUSALS = frozenset({"INVALID_ARGUMENT", "ALREADY_EXISTS", "OUT_OF_RANGE", "FAILED_PRECONDITION"})


def bounded(text: str, most: int = MAX_LOGGED_ID) -> str:
    if len(text) <= most:
        return text
    return f"{text[:most]}...({len(text)} characters)"


def _value(value: object) -> str:
    """A field's value as key=value parsers read it: quoted (JSON) where it is
    empty or holds a space, a quote, an equals sign or a backslash."""
    text = str(value)
    if text and not any(c.isspace() or c in '"=\\' for c in text):
        return text
    return json.dumps(text, ensure_ascii=False)


def request_ended(job: Job, outcome: str) -> None:
    """Log what an operator asks about a request: its id, sizes, latency and end."""
    fields = {
        "request_id": bounded(job.request_id),
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
    # (no ttft_ms where no token came: JSON's fields say null)
    text = " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
    log.info("request done %s", text, extra={"fields": fields})


def call_ended(method: str, status: str, details: str | None) -> None:
    """Log a call refused for what it asked (`REFUSALS`), with what the client
    was told: no request line names it else, and its client may not say."""
    if status not in REFUSALS:
        return
    fields = {"method": method, "status": status,
              "details": bounded(details or "", MAX_LOGGED_DETAILS)}  # fmt: skip
    text = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
    log.info("request refused %s", text, extra={"fields": fields})
