"""Client-side helpers for the tests: what a router does, in a few lines."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.workers import bindable, ephemeral_low, free_port
from smg_mlx import __version__
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc
from smg_mlx.health_check import probe

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    chunks: list[pb.GenerateStreamChunk] = field(default_factory=list)
    complete: pb.GenerateComplete | None = None


def request(
    ids: list[int] | None = None,
    *,
    request_id: str = "",
    text: str | None = None,
    stream: bool = True,
    **sampling,
) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    req = pb.GenerateRequest(
        request_id=request_id, sampling_params=pb.SamplingParams(**sampling), stream=stream
    )
    if text is not None:
        req.text = text
    elif ids is not None:
        req.tokenized.input_ids.extend(ids)
    return req


def collect(responses) -> Result:
    """Read a Generate call to its end."""
    result = Result()
    for response in responses:
        if response.HasField("chunk"):
            result.chunks.append(response.chunk)
            result.tokens.extend(response.chunk.token_ids)
        else:
            result.complete = response.complete
            result.tokens.extend(response.complete.output_ids)
    return result


def generate(stub, ids: list[int] | None = None, **kwargs) -> Result:
    return collect(stub.Generate(request(ids, **kwargs), timeout=60))


def abort_after(stub, ids: list[int], n_tokens: int, **settings) -> None:
    """Start a stream and cancel it once `n_tokens` tokens arrived."""
    call = stub.Generate(request(ids, max_tokens=500, ignore_eos=True, **settings), timeout=60)
    seen = 0
    with pytest.raises(grpc.RpcError) as err:
        for response in call:
            seen += len(response.chunk.token_ids)
            if seen >= n_tokens:
                call.cancel()
    assert err.value.code() == grpc.StatusCode.CANCELLED


def prompt(length: int, offset: int = 0) -> list[int]:
    """A deterministic prompt of `length` ordinary token ids."""
    return [10 + (offset * 7 + i * 13) % 300 for i in range(length)]


def rss_mb(pid: int | None = None) -> float:
    """A process's resident memory in MiB (this one's by default)."""
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid or os.getpid())], capture_output=True)
    return int(out.stdout) / 1024


def model_copy(model_dir: Path, out: Path, *, leave_out: str = "", **config) -> Path:
    """`model_dir` linked file by file into `out`, with `config` merged into its
    config.json and the file named `leave_out` left for the caller to add."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name not in (leave_out, "config.json"):
            (out / f.name).symlink_to(f)
    merged = {**json.loads((model_dir / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(merged))
    return out


def free_port_run(count: int) -> int:
    """The first of `count` consecutive loopback ports that nothing listens on, for a
    launcher that numbers its ports up from one (mlx.launch's --starting-port), below the
    kernel's ephemeral range as `free_port()`'s are."""
    low = ephemeral_low()
    for _ in range(100):
        first = random.randrange(10000, low - count)
        if all(bindable(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports below {low}")




# How often `serving_within` asks `smg_mlx.health_check.probe`: while nothing
# listens on the port, each probe also tries a TLS handshake, whose context
# loads the system's certificates (about 50 ms of CPU), so that at wait_until's
# default pace the waiting took most of a core from the worker it waited for.
PROBE_EVERY = 0.25


def serving_within(port: int, seconds: float, rpc_timeout: float = 1) -> bool:
    """Whether the worker on this local port reported SERVING within `seconds`."""
    return wait_until(lambda: probe("127.0.0.1", port, rpc_timeout) is None, seconds,
                      every=PROBE_EVERY)  # fmt: skip


def wait_until(condition: Callable[[], bool], timeout: float = 5.0, every: float = 0.02) -> bool:
    """Whether `condition` came true within `timeout`, asked `every` seconds (a
    condition that runs a command costs CPU that the rest of the run shares)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(every)
    return condition()


class Process:
    """`python -m smg_mlx serve` as a real subprocess."""

    def __init__(
        self,
        tmp_path,
        *args: str,
        port: int | None = None,
        env: dict | None = None,
        session: bool = False,
    ) -> None:
        """`session`: in a process group of its own, as a terminal's job is (its
        children included), which `os.killpg(proc.pid, ...)` signals whole."""
        self.port = port or free_port()
        # Unique even for a worker restarted on the port of an earlier one.
        self.log = tmp_path / f"worker-{self.port}-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smg_mlx", "serve", "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            env=None if env is None else {**os.environ, **env},
            start_new_session=session,
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = mlx_engine_pb2_grpc.MlxEngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def check(self, service: str = "") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def wait_serving(self, timeout: float = 60) -> None:
        grpc.channel_ready_future(self.channel).result(timeout)
        assert wait_until(self._serving, timeout), self.log.read_text()

    def _serving(self) -> bool:
        """SERVING now; a refused check is not yet, unless the worker is gone
        (then its log says why)."""
        try:
            return self.check() == SERVING
        except grpc.RpcError:
            exited = self.proc.poll()
            assert exited is None, f"exited {exited}: {self.log.read_text()}"
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


class Router:
    """`smg launch` in front of workers, as the README says to run it."""

    def __init__(
        self, worker_ports: Sequence[int], model_dir: Path, log: Path, *flags: str
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.worker_ports = set(worker_ports)
        self.proc = subprocess.Popen(
            [
                SMG,
                "launch",
                "--worker-urls",
                *(f"grpc://127.0.0.1:{port}" for port in worker_ports),
                "--model-path",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--health-check-interval-secs",
                "1",
                "--health-failure-threshold",
                "1",
                "--health-success-threshold",
                "1",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                # Tests stop it idle; its default grace makes that take about 5 s.
                "--shutdown-grace-period-secs",
                "0",
                *flags,
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        assert wait_until(self._up, 60), log.read_text()[-3000:]

    def _up(self) -> bool:
        assert self.proc.poll() is None, "the router exited"
        try:
            return urllib.request.urlopen(f"{self.base}/liveness", timeout=2).status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def health(self) -> dict[int, bool]:
        """Each listed worker's health as the router sees it, by port."""
        workers = self.get("/workers")["workers"]
        return {int(w["url"].rsplit(":", 1)[1]): w["is_healthy"] for w in workers}

    def worker_healthy(self) -> bool | None:
        """Whether every worker is registered and healthy; None while the router lists
        none yet. (It registers them one by one: with only some listed, it routes every
        request to those.)"""
        health = self.health()
        if not health:
            return None
        return set(health) == self.worker_ports and all(health.values())

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.base}{path}", timeout=30) as r:
            return json.load(r)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"{self.base}{path}", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:
            exc.msg = f"{exc.msg}: {exc.read().decode(errors='replace')[:500]}"  # the router's why
            raise

    def complete(self, body: dict, seconds: float = 30) -> dict:
        """Its answer to completion `body`, asked again while it has no tokenizer
        for the model yet (it fetches a worker's once it lists the worker
        healthy, answering 503 tokenizer_not_ready, "retry shortly", until
        then: no worker saw the request)."""
        end = time.monotonic() + seconds
        while True:
            try:
                return self.post("/v1/completions", body)
            except urllib.error.HTTPError as err:
                if err.code != 503 or "tokenizer_not_ready" not in err.msg:
                    raise
                assert time.monotonic() < end, f"no tokenizer in the router after {seconds}s"
                time.sleep(0.1)

    def stream(self, path: str, body: dict) -> list[dict]:
        req = urllib.request.Request(
            f"{self.base}{path}",
            json.dumps(
                {**body, "stream": True, "stream_options": {"include_usage": True}}
            ).encode(),
            {"content-type": "application/json"},
        )
        events = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        return events

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def demo_model_cache(cache: Path, model_dir: Path) -> Path:
    """`cache` (for XDG_CACHE_HOME) holding the demo model already, so that `--demo` skips
    the build: `model_dir`, which conftest builds with the demo's settings."""
    demo = cache / "smg-mlx" / f"demo-llama-{__version__}"
    demo.parent.mkdir(parents=True)
    demo.symlink_to(model_dir)
    return cache


def serve(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[int, list[str]]:
    """Run a worker that should stop before serving: its exit code and log lines."""
    done = subprocess.run(
        [sys.executable, "-m", "smg_mlx", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
        cwd=cwd,
    )
    return done.returncode, done.stderr.splitlines()


def remembered_files(tmp_path: Path, folder: str) -> list[Path]:
    """What a worker started by the `restart` fixture remembered in `folder`
    of its cache folder (engine.remembered)."""
    return sorted((tmp_path / "cache" / folder).glob("*.json"))


def memory_in_use() -> int:
    """MLX's memory in use in this process now: a worker's engine runs here
    beside other tests' models and caches, and its peak counts them too, so
    what it takes of its budget is its peak above this, read before it starts."""
    gc.collect()
    return mx.get_active_memory()
