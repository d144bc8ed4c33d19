"""Two worker processes behind one `smg launch`: data parallel is the router's job."""

from __future__ import annotations

import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_metrics import scrape

from bench.workers import free_port
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from conftest import build_once
from helpers import SMG, Router, prompt, request, wait_until

pytestmark = pytest.mark.skipif(SMG is None, reason="the router (pip install smg) is not installed")

NAME = "tiny-long"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def long_model(models_root: Path) -> Path:
    """A long context, so that one request can keep a worker busy for the whole test."""
    return build_once(models_root / NAME, ["--context-length", "32768"])


@pytest.fixture
def launch(tmp_path):
    """Put a round-robin router in front of serving workers; it is stopped at the end."""
    routers = []

    def start(workers, model: Path) -> Router:
        for w in workers:
            w.wait_serving()
        ports = [w.port for w in workers]
        routers.append(Router(ports, model, tmp_path / "smg.log", "--policy", "round_robin"))
        assert wait_until(routers[-1].worker_healthy, 30)
        return routers[-1]

    yield start
    for router in routers:
        router.stop()


def served(worker) -> int:
    """Requests the worker ran to max_tokens, from its per-request log lines."""
    return worker.log.read_text().count("finish_reason=length")


def active(worker) -> int:
    return worker.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).active_requests


def complete(router: Router, i: int) -> int:
    """Tokens a completion returned (asked again while the router has no
    tokenizer yet: `Router.complete`)."""
    body = {"model": NAME, "prompt": f"Hello {i}", "max_tokens": 4, **GREEDY}
    return router.complete(body)["usage"]["completion_tokens"]


def test_round_robin_reaches_both_and_a_full_worker_is_skipped(spawn, launch, long_model):
    metrics = free_port()
    # A batch of one and no queue: one running request fills this worker.
    small = spawn(
        "--model", str(long_model), "--completion-batch-size", "1", "--max-pending", "0",
        "--metrics-port", str(metrics),
    )  # fmt: skip
    other = spawn("--model", str(long_model))
    router = launch([small, other], long_model)
    assert [complete(router, i) for i in range(4)] == [4] * 4
    # Two each, unless a health check missed on a busy host left one out for a moment.
    assert wait_until(lambda: served(small) + served(other) == 4)
    reached = served(small), served(other)
    assert min(reached) >= 1, reached

    hold = small.stub.Generate(request(prompt(4), max_tokens=30000, ignore_eos=True), timeout=120)
    next(hold)
    refused = (
        "smg_mlx_grpc_requests_total",
        (("code", "RESOURCE_EXHAUSTED"), ("method", "Generate")),
    )
    before = scrape(metrics).get(refused, 0)
    # More requests than the router's circuit breaker threshold (10) reach the full worker.
    assert [complete(router, i) for i in range(24)] == [4] * 24
    assert scrape(metrics)[refused] - before >= 10
    assert active(small) == 1 and served(small) == reached[0]  # it stayed full, refusing each
    assert wait_until(lambda: served(other) == reached[1] + 24)

    # Refusals do not open the breaker: the worker gets traffic again once it has room.
    hold.cancel()
    assert wait_until(lambda: active(small) == 0)
    assert [complete(router, i) for i in range(4)] == [4] * 4
    assert wait_until(lambda: served(small) > reached[0])


class Load:
    """Clients sending short non-streaming requests through the router until stopped."""

    def __init__(self, router: Router, clients: int) -> None:
        self.router = router
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, client: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                complete(self.router, client * 100_000 + i)
                self.ok += 1
            except (urllib.error.URLError, ConnectionError) as exc:
                self.errors.append(f"{time.monotonic():.3f} {exc!r}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def test_kill_9_under_load_then_every_request_succeeds_and_a_restart_gets_traffic(
    spawn, launch, long_model
):
    workers = [spawn("--model", str(long_model)) for _ in range(2)]
    router = launch(workers, long_model)
    body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 1500, **GREEDY}
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(router.stream, "/v1/completions", body) for _ in range(2)]
        # Round robin places one stream on each worker, unless the router left one out of
        # its pool for a moment (a health check missed on a busy host can): then the killed
        # worker holds both, and both must end in an error.
        assert wait_until(lambda: sum(map(active, workers)) == 2, 30), (
            router.health(),
            [s.done() and (s.exception() or s.result()[-1:]) for s in streams],
        )
        counts = [active(w) for w in workers]
        victim = workers[counts.index(max(counts))]
        on_victim = max(counts)
        load = Load(router, clients=4)
        try:
            assert wait_until(lambda: served(victim) >= 2, 30)
            victim.proc.kill()
            victim.proc.wait()
            killed, at_kill = time.monotonic(), load.ok
            # The router's health check (every second here) marks it unhealthy.
            assert wait_until(lambda: router.health()[victim.port] is False, 10)
            unhealthy = time.monotonic() - killed
            restarted = spawn("--model", str(long_model), port=victim.port)
            restarted.wait_serving()
            assert wait_until(lambda: router.health()[victim.port], 10)
            assert wait_until(lambda: served(restarted) >= 4, 10)
        finally:
            load.stop()
        # Each stream on the killed worker ends with an error event; the other finishes.
        ends = sorted("error" in s.result()[-1] for s in streams)
        assert ends == [False] * (2 - on_victim) + [True] * on_victim
    # No request failed, not even one in flight on the killed worker: none had had a message
    # yet, so the router retried each on the survivor.
    assert load.errors == []
    assert load.ok - at_kill >= 20, (load.ok, at_kill)
    assert unhealthy < 5
