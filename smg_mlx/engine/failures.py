"""What becomes of requests when they cannot run, or a step fails (engine thread only).

A request too large for the memory budget ends at once, saying what would
fit. A step that ran out of memory despite the budget puts its batch back in
the waiting room (the estimates were short: they grow first), and fewer
requests run at once until steps have succeeded for a while (something else
may hold the device's memory: `Scheduler.shed`); alone in the batch, the
request cannot run and ends. Any other failure ends the step's
requests with an error a client may retry, and the batch starts over.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from smg_mlx.engine.memory.planner import MemoryPlanner
from smg_mlx.engine.schedule.scheduler import Scheduler
from smg_mlx.engine.types import Event, Failure, Request
from smg_mlx.logs import counted, error_line

if TYPE_CHECKING:
    from smg_mlx.engine.batch.batch import Batch

log = logging.getLogger(__name__)


def too_big(request: Request, planner: MemoryPlanner) -> Event:
    """The end of a request no memory this worker has would hold."""
    spec = request.spec
    return Event(
        request.key,
        error=f"the request needs room for {len(spec.prompt) + spec.max_tokens} tokens; "
        f"this worker's memory holds at most {planner.longest_sequence} for one "
        "request: send a shorter prompt or fewer max_tokens",
        failure=Failure.TOO_BIG,
    )


def end_batch(batch: Batch, exc: Exception) -> list[Event]:
    """A step failed: its requests end with an error, and the batch starts over."""
    requests = batch.reset()
    batch.forget_resumed([r.key for r in requests])
    log.exception(
        "a step failed; its %s end with an error and the batch starts over",
        counted(len(requests), "request"),
    )
    return [
        Event(
            r.key,
            error=f"the worker failed in a step running this request "
            f"({error_line(exc)}); it can be retried",
            failure=Failure.STEP,
        )
        for r in requests
    ]


def put_back(batch: Batch, scheduler: Scheduler, exc: Exception) -> list[Event]:
    """A step ran out of memory despite the budget: the estimates were short.
    Raise them, and put the batch back in the waiting room in admission order
    (the most recent last: they wait if fewer fit now). A request alone in
    the batch does not fit at all: it ends."""
    scheduler.planner.learn()
    requests = batch.reset()
    if len(requests) > 1:
        cap = scheduler.shed(len(requests))
        log.warning(
            "out of memory in a step (%s); %s put back to wait for memory; estimates now "
            "x%.2f, and at most %s run at once until steps succeed again", exc,
            counted(len(requests), "request"), scheduler.planner.safety, cap,
        )  # fmt: skip
        scheduler.put_back(requests)
        return []
    log.warning("out of memory in a step (%s) running one request alone: it ends", exc)
    batch.forget_resumed([r.key for r in requests])
    return [
        Event(
            r.key,
            error=f"the worker ran out of memory running this request alone ({exc}): "
            "send a shorter prompt or fewer max_tokens, or retry on a larger worker",
            failure=Failure.OUT_OF_MEMORY,
        )
        for r in requests
    ]
