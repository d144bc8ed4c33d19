"""The engine loop: drain the inbox, admit, step, report. One thread runs it and owns MLX.

`EngineCore.run()` loads the model, warms it up, then turns the loop until
the inbox says stop or a step fails. It knows nothing of gRPC or asyncio: the
worker runs it behind its gRPC front door, and anything else (a test, a
follower rank) can run it with an `Inbox` and a `Sink` of its own.

Requests wait in the core's waiting room until the memory budget has room
for them (`engine.memory`); a step that still runs out of memory puts the
batch back in the room instead of failing the engine.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from smg_mlx.config import EngineConfig
from smg_mlx.engine.bursts import BurstGatherer
from smg_mlx.engine.handoff import Inbox, Sink
from smg_mlx.engine.memory import (
    MemoryPlanner,
    WaitingRoom,
    is_out_of_memory,
    sequence,
    size,
)
from smg_mlx.engine.types import Event, Memory, Request, StepReport

if TYPE_CHECKING:
    from smg_mlx.engine.batch import Batch

log = logging.getLogger(__name__)

# Out-of-memory errors in a row, each after putting the batch back, before the
# engine gives up.
MAX_OUT_OF_MEMORY_IN_A_ROW = 3


class EngineCore:
    def __init__(self, config: EngineConfig, inbox: Inbox, sink: Sink) -> None:
        self.config = config
        self.inbox = inbox
        self.sink = sink
        self._out_of_memory = 0  # steps that ran out of memory, all told

    def run(self) -> None:
        """Serve until stopped or failed; returns once the batch is released."""
        try:
            # MLX is first imported here, on the thread that will own it.
            from smg_mlx.engine import memory_probe
            from smg_mlx.engine.batch import Batch

            batch = Batch(self.config)
            planner = MemoryPlanner(
                batch.memory,
                memory_probe.budget(self.config.memory_budget),
                max_chunk=self.config.prefill_step_size,
                prefill_rows=self.config.prefill_batch_size,
            )
            self._check_budget(planner)
        except BaseException as exc:  # noqa: BLE001 - reported; the caller decides what to do
            log.exception("engine failed to start")
            self.sink.failed(f"model load failed: {exc!r}")
            return
        self.sink.started(self._memory(batch, planner, WaitingRoom(), 0.0))
        try:
            self._serve(batch, planner)
        except BaseException as exc:  # noqa: BLE001 - reported; every request learns of it
            log.exception("engine failed")
            self.sink.failed(f"engine failure: {exc!r}; the worker must be restarted")
        else:
            self.sink.stopped()
        finally:
            # Released here: MLX objects outliving their thread can abort the process at exit.
            batch.close()

    @staticmethod
    def _check_budget(planner: MemoryPlanner) -> None:
        longest = planner.longest_sequence
        if longest < 2:
            raise RuntimeError(
                f"the memory budget ({size(planner.budget)}) does not hold the model "
                f"({size(planner.model.weights)}) and one short request: raise --memory-budget"
            )
        log.info(
            "memory budget %s: the model takes %s; one request may have up to %d tokens",
            size(planner.budget),
            size(planner.model.weights),
            longest,
        )

    def _serve(self, batch: Batch, planner: MemoryPlanner) -> None:
        inbox, sink = self.inbox, self.sink
        bursts = BurstGatherer(self.config.burst_window_seconds, self.config.prefill_batch_size)
        room = WaitingRoom()
        failures = 0  # out-of-memory errors since the last good step
        while not inbox.stopping:
            requests, aborts = inbox.take()
            events: list[Event] = []
            room.add(requests)
            if aborts:
                gone = [r.key for r in room.remove(aborts)]
                batch.forget_resumed(gone)
                events += [Event(key, finish_reason="abort") for key in gone]
                events += batch.remove(aborts)
            events += self._admit(batch, planner, room)
            seconds, size, prefill = None, 0, 0.0
            if batch.has_work:
                sequences = batch.sequences()
                chunk = planner.chunk(sequences, batch.prefix_cache_bytes)
                prefill = planner.prefill_bytes(sequences, chunk)
                started = time.perf_counter()
                try:
                    stepped = batch.step(chunk)
                except Exception as exc:
                    if not is_out_of_memory(exc) or failures >= MAX_OUT_OF_MEMORY_IN_A_ROW:
                        raise
                    failures += 1
                    self._out_of_memory += 1
                    events += self._put_back(batch, planner, room, exc)
                else:
                    failures = 0
                    seconds = time.perf_counter() - started
                    # Finished sequences' caches went to the prefix cache.
                    batch.shrink_prefix_cache(planner.prefix_allowance(batch.sequences()))
                    finished = sum(e.finish_reason is not None for e in stepped)
                    size = batch.running + finished
                    if finished:
                        bursts.ended(finished)
                    events += stepped
            idle = not batch.has_work and not room
            if events or seconds is not None:
                sink.step(
                    StepReport(
                        events=tuple(events),
                        step_seconds=seconds,
                        batch_size=size,
                        running=batch.running,
                        waiting=batch.waiting,
                        memory=self._memory(batch, planner, room, prefill),
                        idle=idle,
                    )
                )
            if idle:
                inbox.wait()
                bursts.gather(inbox)

    def _admit(self, batch: Batch, planner: MemoryPlanner, room: WaitingRoom) -> list[Event]:
        """Move requests from the waiting room into the batch while the budget
        holds them at their longest, shrinking the prefix cache first; a request
        that cannot fit even alone ends with an error."""
        admitted: list[Request] = []
        events: list[Event] = []
        sequences = batch.sequences()
        while (request := room.peek()) is not None:
            if len(sequences) >= self.config.completion_batch_size:
                break
            if not planner.joins(sequences, sequence(request)):
                if sequences:
                    break  # it waits for memory
                room.pop()
                batch.forget_resumed([request.key])
                events.append(self._too_big(request, planner))
                continue
            sequences = [*sequences, sequence(request)]
            admitted.append(room.pop())
        batch.shrink_prefix_cache(planner.prefix_allowance(sequences))
        return events + batch.admit(admitted)

    @staticmethod
    def _too_big(request: Request, planner: MemoryPlanner) -> Event:
        spec = request.spec
        return Event(
            request.key,
            error=f"the request needs room for {len(spec.prompt) + spec.max_tokens} tokens; "
            f"this worker's memory holds at most {planner.longest_sequence} for one "
            "request: send a shorter prompt or fewer max_tokens",
            out_of_memory=True,
        )

    def _put_back(
        self, batch: Batch, planner: MemoryPlanner, room: WaitingRoom, exc: Exception
    ) -> list[Event]:
        """A step ran out of memory despite the budget: the estimates were short.
        Raise them, and put the batch back in the waiting room in admission order
        (the most recent last: they wait if fewer fit now). A request alone in
        the batch does not fit at all: it ends."""
        planner.learn()
        requests = batch.reset()
        log.warning(
            "out of memory in a step (%s); %d request(s) put back to wait for memory; "
            "estimates now x%.2f",
            exc,
            len(requests),
            planner.safety,
        )
        if len(requests) > 1:
            room.put_back(requests)
            return []
        batch.forget_resumed([r.key for r in requests])
        return [
            Event(
                r.key,
                error=f"the worker ran out of memory running this request alone ({exc}): "
                "send a shorter prompt or fewer max_tokens, or retry on a larger worker",
                out_of_memory=True,
            )
            for r in requests
        ]

    def _memory(
        self, batch: Batch, planner: MemoryPlanner, room: WaitingRoom, prefill: float
    ) -> Memory:
        return Memory(
            budget=planner.budget,
            weights=planner.model.weights,
            kv=batch.kv_bytes,
            prefill=int(prefill),
            prefix_cache=batch.prefix_cache_bytes,
            active=batch.active_memory,
            peak=batch.peak_memory,
            longest_sequence=planner.longest_sequence,
            queued=len(room),
            out_of_memory=self._out_of_memory,
        )
