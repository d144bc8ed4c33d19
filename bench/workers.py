"""A worker in its own process: start it, wait for SERVING, stop it."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import cores
from bench.workload import Workload

_handed_out: set[int] = set()
_running: set[WorkerProcess] = set()  # started and not stopped yet
_children: set[subprocess.Popen] = set()  # other processes started and not ended yet


def ephemeral_low() -> int:
    """The first of the kernel's ephemeral ports: outgoing connections and binds to
    port 0 take theirs from there up."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; macOS starts at 49152
    return int(ranges.read_text().split()[0]) if ranges.exists() else 49152


def bindable(port: int) -> bool:
    """Whether nothing listens on `port` on loopback now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now and that this process has
    not handed out before, below the kernel's ephemeral range: there an outgoing
    connection (a client, another test's) could take it before the worker binds it, and
    the kernel may offer a just-closed port again at once."""
    low = ephemeral_low()
    for _ in range(1000):
        port = random.randrange(10000, low)
        if port not in _handed_out and bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def ours_command(model_dir: Path, port: int, workload: Workload) -> list[str]:
    """Our worker, run by the bench's own interpreter (the project's venv)."""
    return [
        sys.executable, "-m", "smg_mlx", "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--completion-batch-size", str(workload.completion_batch_size),
        "--prefill-batch-size", str(workload.prefill_batch_size),
        "--log-level", "warning",
    ]  # fmt: skip


def two_ranks_command(model_dir: Path, port: int, workload: Workload) -> list[str]:
    """Our worker with the model split over two ranks on this host, tensor parallel:
    mlx.launch with its default backend (NCCL with a GPU each on CUDA, the ring
    over loopback elsewhere)."""
    here = Path(sys.executable).parent
    launch = shutil.which("mlx.launch", path=os.pathsep.join([str(here), os.environ["PATH"]]))
    if launch is None:
        raise RuntimeError(f"mlx.launch is neither in {here} nor on PATH")
    return [
        launch, "-n", "2", "--starting-port", str(free_port()), "--nccl-port", str(free_port()),
        "--", *ours_command(model_dir, port, workload),
    ]  # fmt: skip


def stop_on_sigterm() -> None:
    """From now on a SIGTERM (a timeout, a supervisor) stops the workers this
    process started, which run in sessions of their own, and then the process:
    at once, since unwinding from the handler through gRPC's core can crash it."""

    def stop(signum: int, frame: object) -> None:
        for worker in list(_running):
            worker.stop()
        for child in list(_children):
            child.kill()  # the raw engine: nothing of its round is kept
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def ended_on_sigterm(process: subprocess.Popen) -> subprocess.Popen:
    """`process`, which a SIGTERM to this one kills too (`stop_on_sigterm`)
    until `forget` says it ended."""
    _children.add(process)
    return process


def forget(process: subprocess.Popen) -> None:
    _children.discard(process)


class WorkerExited(RuntimeError):
    """A worker that exited before serving (`code`: its exit code; code 2, it
    refused its flags or model: the log's last error line says why)."""

    def __init__(self, name: str, code: int, log_path: Path) -> None:
        super().__init__(f"{name} exited with code {code} before serving; see {log_path}")
        self.code, self.log_path = code, log_path

    def reason(self) -> str:
        """The worker's last error line, its level and logger left out (or, where
        it refused its flags before logging, the line that says so)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        errors = [line for line in lines if " ERROR " in line]
        if errors:
            return errors[-1].split(": ", 1)[-1]
        said = [line for line in lines if ": error: " in line]
        return said[-1] if said else str(self)


class WorkerProcess:
    """One worker process; its output goes to `log_path` (read it when it fails)."""

    def __init__(self, name: str, command: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.name = name
        self.command = command
        self.address = f"127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a Ctrl-C of the bench does not reach it first
        )
        _running.add(self)
        cores.pin(self.process.pid)

    def wait_serving(self, timeout_s: float) -> None:
        """Polls grpc.health.v1 until the whole server reports SERVING."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise WorkerExited(self.name, self.process.returncode, self.log_path)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        cores.pin(self.process.pid)  # the threads it has started since
                        return
                except grpc.RpcError:
                    pass  # not listening yet
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not SERVING after {timeout_s:.0f}s; see {self.log_path}")

    def cpu_seconds(self) -> float | None:
        """CPU time its session's processes (an engine process too) have used
        so far; None where /proc cannot say (not Linux)."""
        stats = [fields for _, fields in _session(self.process.pid)]
        return sum(map(_cpu, stats)) if stats else None

    def wait_quiet(self, timeout_s: float, sample_s: float = 0.5, busy: float = 0.1) -> bool:
        """Wait until it uses under `busy` of a CPU over two `sample_s` in a row
        (an idle worker may still be doing work of its own, such as building
        attention shapes; one sample alone may find a busy one starved by a
        loaded host): whether it did within `timeout_s` (True where unknown)."""
        deadline = time.monotonic() + timeout_s
        before, quiet = self.cpu_seconds(), 0
        while before is not None and time.monotonic() < deadline:
            time.sleep(sample_s)
            after = self.cpu_seconds()
            if after is None:
                return True
            quiet = quiet + 1 if after - before < busy * sample_s else 0
            if quiet == 2:
                return True
            before = after
        return before is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM to its whole process group (a launcher's ranks too; graceful:
        nothing is in flight by now), SIGKILL if any of them hangs."""
        group = self.process.pid  # its own session: the group's id is its pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.poll()
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.process.wait()
        self._log.close()
        _running.discard(self)
        return self.process.returncode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def process_cpu_seconds(pid: int) -> float | None:
    """CPU time process `pid` has used so far; None where /proc cannot say
    (not Linux, or it ended)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return None if fields is None else _cpu(fields)


def session_pids(session: int) -> list[int]:
    """The processes of session `session` (a process started in a session of its
    own, and what it started); [] where /proc cannot say."""
    return [pid for pid, _ in _session(session)]


def _session(session: int) -> Iterator[tuple[int, list[str]]]:
    """Each process of `session`, with its stat fields (`_stat_fields`)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None and int(fields[3]) == session:
            yield int(stat.parent.name), fields


def _stat_fields(stat: Path) -> list[str] | None:
    """A /proc/PID/stat's fields after the command's name (None: unreadable)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu(fields: list[str]) -> float:
    """User and system time, in seconds, of a process's stat fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
