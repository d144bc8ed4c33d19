"""Long prompts sent at once (`--long-prompts 4,8,40`): does the worker survive them?

For each count, a fresh worker with its default flags gets that many streaming
requests of `--long-prompt-tokens` random tokens at the same moment. The
report says how many completed, the errors, the time to first token and the
total time, whether the worker kept reporting SERVING, and the most memory MLX
had allocated (from the worker's metrics) against its budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.grpc_client import stream_one, token_request
from bench.workers import WorkerProcess, free_port
from bench.workload import Workload
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc


def metrics(port: int, *names: str) -> list[float | None]:
    """Values from one read of the worker's /metrics (None: not there, or it
    cannot be read)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    except OSError:
        return [None] * len(names)
    found = dict(line.rsplit(" ", 1) for line in text.decode().splitlines() if line[:1] != "#")
    return [float(found[name]) if name in found else None for name in names]


def metric(port: int, name: str) -> float | None:
    """A value from the worker's /metrics (None if it cannot be read)."""
    return metrics(port, name)[0]


@contextlib.contextmanager
def default_worker(model_dir: Path, work_dir: Path, extra: list[str], tag: str,
                   timeout_s: float) -> Iterator[tuple[WorkerProcess, int]]:  # fmt: skip
    """Our worker with its default flags and `extra`, SERVING, and its metrics port.
    Its prompt cache's disk tier starts empty, in the work folder."""
    port, metrics_port = free_port(), free_port()
    cache_dir = work_dir / f"prompt-cache-{tag}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    command = [
        sys.executable, "-m", "smg_mlx", "serve", "--model", str(model_dir),
        "--port", str(port), "--metrics-port", str(metrics_port),
        "--prompt-cache-dir", str(cache_dir), *extra,
    ]  # fmt: skip
    log = work_dir / "logs" / f"{tag}-{time.strftime('%H%M%S')}.log"
    with WorkerProcess("ours", command, port, log) as worker:
        worker.wait_serving(timeout_s)
        yield worker, metrics_port


def memory_figures(metrics_port: int) -> dict:
    """The most MLX had allocated, and the budget (bytes; None if unread)."""
    return {
        "peak_bytes": metric(metrics_port, "smg_mlx_memory_peak_bytes"),
        "budget_bytes": metric(metrics_port, "smg_mlx_memory_budget_bytes"),
    }


async def watch_health(channel: grpc.aio.Channel, statuses: set[str]) -> None:
    """Polls grpc.health.v1 twice a second until cancelled; adds what it sees."""
    health = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
            statuses.add(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
        except grpc.aio.AioRpcError as exc:
            statuses.add(exc.code().name)
        await asyncio.sleep(0.5)


async def _send_all(address: str, workload: Workload, count: int, tag: str) -> dict:
    """`count` requests at once while health is polled; their outcomes."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
        statuses: set[str] = set()
        watcher = asyncio.ensure_future(watch_health(channel, statuses))
        begin = time.perf_counter()
        records = await asyncio.gather(
            *(
                stream_one(stub, token_request(workload.prompt(i), workload.gen_tokens,
                                               f"{tag}-{i}"), workload.gen_tokens)
                for i in range(count)
            )
        )  # fmt: skip
        wall = time.perf_counter() - begin
        watcher.cancel()
    ttfts = sorted(r.ttft for r in records if r.ttft is not None)
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            key = r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": count,
        "completed": sum(r.error is None for r in records),
        "errors": errors,
        "first_error": next((r.error for r in records if r.error), None),
        "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "total_s": wall,
        "health_seen": sorted(statuses),
    }


def run_long_prompts(
    model_dir: Path, work_dir: Path, counts: list[int], workload: Workload, extra: list[str],
    timeout_s: float,
) -> list[dict]:
    """One fresh worker per count, its default flags and `extra`; the outcome of each."""
    results = []
    for count in counts:
        with default_worker(model_dir, work_dir, extra, f"long-{count}", timeout_s) as (
            worker,
            metrics_port,
        ):
            outcome = asyncio.run(_send_all(worker.address, workload, count, f"long{count}"))
            outcome["alive_after"] = worker.process.poll() is None
            outcome.update(memory_figures(metrics_port))
        outcome["exit_code"] = worker.process.returncode
        outcome["log"] = str(worker.log_path)
        results.append(outcome)
        print(format_row(outcome), file=sys.stderr, flush=True)
    return results


def format_row(r: dict) -> str:
    def gib(n: float | None) -> str:
        return "n/a" if n is None else f"{n / 2**30:.1f}"

    def secs(s: float | None) -> str:
        return "n/a" if s is None else f"{s:.1f}"

    return (
        f"{r['requests']:>4} at once: {r['completed']}/{r['requests']} completed, "
        f"errors {r['errors'] or 'none'}, TTFT p50/max {secs(r['ttft_p50_s'])}/"
        f"{secs(r['ttft_max_s'])} s, total {secs(r['total_s'])} s, health seen "
        f"{'/'.join(r['health_seen'])}, alive after: {r['alive_after']}, "
        f"peak {gib(r['peak_bytes'])} of budget {gib(r['budget_bytes'])} GiB"
    )
