"""Runs each system in turn (never two at once) over the same levels and prompts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import peer
from bench.grpc_client import run_closed_loop
from bench.profiling import PySpy, ThreadCpu, summarize, thread_names
from bench.stats import LevelResult
from bench.stats import summarize as summarize_level
from bench.workers import WorkerProcess, free_port, ours_command
from bench.workload import Workload


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
    profile_dir: Path | None = None
    start_timeout_s: float = 600.0
    ours_switch_interval: float | None = None
    ours_args: list[str] = field(default_factory=list)  # extra flags for our worker


def run_engine(opts: Options) -> tuple[list[LevelResult], dict]:
    """The raw BatchGenerator in a child process; its JSON comes back on stdout."""
    progress("engine: raw BatchGenerator, one thread, no server")
    out = subprocess.run(
        [
            sys.executable, "-m", "bench.engine_raw", "--model", str(opts.model_dir),
            "--workload", json.dumps(opts.workload.to_dict()),
            "--concurrency", ",".join(map(str, opts.levels)),
        ],
        check=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    data = json.loads(out.stdout)
    info = {k: data[k] for k in ("device", "mlx_lm", "batch_stats")}
    return [LevelResult(**level) for level in data["levels"]], info


def _worker(name: str, opts: Options) -> tuple[WorkerProcess, dict]:
    port = free_port()
    log = opts.work_dir / "logs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    if name == "ours":
        command = ours_command(opts.model_dir, port, opts.workload, opts.ours_switch_interval)
        command += opts.ours_args
        env, info = None, {}
    else:
        python = opts.peer_python or peer.ensure_peer_python(opts.work_dir / "peer-venv")
        command = peer.peer_command(python, opts.model_dir, port, opts.workload)
        env, info = peer.peer_env(opts.workload), {"versions": peer.peer_versions(python)}
    info["command"] = command
    return WorkerProcess(name, command, port, log, env), info


def run_worker(name: str, opts: Options) -> tuple[list[LevelResult], dict]:
    """Start the worker, run every level against it over gRPC, stop it."""
    worker, info = _worker(name, opts)
    progress(f"{name}: starting {' '.join(worker.command)}")
    results = []
    with worker:
        started = time.monotonic()
        worker.wait_serving(opts.start_timeout_s)
        progress(f"{name}: SERVING after {time.monotonic() - started:.1f}s")
        for level in opts.workload.plan(opts.levels):
            c = level.concurrency
            progress(f"{name} c={c}: {len(level.warmup)} warm-up, {len(level.timed)} timed")
            run_closed_loop(worker.address, opts.workload, c, level.warmup, f"w{c}")
            spy = cpu = None
            if opts.profile_dir is not None and name == "ours":
                spy = PySpy(worker.pid, opts.profile_dir / f"{name}-c{c}.txt")
                cpu = ThreadCpu(worker.pid)
            client_cpu = time.process_time()
            records, wall = run_closed_loop(worker.address, opts.workload, c, level.timed, f"t{c}")
            client_cpu = time.process_time() - client_cpu
            if spy is not None:
                cpu_end = cpu.snapshot()
                raw = spy.stop()
                summary = raw.with_suffix(".summary.txt")
                threads = cpu.report(cpu_end, thread_names(raw))
                # The load generator shares the machine's cores with the worker.
                threads += f"\n    {100 * client_cpu / wall:6.1f}%  (the bench client process)"
                summary.write_text(threads + "\n" + summarize(raw) + "\n")
                progress(f"{name} c={c}: profile in {raw}, summary in {summary}")
            results.append(summarize_level(name, c, records, wall))
            progress(results[-1].brief())
    info["exit_code"] = worker.process.returncode
    return results, info


def run_all(
    opts: Options, on_progress: Callable[[list[LevelResult], dict], None] | None = None
) -> tuple[list[LevelResult], dict]:
    """Every system in turn. One that fails is reported as failed and the rest
    still run (one broken worker must not cost the others' numbers);
    `on_progress` sees the results after each system."""
    results: list[LevelResult] = []
    systems: dict[str, dict] = {}
    for name in opts.systems:
        try:
            if name == "engine":
                level_results, info = run_engine(opts)
            else:
                level_results, info = run_worker(name, opts)
        except Exception as exc:  # noqa: BLE001 - reported, then the next system runs
            progress(f"{name}: FAILED: {exc!r}")
            level_results, info = [], {"error": repr(exc)}
        results += level_results
        systems[name] = info
        if on_progress is not None:
            on_progress(results, systems)
    return results, systems
