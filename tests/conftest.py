"""Shared fixtures: random-weight models on disk and workers on loopback ports."""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from smg_mlx.config import EngineConfig, ServerConfig
from smg_mlx.demo_model import build_model
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc
from smg_mlx.server import StartupError, Worker

from family_models import FAMILIES, build_family_models
from helpers import Process

REPO = Path(__file__).resolve().parent.parent

# Workers the tests start keep their prompt caches (and anything else they would
# put in the user's cache directory) here.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="smg-mlx-tests-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


# Files whose tests each take tens of seconds (an install in a fresh virtualenv,
# several ranks, a bench run): they go first, so that none is left running alone
# at the end of a run while the other test processes have nothing left to take.
SLOW_FILES = ("test_package.py", "test_bench_kv_formats.py", "test_parallel.py", "test_readme.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in SLOW_FILES)  # (a stable sort)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the test models are built: one folder for all of a run's processes
    (pytest-xdist's workers share the run's temporary root), so each model is
    built once a run (each build is a child process of a few seconds)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"


@contextmanager
def building(out: Path) -> Iterator[None]:
    """Held while `out` is built: the run's other test processes, which start
    by asking for the same models, wait for the one build instead of each
    running its own (a child process of seconds on the same cores)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_once(out: Path, args: list[str] | None = None) -> Path:
    """`build_model(out, args)`, built by one test process of the run."""
    with building(out):
        return build_model(out, args or [])


@pytest.fixture(scope="session")
def model_dir(models_root: Path) -> Path:
    """The regression model: a llama whose rope frequencies are computed lazily (llama3)."""
    return build_once(models_root / "tiny-llama3")


@pytest.fixture(scope="session")
def other_model_dir(models_root: Path) -> Path:
    """The regression model's shapes and files with other weights (another seed)."""
    return build_once(models_root / "tiny-llama3-seed1", ["--seed", "1"])


@pytest.fixture(scope="session")
def short_model_dir(models_root: Path) -> Path:
    """The same shapes with a 64-token context, to reach the context end quickly."""
    return build_once(models_root / "tiny-ctx64", ["--context-length", "64"])


@pytest.fixture(scope="session")
def family_model(models_root: Path):
    """A tiny random-weight model of an mlx-lm family (tests/family_models.py): all
    the families are built at the first call of a run, by one child process."""
    root = models_root / "families"

    def model(family: str) -> Path:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
        with building(root):
            build_family_models(root, sorted(FAMILIES))
        return root / family

    return model


class RunningWorker:
    """A Worker on its own event loop thread, as in production but in-process."""

    def __init__(self, config: ServerConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.worker: Worker = self.call(self._create(config))
        self.call(self.worker.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.worker.port}")
        self.stub = mlx_engine_pb2_grpc.MlxEngineStub(self.channel)
        self.exit_code: int | None = None

    @staticmethod
    async def _create(config: ServerConfig) -> Worker:
        return Worker(config)

    def call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def active_requests(self) -> int:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest()).active_requests

    def stop(self, hang_up: bool = True) -> int:
        """`hang_up`: the client's channel closes first, so the calls still open
        end as disconnects; else they stay open through the stop, as a
        router's would, and only the grace ends them."""
        if self.exit_code is None:
            if hang_up:
                self.channel.close()
            self.exit_code = self.call(self.worker.shutdown())
            self.channel.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        return self.exit_code


def worker_config(model: Path, **overrides) -> ServerConfig:
    engine = {k: overrides.pop(k) for k in list(overrides) if hasattr(EngineConfig, k)}
    base = ServerConfig(engine=EngineConfig(model_path=model), port=0)
    return replace(base, engine=replace(base.engine, **engine), **overrides)


@pytest.fixture
def refused(caplog, capfd):
    """Start a worker in-process that must refuse to start, for tests of what is
    refused rather than of the process (a subprocess costs seconds; a served one
    is test_startup_errors' test_an_unknown_model_family_is_one_line): the
    StartupError whose message `serve` logs as its error line and whose exit code
    it ends with (server.run). Checked as test_startup_errors' `one_error` checks a
    process's log: the refusal is the only error, on one line, and nothing printed
    a traceback."""
    from transformers.utils import logging as transformers_logging

    async def start(config: ServerConfig) -> StartupError:
        worker = Worker(config)
        try:
            await worker.start()
        except StartupError as refusal:
            worker.engine.stop()  # (as server.run does)
            return refusal
        await worker.shutdown()
        pytest.fail(f"a worker on {config.engine.model_path} started")

    def run(model: Path, **overrides) -> StartupError:
        caplog.clear()
        # transformers' warnings are not the worker's: its command line silences them
        # (TRANSFORMERS_VERBOSITY, read at import: too late here).
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        loop = asyncio.new_event_loop()
        try:
            refusal = loop.run_until_complete(start(worker_config(model, **overrides)))
        finally:
            loop.close()
            transformers_logging.set_verbosity(verbosity)
        printed = capfd.readouterr().err
        assert "\n" not in str(refusal), str(refusal)
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors and not any(r.exc_info for r in caplog.records), errors
        assert "Traceback" not in printed, printed
        return refusal

    return run


@pytest.fixture
def start_worker() -> Iterator:
    """Start workers with custom settings; all are stopped at the end of the test."""
    started: list[RunningWorker] = []

    def start(model: Path, **overrides) -> RunningWorker:
        started.append(RunningWorker(worker_config(model, **overrides)))
        return started[-1]

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def restart(start_worker, tmp_path, caplog):
    """Start a worker on a model, with a cache folder of this test's own, and
    stop it (a restart follows); the log of that start."""
    caplog.set_level(logging.INFO, "smg_mlx")

    def start(model: Path, **overrides) -> str:
        caplog.clear()
        overrides = {"prompt_cache_dir": tmp_path / "cache", "prompt_cache_disk_bytes": 0,
                     **overrides}  # fmt: skip
        running = start_worker(model, **overrides)
        running.stop()
        return caplog.text

    return start


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[RunningWorker]:
    """A worker with default settings on the regression model, shared by a module."""
    running = RunningWorker(worker_config(model_dir))
    yield running
    running.stop()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    """Start `python -m smg_mlx serve` subprocesses; all are killed at the end."""
    procs = []

    def start(*args: str, port: int | None = None) -> Process:
        procs.append(Process(tmp_path, *args, port=port))
        return procs[-1]

    yield start
    for p in procs:
        p.close()
