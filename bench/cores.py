"""Which CPUs the systems under test run on: the same few for all of them.

A virtual machine's CPUs can run at very different speeds (their host is
shared): timed alike, one vCPU of a GPU machine ran a Python loop in half the
time of another. A host-bound decoding step is Python on one thread, so a
system whose thread landed on a fast vCPU and another's on a slow one would
compare their placement, not the systems. Where there are enough CPUs, every
system under test (the raw engine, our worker, the peer) is pinned to the
same `count`, the fastest of a short timing, and this process (the client,
its gRPC threads) to the others; the systems run in turn, never together.
Where a CPU shares its physical core with another (SMT siblings), the
systems get one CPU of each of `count` cores and their siblings stay idle: a
system of several processes (our worker, its engine) would otherwise slow
its own engine thread, or the client would, through a shared core.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# Fewer CPUs than this and the client would crowd the systems: nothing is pinned.
MIN_CPUS = 8
DEFAULT_COUNT = 4
# The timing: a loop of this many additions per CPU, twice round, the faster kept.
LOOP = 200_000
PASSES = 2


@dataclass(frozen=True)
class Placement:
    systems: tuple[int, ...]
    client: tuple[int, ...]
    loop_ms: dict[int, float]  # each CPU's time for the loop
    idle: tuple[int, ...] = ()  # the systems' CPUs' SMT siblings, left to nobody

    def describe(self) -> str:
        times = sorted(self.loop_ms.values())
        return (
            f"systems pinned to CPUs {','.join(map(str, self.systems))}, the client to "
            f"{len(self.client)} others{self._idle()} (a timed loop took "
            f"{times[0]:.1f}-{times[-1]:.1f} ms across the {len(times)} CPUs)"
        )

    def _idle(self) -> str:
        if not self.idle:
            return ""
        return f", their cores' other CPUs {','.join(map(str, self.idle))} idle"

    def to_dict(self) -> dict:
        loop_ms = {str(c): round(t, 2) for c, t in self.loop_ms.items()}
        return {"systems": list(self.systems), "client": list(self.client),
                "idle": list(self.idle), "loop_ms": loop_ms}  # fmt: skip


_placed: Placement | None = None


def _loop_ms(cpu: int) -> float:
    os.sched_setaffinity(0, {cpu})
    started = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i
    return 1e3 * (time.perf_counter() - started)


def place(count: int) -> Placement | None:
    """Pin this process to the CPUs the systems will not use, and remember
    theirs for `pin` (None: `count` is 0 or the machine has too few CPUs, or
    no way to pin). Call before this process starts threads: they inherit it."""
    global _placed
    if count <= 0 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < max(MIN_CPUS, 2 * count):
        return None
    times = {cpu: float("inf") for cpu in allowed}
    try:
        for _ in range(PASSES):
            for cpu in allowed:
                times[cpu] = min(times[cpu], _loop_ms(cpu))
    finally:
        os.sched_setaffinity(0, allowed)
    ranked = sorted(allowed, key=times.__getitem__)
    fastest, idle = _one_per_core(ranked, count, set(allowed))
    client = tuple(cpu for cpu in allowed if cpu not in fastest and cpu not in idle)
    if len(client) < count:  # too few cores to leave siblings idle
        fastest, idle = tuple(sorted(ranked[:count])), ()
        client = tuple(cpu for cpu in allowed if cpu not in fastest)
    os.sched_setaffinity(0, client)
    _placed = Placement(fastest, client, times, idle)
    return _placed


def _siblings(cpu: int) -> set[int]:
    """The CPUs sharing `cpu`'s physical core, itself included (as the kernel tells)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            listed = f.read().strip()
    except OSError:
        return {cpu}
    found = set()
    for part in listed.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return found | {cpu}


def _one_per_core(
    ranked: list[int], count: int, allowed: set[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The first `count` of `ranked` on cores of their own, and their siblings."""
    chosen: list[int] = []
    idle: set[int] = set()
    for cpu in ranked:
        if len(chosen) < count and cpu not in idle:
            chosen.append(cpu)
            idle |= (_siblings(cpu) & allowed) - {cpu}
    return tuple(sorted(chosen)), tuple(sorted(idle - set(chosen)))


def placed() -> Placement | None:
    """What `place` chose (None: nothing is pinned)."""
    return _placed


def pin(pid: int) -> None:
    """Pin every thread of process `pid` to the systems' CPUs, if `place` chose
    them (threads it starts later inherit its main thread's)."""
    if _placed is None:
        return
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    for task in tasks:
        try:
            os.sched_setaffinity(task, _placed.systems)
        except OSError:  # the thread ended meanwhile
            pass
