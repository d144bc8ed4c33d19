"""A worker's output holds only what an operator needs: its own log lines, no
library notices, nothing bare on stdout."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from datetime import datetime

import grpc
import pytest

from bench.workers import free_port
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.health_check import probe
from smg_mlx.logs import JsonFormatter, format_bytes

from helpers import generate, prompt, wait_until

TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) smg_mlx(\.\w+)*: \S")


def test_the_demo_worker_listens_while_it_builds_and_logs_only_its_own_lines(tmp_path):
    # A fresh cache builds the demo model, whose build once printed a bare path;
    # transformers printed a notice that PyTorch is missing (MLX needs none).
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for name in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):
        env.pop(name, None)
    port, output = free_port(), tmp_path / "output.txt"
    worker = subprocess.Popen(
        [sys.executable, "-m", "smg_mlx", "serve", "--demo", "--port", str(port)],
        stdout=output.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    answers = []  # (the log so far, then what health says) while the worker starts

    def serving() -> bool:
        answers.append((output.read_text(), probe("127.0.0.1", port, 1)))
        return answers[-1][1] is None

    try:
        assert wait_until(serving, 60), output.read_text()
    finally:
        worker.kill()
        worker.wait()
    lines = output.read_text().splitlines()
    assert any("building the demo model" in line for line in lines)
    # It listens before the build: a probe sees a worker starting, not a closed port.
    assert any(
        "building the demo" in log
        and "loading" not in log
        and why == f"127.0.0.1:{port} reports NOT_SERVING"
        for log, why in answers
    ), answers
    foreign = [line for line in lines if not TEXT_LINE.match(line)]
    assert not foreign, foreign


def test_json_logs_make_grpcs_own_lines_json_too(model_dir):
    # gRPC's core writes its own lines to stderr: at GRPC_VERBOSITY=info, one at start.
    env = {**os.environ, "GRPC_VERBOSITY": "info"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "smg_mlx", "serve", "--model", str(model_dir),
             "--port", str(port), "--log-format", "json"],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    assert done.returncode == 1
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    assert {"time", "level", "logger", "message"} <= set(entries[0])
    grpc_lines = [e for e in entries if e["logger"] == "grpc"]
    assert grpc_lines and "Log level INFO is not suitable" in grpc_lines[0]["message"]
    assert grpc_lines[0]["level"] == "warning"
    # The port in use is found before gRPC tries it: the worker's line alone says so.
    assert any(f"port {port} is in use" in e["message"] for e in entries)
    assert not any("Address already in use" in e["message"] for e in grpc_lines)


@pytest.mark.parametrize("json_flag", [["--log-format", "json"], ["--log-format=json"]])
def test_json_logs_make_a_refused_flag_json_too(json_flag):
    done = subprocess.run(
        [sys.executable, "-m", "smg_mlx", "serve", "--demo", *json_flag, "--max-pending", "-3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    (entry,) = [json.loads(line) for line in done.stderr.splitlines()]
    assert entry["level"] == "error" and "--max-pending" in entry["message"]
    assert entry["message"].endswith("(see smg-mlx serve --help)")  # as in text


def test_the_start_up_names_the_longest_request_of_context_and_memory(
    start_worker, model_dir, caplog
):
    caplog.set_level(logging.INFO, "smg_mlx.server")
    roomy = start_worker(model_dir)
    assert roomy.worker.engine.longest_sequence > 2048  # memory holds far more
    said = "one request may have up to {} tokens of prompt and output ({})"
    assert said.format(2048, "the model's context") in caplog.text
    caplog.clear()
    weights = roomy.worker.engine.memory.weights
    tight = start_worker(model_dir, memory_budget_bytes=weights + (5 << 20))
    longest = tight.worker.engine.longest_sequence
    assert longest < 2048
    assert said.format(longest, "what memory holds") in caplog.text
    # What GetModelInfo and a refusal say of the longest prompt agree with the log.
    info = tight.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_req_input_len == longest - 1
    with pytest.raises(grpc.RpcError) as err:
        generate(tight.stub, prompt(longest), max_tokens=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompts must be at most {longest - 1} tokens" in err.value.details()
    assert len(generate(tight.stub, prompt(longest - 1), max_tokens=1).tokens) == 1
    # Memory that holds hardly a chat's worth is a warning that says what gives more.
    caplog.clear()
    few = start_worker(model_dir, memory_budget_bytes=weights + (1 << 20)).worker.engine
    assert few.longest_sequence < 512
    (line,) = [r for r in caplog.records if "one request may have up to" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert line.getMessage().endswith("(what memory holds; --memory-budget gives more)")


def test_the_start_up_says_where_the_memory_budget_comes_from(start_worker, model_dir, caplog):
    caplog.set_level(logging.INFO, "smg_mlx.engine.start_up")
    start_worker(model_dir)
    # CI's machines have no GPU: the host's share.
    assert re.search(
        r"memory budget [\d.]+ \w+ \(75% of the host's memory \(or its container's limit\), "
        r"[\d.]+ \w+\): the model takes",
        caplog.text,
    )
    caplog.clear()
    start_worker(model_dir, memory_budget_share=0.5)
    assert "(50% (--memory-budget) of the host's memory" in caplog.text
    caplog.clear()
    start_worker(model_dir, memory_budget_share=0.505)
    assert "(50.5% (--memory-budget) of the host's memory" in caplog.text  # as given
    caplog.clear()
    start_worker(model_dir, memory_budget_bytes=1 << 30)
    assert "memory budget 1.00 GiB (--memory-budget): the model takes" in caplog.text
    caplog.clear()
    drafted = start_worker(model_dir, memory_budget_bytes=1 << 30, draft_model=model_dir,
                           speculative="auto")
    weights = format_bytes(drafted.worker.engine.memory.weights)
    assert f"(--memory-budget): the model and its draft take {weights}" in caplog.text
    caplog.clear()
    start_worker(model_dir, memory_budget_bytes=1 << 30)
    assert re.search(r"prompt cache in memory: up to [\d.]+ \w+, what the memory budget "
                     r"leaves it with nothing running \(it gives way to requests\)", caplog.text)
    caplog.clear()
    start_worker(model_dir, prompt_cache_bytes=8 << 20)
    assert "prompt cache in memory: up to 8.0 MiB (--prompt-cache-bytes)\n" in caplog.text
    caplog.clear()
    start_worker(model_dir, memory_budget_bytes=1 << 30, prompt_cache_bytes=64 << 30)
    assert re.search(r"prompt cache in memory: up to [\d.]+ MiB, what the memory budget leaves "
                     r"it with nothing running \(it gives way to requests; --prompt-cache-bytes "
                     r"64.00 GiB\)", caplog.text)


def test_a_start_that_goes_quiet_says_what_it_waits_on(
    start_worker, model_dir, caplog, monkeypatch
):
    """A start-up step that logs nothing for EVERY_SECONDS (here the tokenizer's
    read, slowed; on a busy host transformers' import alone takes that long) is
    said that often, so that a slow start does not read as a hung worker, until
    the engine logs its first line (its own steps say where they are, and a
    line of ours would name a stage past). A start that never goes quiet that
    long says nothing more."""
    import time

    from smg_mlx import server
    from smg_mlx.api import start_up_progress
    from smg_mlx.engine.batch import warm_up

    caplog.set_level(logging.INFO, "smg_mlx")
    start_worker(model_dir)
    assert "still starting" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(start_up_progress, "EVERY_SECONDS", 0.05)
    read = server.load_tokenizer
    monkeypatch.setattr(server, "load_tokenizer", lambda d: (time.sleep(0.7), read(d))[1])
    warm = warm_up.run  # (the engine's own steps, past its first line, quiet as long)
    monkeypatch.setattr(warm_up, "run", lambda *a, **k: (time.sleep(0.3), warm(*a, **k))[1])
    start_worker(model_dir)
    said = [r.getMessage() for r in caplog.records if "still starting" in r.getMessage()]
    assert len(said) >= 2, caplog.text
    assert all(re.fullmatch(r"still starting, \ds: reading the model's tokenizer", line)
               for line in said[:2]), said  # fmt: skip
    # Once the engine speaks, its own progress lines say where it is (none of these).
    names = [r.name for r in caplog.records]
    first = next(i for i, name in enumerate(names) if name.startswith("smg_mlx.engine"))
    assert not [r for r in caplog.records[first:] if "still starting" in r.getMessage()]


def test_pipeline_with_one_rank_says_it_does_nothing(start_worker, model_dir, caplog):
    # As under a launcher that started one rank: the command line lets --pipeline through.
    caplog.set_level(logging.WARNING, "smg_mlx.server")
    start_worker(model_dir, pipeline=True)
    assert "--pipeline does nothing: the model runs whole in this one process" in caplog.text


def test_json_log_times_are_iso_8601_with_milliseconds_and_offset():
    record = logging.makeLogRecord({"name": "smg_mlx", "levelname": "INFO", "msg": "hello"})
    time = json.loads(JsonFormatter().format(record))["time"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d", time), time
    assert abs(datetime.fromisoformat(time).timestamp() - record.created) < 0.001


def test_the_serving_line_shows_at_any_log_level(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--log-level", "error")
    p.wait_serving()
    assert wait_until(lambda: f" SERVING {model_dir.name} " in p.log.read_text()), (
        p.log.read_text()
    )
    assert " INFO smg_mlx.server" not in p.log.read_text()  # the level still holds elsewhere


def test_debug_logs_hold_the_workers_lines_not_grpcs_per_call_notes(spawn, model_dir):
    from helpers import generate, prompt

    p = spawn("--model", str(model_dir), "--log-level", "debug")
    p.wait_serving()
    for i in range(3):
        generate(p.stub, prompt(8, i), max_tokens=2)
    text = p.log.read_text()
    assert " DEBUG smg_mlx." in text
    assert "Loaded running loop" not in text  # grpcio's, a line a call


@pytest.mark.parametrize(
    ("dtype", "tf32", "said"),
    [("float32", None, True), ("bfloat16", None, False), ("float32", "0", False)],
)
def test_float32_weights_on_cuda_name_the_tf32_setting_that_keeps_batches_exact(
    dtype, tf32, said, monkeypatch, caplog
):
    """mlx multiplies float32 on CUDA in TF32 unless told not to: an operator who
    serves float32 weights for their precision learns how to keep it."""
    import mlx.core as mx
    import mlx.nn as nn

    from smg_mlx.engine.batch import loading

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    if tf32 is not None:
        monkeypatch.setenv("MLX_ENABLE_TF32", tf32)
    model = nn.Linear(8, 8)
    model.set_dtype(getattr(mx, dtype))
    with caplog.at_level(logging.INFO, "smg_mlx"):
        loading._say_tf32(model)
    assert ("MLX_ENABLE_TF32=0 makes them the same" in caplog.text) is said
