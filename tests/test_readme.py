"""The README's commands, run as written from the repository's root by a shell whose PATH
lacks the virtual environment (as a reader's does), with only the ports swapped for free
ones: the Quick start in its order on the demo model, the small models to try things with,
and the launcher command for several ranks (docs/scaling.md)."""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path

import grpc
import pytest
from test_grpcurl import messages

from bench.workers import free_port
from smg_mlx.config import DISK_CACHE_MOST, DISK_CACHE_SHARE, default_prompt_cache_dir
from smg_mlx.grpc_stubs import common_pb2, mlx_engine_pb2_grpc
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.model_source import DEMO_NAME

from docs import (
    BARE_PATH,
    README,
    REPO,
    SCALING,
    background,
    code_blocks,
    commands,
    section,
    shell,
    stop,
)
from helpers import (
    SMG,
    demo_model_cache,
    free_port_run,
    generate,
    prompt,
    serving_within,
    wait_until,
)

VENV_BIN = REPO / ".venv" / "bin"
pytestmark = [
    pytest.mark.skipif(
        not (VENV_BIN / "smg-mlx").exists(), reason="the README's commands use make's .venv"
    ),
    pytest.mark.skipif(SMG is None, reason="the router (pip install smg) is not installed"),
]


@pytest.fixture
def home(tmp_path: Path, model_dir: Path) -> Path:
    """A reader's home whose cache holds the demo model already (a fresh build is
    test_startup_log's)."""
    return demo_model_cache(tmp_path / "home" / ".cache", model_dir).parent


def reader_env(home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": BARE_PATH, "HOME": str(home), **extra}


def with_ports(command: str, ports: dict[str, int]) -> str:
    for documented, free in ports.items():
        command = re.sub(rf"\b{documented}\b", str(free), command)
    return command


def sh_blocks(heading: str, page: Path = README) -> list[list[str]]:
    return [commands(block) for block in code_blocks(section(page, heading))]


def shape(sample: object, actual: object) -> object:
    """`actual` cut down to the keys of `sample` (the README shows a shortened answer)."""
    if isinstance(sample, dict):
        return {key: shape(value, actual[key]) for key, value in sample.items()}
    if isinstance(sample, list):
        return [shape(s, a) for s, a in zip(sample, actual, strict=True)]
    return actual


def start_router(worker_port: int, env: dict[str, str], log: Path) -> tuple:
    """The Quick start's router command in front of `worker_port`; returns the process
    and its HTTP port once it lists the worker as healthy."""
    (command,) = sh_blocks("## Quick start")[3]
    http_port = free_port()
    # The router's own metrics port (29000) is swapped too: another router may hold it.
    # The tests stop it idle, where its default grace only makes the stop take 5 s.
    command = with_ports(command, {"50051": worker_port, "8000": http_port})
    router = background(
        f"{command} --prometheus-port {free_port()} --shutdown-grace-period-secs 0", env, log
    )
    workers = f"curl -s 127.0.0.1:{http_port}/workers"

    def registered() -> bool:
        listed = shell(workers, env).stdout
        return listed.startswith("{") and '"is_healthy":true' in listed

    if not wait_until(registered, 30, every=0.1):
        stop(router)
        pytest.fail(log.read_text()[-3000:])
    return router, http_port


def chat(http_port: int, model: str, env: dict[str, str]) -> dict:
    """The router's reply, asked again while it says its tokenizer is not ready
    yet (one fetched from the worker may come after the worker is listed healthy)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    replies = []

    def answered() -> bool:
        done = shell(
            f"curl -s 127.0.0.1:{http_port}/v1/chat/completions "
            f"-H 'content-type: application/json' -d '{json.dumps(body)}'",
            env,
        )
        replies.append(json.loads(done.stdout))
        return replies[-1].get("error", {}).get("code") != "tokenizer_not_ready"

    wait_until(answered, 30, every=0.1)
    return replies[-1]


def assert_answered(reply: dict) -> None:
    """Sampled (the Quick start's request sets no temperature): a random-weight model may
    draw its end-of-text token before the eighth."""
    finish, tokens = reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]
    assert (finish, tokens) == ("length", 8) or (finish == "stop" and 1 <= tokens <= 8)


def test_the_quick_start_works_in_order_on_the_demo_model(home, tmp_path):
    (serve,), (health,), (info, generate), (router_cmd,), (chat_cmd,), *_ = sh_blocks(
        "## Quick start"
    )
    assert serve == "make serve" and "--model-path" not in router_cmd
    worker_port = free_port()
    env = reader_env(home)
    # `make serve` takes its port from the environment (PORT ?= 50051 in the Makefile).
    worker = background(serve, {**env, "PORT": str(worker_port)}, tmp_path / "worker.log")
    router = None
    try:
        answers = []

        def serving() -> bool:
            answers.append(shell(with_ports(health, {"50051": worker_port}), env))
            return answers[-1].returncode == 0

        # The documented health command is a Python process (a third of a second of
        # CPU): asked once the worker says SERVING in-process, and again while not.
        assert serving_within(worker_port, 60), (tmp_path / "worker.log").read_text()
        assert wait_until(serving, 60, every=0.5), (tmp_path / "worker.log").read_text()
        assert answers[-1].stdout == "SERVING\n"
        # The worker asked directly, as the Quick start shows (grpcurl, reflection).
        described = shell(with_ports(info, {"50051": worker_port}), env)
        assert described.returncode == 0 and DEMO_NAME in described.stdout, described.stderr
        streamed = shell(with_ports(generate, {"50051": worker_port}), env)
        assert streamed.returncode == 0, streamed.stderr
        replies = messages(streamed.stdout)
        sent = sum(len(r["chunk"]["token_ids"]) for r in replies if "chunk" in r)
        complete = replies[-1]["complete"]
        assert sent == complete["completion_tokens"] <= 8 and complete["finish_reason"] in (
            "length", "stop")  # fmt: skip
        router, http_port = start_router(worker_port, env, tmp_path / "router.log")
        models = json.loads(shell(f"curl -s 127.0.0.1:{http_port}/v1/models", env).stdout)
        assert [m["id"] for m in models["data"]] == [DEMO_NAME]
        done = shell(with_ports(chat_cmd, {"8000": http_port}), env)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
    finally:
        for process in filter(None, (router, worker)):
            stop(process)
    (sample,) = (json.loads(b) for b in code_blocks(section(README, "## Quick start"), "json"))
    # All of it but the text, which is random: so is where it ends, now and
    # then at the model's end-of-text token, the last one allowed included.
    del sample["choices"][0]["message"]["content"]
    choice, usage = reply["choices"][0], reply["usage"]
    if choice["finish_reason"] == "stop":
        assert usage["completion_tokens"] <= sample["usage"]["completion_tokens"]
        choice["finish_reason"] = "length"
        usage["completion_tokens"] = sample["usage"]["completion_tokens"]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    assert shape(sample, reply) == sample


def test_the_quick_start_says_where_its_disk_cache_goes_and_how_to_turn_it_off(monkeypatch):
    monkeypatch.setenv("HOME", "/HOME")
    monkeypatch.delenv("XDG_CACHE_HOME")
    where = str(default_prompt_cache_dir()).replace("/HOME", "~")  # as the README writes it
    said = " ".join(section(README, "## Quick start").split())
    assert (
        f"in `{where}` (up to {DISK_CACHE_SHARE:.0%} of the free disk, "
        f"{DISK_CACHE_MOST >> 30} GiB at most)"
    ) in said
    assert '`make serve SERVE_ARGS="--prompt-cache-disk-bytes 0"`' in said


def test_the_router_needs_no_model_path_on_another_machine(start_worker, model_dir, tmp_path):
    """Where the router cannot read the directory the worker reports, it fetches the
    tokenizer from the worker (GetTokenizer)."""
    moved = tmp_path / "elsewhere"
    moved.symlink_to(model_dir)
    worker = start_worker(moved)
    # The worker keeps the tokenizer files it sent once.
    list(worker.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    moved.unlink()  # as the router on another machine sees it: no such directory
    env, log = reader_env(tmp_path), tmp_path / "router.log"
    router, http_port = start_router(worker.worker.port, env, log)
    try:
        reply = chat(http_port, "elsewhere", env)
    finally:
        stop(router)
    assert_answered(reply)
    assert "Fetching tokenizer from worker" in log.read_text()


def test_a_small_model_to_try_things_with(home, tmp_path):
    ((build, serve),) = sh_blocks("### Small models to try things with")
    env = reader_env(home)
    built = shell(build, env)
    assert built.returncode == 0, built.stderr
    model = home / "models" / "demo-qwen2"
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"
    port = free_port()
    worker = background(with_ports(serve, {"50051": port}), env, tmp_path / "worker.log")
    try:
        assert serving_within(port, 60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            assert (info.served_model_name, info.model_type) == ("demo-qwen2", "qwen2")
            assert len(generate(stub, prompt(8), max_tokens=3).tokens) == 3
    finally:
        stop(worker)


MLX_LAUNCH = VENV_BIN / "mlx.launch"


def launch_command(command: str, worker_port: int) -> str:
    """The launcher command of docs/scaling.md with free ports: the worker's, and the ring's
    (mlx.launch's --starting-port, 32323 by default, one port a rank up from it)."""
    command = with_ports(command, {"50051": worker_port})
    first = free_port_run(int(re.search(r"-n (\d+)", command)[1]))
    return command.replace("mlx.launch ", f"mlx.launch --starting-port {first} ", 1)


@pytest.mark.skipif(not MLX_LAUNCH.exists(), reason="mlx.launch comes with mlx")
def test_two_ranks_on_one_host_serve_behind_the_router(home, tmp_path):
    _, (launch,) = sh_blocks("### Macs (the ring backend)", SCALING)
    port, log = free_port(), tmp_path / "launch.log"
    env = reader_env(home)
    ranks = background(launch_command(launch, port), env, log)
    router = None
    try:
        assert wait_until(lambda: " SERVING " in log.read_text(), 120), log.read_text()
        assert "split over 2 ranks" in log.read_text()
        router, http_port = start_router(port, env, tmp_path / "router.log")
        assert_answered(chat(http_port, DEMO_NAME, env))
    finally:
        if router is not None:
            stop(router)
        # As Ctrl-C in its terminal: the whole group (mlx.launch passes no signal of its
        # own on to the ranks); rank 0 then stops every rank.
        ended = stop(ranks, signal.SIGINT)
    assert ended, f"a rank outlived Ctrl-C: {log.read_text()}"


@pytest.mark.skipif(not MLX_LAUNCH.exists(), reason="mlx.launch comes with mlx")
def test_a_bare_program_name_fails_every_rank_and_the_launcher_still_exits_zero(home):
    """What docs/scaling.md warns of, so that the warning stays true."""
    _, (launch,) = sh_blocks("### Macs (the ring backend)", SCALING)
    bare = launch_command(launch, free_port()).replace('"$PWD/.venv/bin/smg-mlx"', "smg-mlx")
    assert shutil.which("smg-mlx", path=BARE_PATH) is None
    done = shell(bare, reader_env(home))
    assert done.returncode == 0
    assert "exec: smg-mlx: not found" in done.stdout + done.stderr
