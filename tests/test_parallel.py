"""One model served by two ranks over mx.distributed (ring backend, loopback, CPU):
rank 0 answers gRPC, rank 1 follows it in lockstep; outputs equal one process's,
and every fault ends in bounded time with the documented exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from test_metrics import scrape

from bench.workers import free_port, process_cpu_seconds
from smg_mlx.demo_model import build_model
from smg_mlx.engine.ranks.placement import shared_gpu
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from helpers import (
    NOT_SERVING,
    Process,
    collect,
    free_port_run,
    generate,
    prompt,
    request,
    wait_until,
)

RANKS = 2
# How soon a fault must end the ranks here. Ranks notice a dead or hung peer
# within 5-10 s (docs/scaling.md), but a hung peer's limit grows with the slowest
# step seen, and CI runs four test processes, and each pair of ranks polls a core,
# on two cores: there a fault has taken 20 s to end. Well short of the streams'
# 60 s timeout, this still tells a bounded end from a hang.
FAULT_SECONDS = 30
PROMPTS = [prompt(9 + 3 * i, i) for i in range(8)]


@pytest.fixture(scope="module")
def models(models_root: Path) -> dict[str, Path]:
    root = models_root / "parallel"
    return {
        family: build_model(root / family, ["--family", family])
        for family in ("llama", "qwen3", "qwen2")
    }


class Ranks:
    """Two `smg-mlx serve` processes started as mlx.launch starts them (MLX_RANK,
    MLX_HOSTFILE), but each in our hands, to kill or stop one alone."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        hostfile = tmp_path / f"hosts-{time.monotonic_ns()}.json"
        first = free_port_run(RANKS)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(RANKS)]))
        port = free_port()
        self.ranks = [
            Process(
                tmp_path,
                *args,
                port=port,
                env={"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), **(env or {})},
            )
            for r in range(RANKS)
        ]
        self.leader = self.ranks[0]
        self.stub = self.leader.stub

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


@pytest.fixture
def start_ranks(tmp_path):
    started: list[Ranks] = []

    def start(*args: str, serving: bool = True, env: dict[str, str] | None = None) -> Ranks:
        started.append(Ranks(tmp_path, *args, env=env))
        if serving:
            started[-1].leader.wait_serving(120)
        return started[-1]

    yield start
    for ranks in started:
        ranks.close()


@pytest.fixture(scope="module")
def llama_ranks(models, tmp_path_factory) -> Ranks:
    """Two ranks on the llama model (tensor parallel, started with watch_init),
    shared by the tests that leave them serving: each start of a pair is two
    workers' imports and loads."""
    tmp = tmp_path_factory.mktemp("llama-ranks")
    ranks = Ranks(tmp, "--model", str(models["llama"]), env=watch_init(tmp))
    ranks.tmp = tmp
    try:
        ranks.leader.wait_serving(120)
        yield ranks
    finally:
        ranks.close()


def outputs(stub, **sampling) -> list[list[int]]:
    """The eight prompts at once, greedy unless told otherwise."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(
            pool.map(
                lambda p: generate(stub, p, max_tokens=24, ignore_eos=True, **sampling).tokens,
                PROMPTS,
            )
        )


def one_process_outputs(start_worker, model: Path, **sampling) -> list[list[int]]:
    worker = start_worker(model)
    try:
        return outputs(worker.stub, **sampling)
    finally:
        worker.stop()


@pytest.mark.parametrize(
    ("family", "flags"),
    [("llama", ()), ("qwen3", ()), ("qwen2", ("--pipeline",))],
    ids=["llama tensor parallel", "qwen3 tensor parallel", "qwen2 pipeline"],
)
def test_two_ranks_give_one_process_output(
    start_ranks, start_worker, models, family, flags, tmp_path, request
):
    expected = one_process_outputs(start_worker, models[family])
    # Random weights drawn too small repeat one token: equality would prove nothing.
    assert all(len(set(tokens)) > 1 for tokens in expected)
    assert len({tuple(tokens) for tokens in expected}) == len(PROMPTS)
    if family == "llama":  # (the pair the idle test shares, started as these are)
        ranks = request.getfixturevalue("llama_ranks")
        watched = ranks.tmp
    else:
        ranks = start_ranks("--model", str(models[family]), *flags, env=watch_init(tmp_path))
        watched = tmp_path
    assert loaded_at_init(watched) == {rank: [] for rank in range(RANKS)}
    assert outputs(ranks.stub) == expected
    split = "pipeline" if flags else "tensor parallel"
    assert f"the model split over 2 ranks ({split})" in ranks.leader.log.read_text()
    # Each rank says where it runs and what it may use there.
    for r, rank in enumerate(ranks.ranks):
        log = rank.log.read_text()
        assert re.search(rf"rank {r} runs on Device\((cpu|gpu), \d+\) \(", log), log
        assert f"rank {r} of {RANKS} joined the group" in log
        assert re.search(rf"INFO rank {r} \S+: memory budget \d", log), log


# On every rank's interpreter path as sitecustomize: when the process first calls
# mx.distributed.init, it notes which of these modules are loaded already.
WATCH_INIT = """
import importlib.machinery, json, os, sys

HEAVY = {"torch", "transformers", "tokenizers", "mlx_lm"}


class WatchInit:
    def find_spec(self, name, path, target=None):
        if name != "mlx.core":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            init = module.distributed.init

            def watched(*args, **kwargs):
                loaded = sorted({m.split(".")[0] for m, v in sys.modules.items() if v} & HEAVY)
                with open(os.environ["INIT_WATCH"] + os.environ["MLX_RANK"], "a") as out:
                    out.write(json.dumps(loaded) + "\\n")
                return init(*args, **kwargs)

            module.distributed.init = watched

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, WatchInit())
"""


def watch_init(tmp_path: Path) -> dict[str, str]:
    """The environment that puts WATCH_INIT on the ranks' path. Every rank must
    join its group before loading what can bring another NCCL: on CUDA, importing
    MLX loads libnccl, unless the process has loaded one already: PyTorch brings
    its own, and transformers (so the tokenizer and mlx-lm) may import PyTorch.
    Ranks that load different builds cannot connect."""
    watch = tmp_path / "watch"
    watch.mkdir()
    (watch / "sitecustomize.py").write_text(WATCH_INIT)
    path = [str(watch), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(path), "INIT_WATCH": str(tmp_path / "init-rank-")}


def loaded_at_init(tmp_path: Path) -> dict[int, list[str]]:
    """What each rank started with watch_init had loaded when it first called
    mx.distributed.init."""
    return {
        rank: json.loads((tmp_path / f"init-rank-{rank}").read_text().splitlines()[0])
        for rank in range(RANKS)
    }


def test_two_ranks_on_one_gpu_are_refused_with_where_they_are():
    places = [("host-a", "GPU-1"), ("host-a", "GPU-2"), ("host-b", "GPU-1"), ("host-b", "GPU-1")]
    assert shared_gpu(places[:3]) is None
    assert shared_gpu(places).startswith("ranks 2, 3 all run on GPU GPU-1 of host-b: give each")


def test_aborts_cancels_seeds_cache_hits_and_refusals_as_one_process_then_sigterm_drains(
    start_ranks, start_worker, models
):
    model = models["llama"]
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
    single = start_worker(model)
    expected_seeded = generate(single.stub, PROMPTS[0], max_tokens=24, **seeded).tokens
    expected_plain = generate(single.stub, PROMPTS[3], max_tokens=24, ignore_eos=True).tokens
    long_prompt = prompt(40, 3)
    generate(single.stub, long_prompt, max_tokens=4)
    expected_hit = generate(single.stub, long_prompt + [7, 8], max_tokens=12)
    single.stop()

    ranks = start_ranks("--model", str(model), "--metrics-port", str(metrics := free_port()),
                        "--shutdown-grace-seconds", "30")  # fmt: skip
    stub = ranks.stub
    # An abort mid-stream and a client that leaves, beside requests that go on.
    aborted = stub.Generate(request(PROMPTS[1], request_id="ab", max_tokens=1500), timeout=60)
    next(aborted)
    cancelled = stub.Generate(request(PROMPTS[2], max_tokens=1500), timeout=60)
    next(cancelled)
    stub.Abort(pb.AbortRequest(request_ids=["ab"]))
    cancelled.cancel()
    assert collect(aborted).complete.finish_reason == "abort"
    with pytest.raises(grpc.RpcError):
        collect(cancelled)
    # A seeded sampled request gives one process's tokens.
    assert generate(stub, PROMPTS[0], max_tokens=24, **seeded).tokens == expected_seeded
    # A prefix-cache hit, decided by rank 0, applied by both.
    generate(stub, long_prompt, max_tokens=4)
    hit = generate(stub, long_prompt + [7, 8], max_tokens=12)
    assert hit.complete.cached_tokens == expected_hit.complete.cached_tokens > 0
    assert hit.tokens == expected_hit.tokens
    # A request that fails validation never reaches the ranks.
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, [5, 99999], max_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def running() -> float:
        return scrape(metrics)[("smg_mlx_running_requests", ())]

    assert wait_until(lambda: running() == 0, 10)
    # The batches agree (rank 1 checks its size against rank 0's every turn), and
    # the ranks still give one process's output.
    assert generate(stub, PROMPTS[3], max_tokens=24, ignore_eos=True).tokens == expected_plain
    assert ranks.ranks[1].proc.poll() is None
    # SIGTERM to rank 0 drains a stream in flight, then stops every rank.
    call = stub.Generate(request(PROMPTS[0], max_tokens=40, ignore_eos=True), timeout=60)
    next(call)
    ranks.leader.proc.send_signal(signal.SIGTERM)
    assert collect(call).complete.finish_reason == "length"  # drained, not cut
    assert [r.proc.wait(30) for r in ranks.ranks] == [0, 0]


def test_a_model_that_cannot_be_split_so_is_refused_on_every_rank(start_ranks, models, tmp_path):
    ranks = start_ranks("--model", str(models["llama"]), "--pipeline", serving=False)
    assert [r.proc.wait(60) for r in ranks.ranks] == [2, 2]  # no restart can cure it
    for rank in ranks.ranks:
        assert "llama cannot be split as a pipeline" in rank.log.read_text()
        assert "Traceback" not in rank.log.read_text()
    # Tensor parallel, where a layer's sizes do not divide by the ranks.
    odd = build_model(tmp_path / "odd", ["--hidden-size", "48", "--heads", "3", "--kv-heads", "3",
                                         "--intermediate-size", "99"])  # fmt: skip
    ranks = start_ranks("--model", str(odd), serving=False)
    assert [r.proc.wait(60) for r in ranks.ranks] == [2, 2]
    for rank in ranks.ranks:
        said = rank.log.read_text()
        assert "llama cannot be split tensor parallel over 2 ranks (" in said, said
        assert "start a number of ranks its sizes divide by" in said


def test_idle_ranks_sleep_rather_than_poll_and_answer_when_work_comes(request):
    """MLX's ring backend polls its sockets while a rank waits in a collective:
    a follower waiting there for rank 0's next turn kept a core busy, idle or
    not. Idle, the ranks now sleep between turns; a request still finds them."""
    if process_cpu_seconds(os.getpid()) is None:
        pytest.skip("reads processes' CPU time from /proc (Linux)")
    ranks = request.getfixturevalue("llama_ranks")
    time.sleep(1.0)  # (past the turns that follow start-up)
    used = [process_cpu_seconds(r.proc.pid) for r in ranks.ranks]
    time.sleep(3.0)
    used = [process_cpu_seconds(r.proc.pid) - u for r, u in zip(ranks.ranks, used, strict=True)]
    assert max(used) < 1.0, used  # of 3 s: a polling rank uses all of them
    out = generate(ranks.stub, PROMPTS[4], max_tokens=6, ignore_eos=True)
    assert out.complete.finish_reason == "length"


def test_kill_9_of_the_follower(start_ranks, models):
    ranks = start_ranks("--model", str(models["llama"]), "--completion-batch-size", "1")
    streaming = ranks.stub.Generate(
        request(PROMPTS[0], max_tokens=1900, ignore_eos=True), timeout=60
    )
    next(streaming)
    # Not streaming yet: waits for the one slot.
    waiting = ranks.stub.Generate(request(PROMPTS[1], max_tokens=10), timeout=60)
    outcome = {}
    threading.Thread(target=lambda: outcome.update(w=_code(waiting)), daemon=True).start()
    time.sleep(0.3)
    killed_at = time.monotonic()
    ranks.ranks[1].proc.kill()
    assert _code(streaming) == grpc.StatusCode.INTERNAL
    assert wait_until(lambda: "w" in outcome, FAULT_SECONDS)
    assert outcome["w"] == grpc.StatusCode.UNAVAILABLE  # the router retries it elsewhere
    assert ranks.leader.proc.wait(FAULT_SECONDS) == 1
    assert time.monotonic() - killed_at < FAULT_SECONDS


def test_a_hung_follower(start_ranks, models):
    ranks = start_ranks("--model", str(models["llama"]))
    streaming = ranks.stub.Generate(
        request(PROMPTS[0], max_tokens=1900, ignore_eos=True), timeout=60
    )
    next(streaming)
    stopped_at = time.monotonic()
    ranks.ranks[1].proc.send_signal(signal.SIGSTOP)
    try:
        assert wait_until(lambda: _not_serving(ranks.leader), FAULT_SECONDS)
        assert _code(streaming) == grpc.StatusCode.INTERNAL
        assert ranks.leader.proc.wait(FAULT_SECONDS) == 1
        assert time.monotonic() - stopped_at < FAULT_SECONDS
    finally:
        ranks.ranks[1].proc.send_signal(signal.SIGCONT)


def _not_serving(worker) -> bool:
    """NOT_SERVING, or no longer listening: a worker that failed says so, then exits
    (a poll on a loaded machine may come only after that)."""
    try:
        return worker.check() == NOT_SERVING
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("how", ["kill", "stop"], ids=["kill -9", "SIGSTOP"])
def test_rank_0_gone_ends_the_follower(start_ranks, models, how):
    ranks = start_ranks("--model", str(models["llama"]))
    gone_at = time.monotonic()
    if how == "kill":
        ranks.leader.proc.kill()
    else:
        ranks.leader.proc.send_signal(signal.SIGSTOP)
    try:
        assert ranks.ranks[1].proc.wait(FAULT_SECONDS) == 1
        assert time.monotonic() - gone_at < FAULT_SECONDS
    finally:
        ranks.leader.proc.kill()
    if how == "kill":  # its sockets closed: the follower says whose (not "Ran out of input")
        said = ranks.ranks[1].log.read_text()
        # (mostly the empty turn a closed socket sums to; now and then, on a loaded
        # host, the collective waits on instead, and the watchdog says it)
        assert (
            "rank 0 is gone (its process ended or its connection closed)" in said
            or re.search(r"rank 0 sent nothing for \d+s: it is gone, hung or unreachable", said)
        ), said


def _code(call) -> grpc.StatusCode:
    try:
        collect(call)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK
