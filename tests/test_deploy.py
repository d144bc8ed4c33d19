"""The recipes in deploy/: their command lines are ones `smg-mlx serve` accepts and that serve,
and their supervisors restart on failure, wait out the shutdown grace and probe health."""

from __future__ import annotations

import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from helpers import SERVING

from bench.workers import free_port
from smg_mlx.cli import build_parser
from smg_mlx.config import ServerConfig
from smg_mlx.server import HEALTH_NAMES

DEPLOY = REPO / "deploy"
HEALTH = re.compile(r"(\S+) (health [^;|&']*)")  # an `smg-mlx health` call in a shell line
GRACE = ServerConfig.shutdown_grace_seconds


def launchd() -> dict:
    with (DEPLOY / "launchd" / "com.example.smg-mlx.plist").open("rb") as f:
        return plistlib.load(f)


def systemd(name: str) -> dict[str, str]:
    """A unit file's settings by key (these units set each key once)."""
    text = (DEPLOY / "systemd" / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def kubernetes() -> tuple[dict, dict]:
    """The Deployment and the Service."""
    documents = yaml.safe_load_all((DEPLOY / "kubernetes" / "smg-mlx.yaml").read_text())
    by_kind = {d["kind"]: d for d in documents}
    assert set(by_kind) == {"Deployment", "Service"}
    return by_kind["Deployment"], by_kind["Service"]


def container() -> dict:
    (only,) = kubernetes()[0]["spec"]["template"]["spec"]["containers"]
    return only


COMMANDS = {
    "launchd": lambda: launchd()["ProgramArguments"],
    "systemd": lambda: shlex.split(systemd("smg-mlx.service")["ExecStart"]),
    "kubernetes": lambda: container()["command"],
}


@pytest.mark.parametrize("recipe", COMMANDS)
def test_the_command_is_one_serve_accepts(recipe):
    program, *args = COMMANDS[recipe]()
    assert Path(program).name == "smg-mlx"
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve"
    assert parsed.model.name == "YOUR-MODEL"  # a placeholder to edit
    assert (parsed.host, parsed.port, parsed.metrics_port) == ("0.0.0.0", 50051, 9400)


@pytest.mark.parametrize("recipe", COMMANDS)
def test_the_command_serves(recipe, spawn, model_dir):
    _, serve, *args = COMMANDS[recipe]()
    assert serve == "serve"
    port, metrics = free_port(), free_port()
    values = {"--model": str(model_dir), "--port": str(port), "--metrics-port": str(metrics)}
    # Each value that follows a flag of `values` is replaced; the rest run as written.
    previous = ["", *args[:-1]]
    args = [values.get(flag, value) for flag, value in zip(previous, args, strict=True)]
    worker = spawn(*args, port=port)
    worker.wait_serving()
    for name in HEALTH_NAMES:
        assert worker.check(name) == SERVING
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
        assert b"smg_mlx_requests_total" in r.read()


def test_launchd_restarts_on_failure_and_waits_out_the_grace():
    job = launchd()
    assert job["KeepAlive"] == {"SuccessfulExit": False}  # restart after exit 1 or 2, not 0
    assert job["RunAtLoad"] is True
    assert job["ExitTimeOut"] > GRACE
    assert job["StandardOutPath"] == job["StandardErrorPath"]


def test_systemd_restarts_on_failure_and_probes_health():
    unit = systemd("smg-mlx.service")
    program, *serve = shlex.split(unit["ExecStart"])
    port = build_parser().parse_args(serve).port
    assert unit["Restart"] == "on-failure" and unit["RestartPreventExitStatus"] == "2"
    assert int(unit["TimeoutStopSec"]) > GRACE
    probe = systemd("smg-mlx-health.service")["ExecStart"]
    assert "systemctl restart smg-mlx.service" in probe
    assert systemd("smg-mlx-health.timer")["OnUnitActiveSec"] == "30"
    # The start-up wait and the two checks of the probe ask this worker.
    checks = HEALTH.findall(unit["ExecStartPost"] + probe)
    assert [path for path, _ in checks] == [program] * 3
    for _, command in checks:
        assert build_parser().parse_args(command.split()).port == port


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_units_verify(tmp_path):
    # verify insists that the program exists: point the units at this venv's.
    installed = str(Path(sys.executable).with_name("smg-mlx"))
    for unit in (DEPLOY / "systemd").iterdir():
        text = unit.read_text().replace("/opt/smg-mlx/.venv/bin/smg-mlx", installed)
        (tmp_path / unit.name).write_text(text)
    units = sorted(str(p) for p in tmp_path.iterdir())
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True
    )
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


def test_kubernetes_probes_are_native_grpc_health_checks():
    deployment, service = kubernetes()
    pod = deployment["spec"]["template"]
    worker = container()
    port = build_parser().parse_args(worker["command"][1:]).port
    assert {p["name"]: p["containerPort"] for p in worker["ports"]} == {
        "grpc": port,
        "metrics": 9400,
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = worker[probe]["grpc"]
        assert check["port"] == port and check.get("service", "") in HEALTH_NAMES
    assert pod["spec"]["terminationGracePeriodSeconds"] > GRACE
    assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}
