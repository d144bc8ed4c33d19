"""Runs the systems in turn (never two at once), level by level, on the same prompts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import cores, peer
from bench.grpc_client import run_closed_loop
from bench.long_prompts import metrics
from bench.stats import LevelResult, RequestRecord, summarize
from bench.workers import (
    WorkerProcess,
    ended_on_sigterm,
    forget,
    free_port,
    ours_command,
    two_ranks_command,
)
from bench.workload import Level, Workload


def progress(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Options:
    systems: list[str]
    levels: list[int]
    workload: Workload
    model_dir: Path
    work_dir: Path  # .bench: the peer venv, worker logs
    peer_python: Path | None = None  # an interpreter that already has the peer
    start_timeout_s: float = 600.0
    rounds: int = 1  # interleaved rounds per level, pooled
    worker_args: tuple[str, ...] = ()  # more flags for ours
    # One worker per system, and one engine process, for every level and round
    # (the gate: a worker as it runs for hours), instead of a fresh one per round.
    one_worker: bool = False


def _span(indices: range) -> str:
    return f"{indices.start}:{indices.stop}"


class EngineProcess:
    """The raw engine's child process (`bench.engine_raw`): one round per call."""

    def __init__(self, opts: Options) -> None:
        self._process = ended_on_sigterm(subprocess.Popen(
            [sys.executable, "-m", "bench.engine_raw", "--model", str(opts.model_dir),
             "--workload", json.dumps(opts.workload.to_dict())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        ))  # fmt: skip
        cores.pin(self._process.pid)
        self._pinned = False  # its threads, once it has started them

    def round(self, level: Level) -> tuple[list[RequestRecord], float, dict]:
        asked = {"concurrency": level.concurrency, "warmup": _span(level.warmup),
                 "timed": _span(level.timed)}  # fmt: skip
        assert self._process.stdin is not None and self._process.stdout is not None
        if not self._pinned:
            cores.pin(self._process.pid)
            self._pinned = True
        self._process.stdin.write(json.dumps(asked) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process ended (exit code {self._process.wait()})")
        data = json.loads(line)
        return [RequestRecord(**r) for r in data.pop("records")], data.pop("wall_s"), data

    def stop(self) -> int:
        if self._process.stdin is not None:
            self._process.stdin.close()
        code = self._process.wait()
        forget(self._process)
        return code


def _engine_round(
    opts: Options, level: Level, kept: dict[str, EngineProcess]
) -> tuple[list[RequestRecord], float, dict]:
    """One round of the raw BatchGenerator, in the engine process kept in
    `kept` (started there on first use) or else in one started for it."""
    if opts.one_worker and "engine" not in kept:
        kept["engine"] = EngineProcess(opts)
    engine = kept["engine"] if opts.one_worker else EngineProcess(opts)
    try:
        return engine.round(level)
    finally:
        if not opts.one_worker:
            engine.stop()


def _worker_process(name: str, opts: Options, log: Path) -> tuple[WorkerProcess, dict]:
    """The worker, started, and what the JSON records of it."""
    port = free_port()
    if name == "ours":
        command = ours_command(opts.model_dir, port, opts.workload)
        metrics_port = free_port()
        command += ["--metrics-port", str(metrics_port)]
        # Its prompt cache's files stay with the bench's, not in the user's cache,
        # and start empty: no earlier round's or run's entries help this one.
        cache_dir = opts.work_dir / "prompt-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        command += ["--prompt-cache-dir", str(cache_dir), *opts.worker_args]
        env, info = None, {"metrics_port": metrics_port}
    elif name == "2ranks":
        command = two_ranks_command(opts.model_dir, port, opts.workload)
        env, info = None, {}
    else:
        python = opts.peer_python or peer.ensure_peer_python(opts.work_dir / "peer-venv")
        command = peer.peer_command(python, opts.model_dir, port, opts.workload)
        env, info = peer.peer_env(opts.workload), {"versions": peer.peer_versions(python)}
    info["command"] = command
    return WorkerProcess(name, command, port, log, env), info


def _started(name: str, opts: Options, tag: str) -> tuple[WorkerProcess, dict]:
    """The worker, SERVING, and what the JSON records of it."""
    log = opts.work_dir / "logs" / f"{name}-{tag}-{time.strftime('%H%M%S')}.log"
    worker, info = _worker_process(name, opts, log)
    started = time.monotonic()
    try:
        worker.wait_serving(opts.start_timeout_s)
    except BaseException:
        worker.stop()
        raise
    progress(f"{name}: SERVING after {time.monotonic() - started:.1f}s")
    return worker, info


def _steps(info: dict) -> tuple[float, float, float] | None:
    """Our worker's steps so far (see `steps_so_far`; None for a worker without metrics)."""
    port = info.get("metrics_port")
    return None if port is None else steps_so_far(port)


def steps_so_far(port: int) -> tuple[float, float, float] | None:
    """Our worker's steps so far: how many, their seconds and their rows, from
    its metrics on `port` (None where unread)."""
    step = "smg_mlx_engine_step_duration_seconds"
    values = metrics(port, f"{step}_count", f"{step}_sum", "smg_mlx_engine_batch_size_sum")
    return None if None in values else tuple(values)


def _worker_round(
    name: str, opts: Options, level: Level, kept: dict[str, tuple[WorkerProcess, dict]]
) -> tuple[list[RequestRecord], float, dict]:
    """One round of one level over gRPC, on the worker kept in `kept` (started
    there on first use) or else on one started for it and stopped after (a
    paused worker would still hold its accelerator memory)."""
    c, tag = level.concurrency, f"{level.concurrency}-{level.round}"
    if opts.one_worker and name not in kept:
        kept[name] = _started(name, opts, "all")
    worker, info = kept[name] if opts.one_worker else _started(name, opts, f"c{c}-r{level.round}")
    try:
        run_closed_loop(worker.address, opts.workload, c, level.warmup, f"w{tag}")
        before = _steps(info)
        records, wall = run_closed_loop(worker.address, opts.workload, c, level.timed, f"t{tag}")
        if before is not None and (after := _steps(info)) is not None:
            steps, seconds, rows = (b - a for a, b in zip(before, after, strict=True))
            stats = {"concurrency": c, "round": level.round, "steps": steps,
                     "rows_per_step": rows / max(1, steps)}  # fmt: skip
            stats["step_ms"] = 1e3 * seconds / max(1, steps)
            stats["stepping_share"] = seconds / wall  # the rest: the loop, gRPC, waiting
            progress(f"{name} c={c}: {steps:.0f} steps of {stats['step_ms']:.1f} ms, "
                     f"{stats['rows_per_step']:.1f} rows each, stepping "
                     f"{100 * stats['stepping_share']:.0f}% of the time")  # fmt: skip
            info.setdefault("step_stats", []).append(stats)
    finally:
        if not opts.one_worker:
            info["exit_code"] = worker.stop()
    return records, wall, info


# How long a kept worker may take to go quiet before the engine's round (`_quiet`).
QUIET_TIMEOUT_S = 120.0


def _quiet(kept: dict[str, tuple[WorkerProcess, dict]]) -> None:
    """The kept workers idle before the engine's round: the systems run in turn,
    and a worker that has just served goes on with work of its own for a while
    (on CUDA, building the attention shapes prompts will meet), which would slow
    the engine's round on the CPUs and the device they share."""
    for worker, _ in kept.values():
        if not worker.wait_quiet(QUIET_TIMEOUT_S):
            progress(f"{worker.name} still busy after {QUIET_TIMEOUT_S:.0f}s idle: the "
                     "engine's round runs beside it")  # fmt: skip


def run_all(
    opts: Options, on_progress: Callable[[list[LevelResult], dict], None] | None = None
) -> tuple[list[LevelResult], dict]:
    """Every system at every level, interleaved: all systems run round 1 of a
    level, then round 2 in reverse order, and so on, then the next level,
    whose first round starts where this one's would have next; each level's
    rounds are pooled. A shared machine's speed drifts over minutes, so
    systems measured minutes apart would compare the drift as well, and one
    that always went first would draw a level's first minutes every time. One
    system that fails is reported as failed and the rest still run;
    `on_progress` sees the results after each level."""
    kept: dict[str, tuple[WorkerProcess, dict]] = {}  # with `one_worker`
    engine: dict[str, EngineProcess] = {}  # with `one_worker`
    try:
        return _run_levels(opts, on_progress, kept, engine)
    finally:
        for process in engine.values():
            process.stop()
        for worker, info in kept.values():
            info["exit_code"] = worker.stop()


def _run_levels(
    opts: Options,
    on_progress: Callable[[list[LevelResult], dict], None] | None,
    kept: dict[str, tuple[WorkerProcess, dict]],
    engine: dict[str, EngineProcess],
) -> tuple[list[LevelResult], dict]:
    systems: dict[str, dict] = {name: {} for name in opts.systems}
    results: list[LevelResult] = []
    pooled: dict[str, tuple[list[RequestRecord], float, tuple[float, ...]]] = {}
    for turn, level in enumerate(opts.workload.plan(opts.levels, opts.rounds)):
        c = level.concurrency
        order = opts.systems if turn % 2 == 0 else opts.systems[::-1]
        for name in order:
            if "error" in systems[name]:
                continue
            progress(f"{name} c={c} round {level.round + 1}/{opts.rounds}: "
                     f"{len(level.warmup)} warm-up, {len(level.timed)} timed")  # fmt: skip
            try:
                if name == "engine":
                    _quiet(kept)
                    records, wall, info = _engine_round(opts, level, engine)
                    stats = {**info.pop("batch_stats"), "round": level.round}
                    steps = stats["decode_steps"]
                    step_ms = 1e3 * wall / max(1, steps)
                    progress(f"engine c={c}: {steps} decoding steps of {step_ms:.1f} ms, "
                             f"{stats['tokens_per_step']:.1f} tokens each")  # fmt: skip
                    systems[name].setdefault("batch_stats", []).append(stats)
                else:
                    records, wall, info = _worker_round(name, opts, level, kept)
            except Exception as exc:  # noqa: BLE001 - reported, then the others run
                progress(f"{name}: FAILED: {exc!r}")
                systems[name]["error"] = repr(exc)
                continue
            systems[name].update(info)
            earlier, earlier_wall, rounds = pooled.get(name, ([], 0.0, ()))
            tok_s = sum(r.tokens for r in records) / wall if wall > 0 else 0.0
            pooled[name] = (earlier + records, earlier_wall + wall, (*rounds, tok_s))
        if level.round == opts.rounds - 1:
            for name, (records, wall, rounds) in pooled.items():
                results.append(summarize(name, c, records, wall, rounds))
                progress(results[-1].brief())
            pooled = {}
            if on_progress is not None:
                on_progress(results, systems)
    return results, systems
