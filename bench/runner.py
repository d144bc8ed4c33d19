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

from bench import peer
from bench.grpc_client import run_closed_loop
from bench.stats import LevelResult, RequestRecord, summarize
from bench.workers import WorkerProcess, free_port, ours_command, two_ranks_command
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


def _span(indices: range) -> str:
    return f"{indices.start}:{indices.stop}"


def _engine_round(opts: Options, level: Level) -> tuple[list[RequestRecord], float, dict]:
    """One round of the raw BatchGenerator in a child process; its JSON comes back on stdout."""
    out = subprocess.run(
        [
            sys.executable, "-m", "bench.engine_raw", "--model", str(opts.model_dir),
            "--workload", json.dumps(opts.workload.to_dict()),
            "--concurrency", str(level.concurrency),
            "--warmup", _span(level.warmup), "--timed", _span(level.timed),
        ],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    data = json.loads(out.stdout)
    return [RequestRecord(**r) for r in data.pop("records")], data.pop("wall_s"), data


def _worker_process(name: str, opts: Options, log: Path) -> tuple[WorkerProcess, dict]:
    """The worker, started, and what the JSON records of it."""
    port = free_port()
    if name == "ours":
        command = ours_command(opts.model_dir, port, opts.workload)
        # Its prompt cache's files stay with the bench's, not in the user's cache,
        # and start empty: no earlier round's or run's entries help this one.
        cache_dir = opts.work_dir / "prompt-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        command += ["--prompt-cache-dir", str(cache_dir), *opts.worker_args]
        env, info = None, {}
    elif name == "2ranks":
        command = two_ranks_command(opts.model_dir, port, opts.workload)
        env, info = None, {}
    else:
        python = opts.peer_python or peer.ensure_peer_python(opts.work_dir / "peer-venv")
        command = peer.peer_command(python, opts.model_dir, port, opts.workload)
        env, info = peer.peer_env(opts.workload), {"versions": peer.peer_versions(python)}
    info["command"] = command
    return WorkerProcess(name, command, port, log, env), info


def _worker_round(
    name: str, opts: Options, level: Level
) -> tuple[list[RequestRecord], float, dict]:
    """One round of one level over gRPC, on a worker started for it and stopped after
    (a paused worker would still hold its accelerator memory)."""
    c, tag = level.concurrency, f"{level.concurrency}-{level.round}"
    log = opts.work_dir / "logs" / f"{name}-c{c}-r{level.round}-{time.strftime('%H%M%S')}.log"
    worker, info = _worker_process(name, opts, log)
    with worker as w:
        started = time.monotonic()
        w.wait_serving(opts.start_timeout_s)
        progress(f"{name}: SERVING after {time.monotonic() - started:.1f}s")
        run_closed_loop(w.address, opts.workload, c, level.warmup, f"w{tag}")
        records, wall = run_closed_loop(w.address, opts.workload, c, level.timed, f"t{tag}")
    info["exit_code"] = w.process.returncode
    return records, wall, info


def run_all(
    opts: Options, on_progress: Callable[[list[LevelResult], dict], None] | None = None
) -> tuple[list[LevelResult], dict]:
    """Every system at every level, interleaved: all systems run round 1 of a
    level, then round 2 in reverse order, and so on, then the next level; each
    level's rounds are pooled. A shared machine's speed drifts over minutes, so
    systems measured minutes apart would compare the drift as well. One
    system that fails is reported as failed and the rest still run;
    `on_progress` sees the results after each level."""
    systems: dict[str, dict] = {name: {} for name in opts.systems}
    results: list[LevelResult] = []
    pooled: dict[str, tuple[list[RequestRecord], float]] = {}
    for level in opts.workload.plan(opts.levels, opts.rounds):
        c = level.concurrency
        order = opts.systems if level.round % 2 == 0 else opts.systems[::-1]
        for name in order:
            if "error" in systems[name]:
                continue
            progress(f"{name} c={c} round {level.round + 1}/{opts.rounds}: "
                     f"{len(level.warmup)} warm-up, {len(level.timed)} timed")  # fmt: skip
            try:
                if name == "engine":
                    records, wall, info = _engine_round(opts, level)
                    stats = {**info.pop("batch_stats"), "round": level.round}
                    systems[name].setdefault("batch_stats", []).append(stats)
                else:
                    records, wall, info = _worker_round(name, opts, level)
            except Exception as exc:  # noqa: BLE001 - reported, then the others run
                progress(f"{name}: FAILED: {exc!r}")
                systems[name]["error"] = repr(exc)
                continue
            systems[name].update(info)
            earlier, earlier_wall = pooled.get(name, ([], 0.0))
            pooled[name] = (earlier + records, earlier_wall + wall)
        if level.round == opts.rounds - 1:
            for name, (records, wall) in pooled.items():
                results.append(summarize(name, c, records, wall))
                progress(results[-1].brief())
            pooled = {}
            if on_progress is not None:
                on_progress(results, systems)
    return results, systems
