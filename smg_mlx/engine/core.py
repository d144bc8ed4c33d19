"""The engine loop: drain the inbox, admit, step, report. One thread runs it and owns MLX.

`EngineCore.run()` loads the model, warms it up, then turns the loop until
the inbox says stop or a step fails. It knows nothing of gRPC or asyncio: the
worker runs it behind its gRPC front door, and anything else (a test, a
follower rank) can run it with an `Inbox` and a `Sink` of its own.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from smg_mlx.config import EngineConfig
from smg_mlx.engine.bursts import BurstGatherer
from smg_mlx.engine.handoff import Inbox, Sink
from smg_mlx.engine.types import Event, StepReport

if TYPE_CHECKING:
    from smg_mlx.engine.batch import Batch

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, inbox: Inbox, sink: Sink) -> None:
        self.config = config
        self.inbox = inbox
        self.sink = sink

    def run(self) -> None:
        """Serve until stopped or failed; returns once the batch is released."""
        try:
            # MLX is first imported here, on the thread that will own it.
            from smg_mlx.engine.batch import Batch

            batch = Batch(self.config)
        except BaseException as exc:  # noqa: BLE001 - reported; the caller decides what to do
            log.exception("engine failed to start")
            self.sink.failed(f"model load failed: {exc!r}")
            return
        self.sink.started()
        try:
            self._serve(batch)
        except BaseException as exc:  # noqa: BLE001 - reported; every request learns of it
            log.exception("engine failed")
            self.sink.failed(f"engine failure: {exc!r}; the worker must be restarted")
        else:
            self.sink.stopped()
        finally:
            # Released here: MLX objects outliving their thread can abort the process at exit.
            batch.close()

    def _serve(self, batch: Batch) -> None:
        inbox, sink = self.inbox, self.sink
        bursts = BurstGatherer(self.config.burst_window_seconds, self.config.prefill_batch_size)
        while not inbox.stopping:
            requests, aborts = inbox.take()
            events: list[Event] = []
            if aborts:
                events += [Event(r.key, finish_reason="abort") for r in requests if r.key in aborts]
                requests = [r for r in requests if r.key not in aborts]
                events += batch.remove(aborts)
            if requests:
                events += batch.admit(requests)
            seconds, size = None, 0
            if batch.has_work:
                started = time.perf_counter()
                stepped = batch.step()
                seconds = time.perf_counter() - started
                finished = sum(e.finish_reason is not None for e in stepped)
                size = batch.running + finished
                if finished:
                    bursts.ended(finished)
                events += stepped
            if events or seconds is not None:
                sink.step(
                    StepReport(
                        events=tuple(events),
                        step_seconds=seconds,
                        batch_size=size,
                        running=batch.running,
                        waiting=batch.waiting,
                        prefix_cache_bytes=batch.prefix_cache_bytes,
                        idle=not batch.has_work,
                    )
                )
            if not batch.has_work:
                inbox.wait()
                bursts.gather(inbox)
