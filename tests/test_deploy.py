"""The recipes in deploy/: their command lines are ones `smg-mlx serve` accepts and that serve,
their supervisors restart on failure, wait out the shutdown grace and probe health, and
what their install steps and the image create is what they run."""

from __future__ import annotations

import json
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

from bench.workers import free_port
from smg_mlx.cli import build_parser
from smg_mlx.config import ServerConfig
from smg_mlx.server import HEALTH_NAMES

from conftest import REPO
from docs import DEPLOY_README, code_blocks, commands, section
from helpers import SERVING, Process, demo_model_cache

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
    worker = spawn(*swapped(args, values), port=port)
    worker.wait_serving()
    for name in HEALTH_NAMES:
        assert worker.check(name) == SERVING
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
        assert b"smg_mlx_requests_total" in r.read()


def swapped(args: list[str], values: dict[str, str]) -> list[str]:
    """`args` with the value that follows each flag of `values` replaced; the rest as written."""
    previous = ["", *args[:-1]]
    return [values.get(flag, value) for flag, value in zip(previous, args, strict=True)]


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
        text = unit.read_text().replace("/opt/smg-mlx/bin/smg-mlx", installed)
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


def option(command: str, flag: str) -> str:
    """The value that follows `flag` in a shell command."""
    words = shlex.split(command)
    return words[words.index(flag) + 1]


def installed_by(heading: str) -> Path:
    """The program that a recipe's `deploy/install.sh PREFIX` step installs."""
    (block,) = code_blocks(section(DEPLOY_README, heading))
    (install,) = (c for c in commands(block) if c.startswith("deploy/install.sh"))
    return Path(shlex.split(install)[1]) / "bin" / "smg-mlx"


def test_the_launchd_steps_install_what_the_plist_runs():
    program = installed_by("## launchd (Mac)")
    # launchd expands no ~: the plist spells the home out, with YOU to edit.
    assert launchd()["ProgramArguments"][0] == str(program).replace("~", "/Users/YOU", 1)


def test_the_systemd_steps_create_what_the_units_use():
    (block,) = code_blocks(section(DEPLOY_README, "## systemd (Linux)"))
    steps = commands(block)
    (useradd,) = (c for c in steps if c.startswith("sudo useradd"))
    account, home = shlex.split(useradd)[-1], option(useradd, "--home-dir")
    assert "--create-home" in useradd
    program = installed_by("## systemd (Linux)")
    # The install directory exists, owned by whoever runs install.sh, before it runs.
    assert f'sudo install -d -o "$USER" {program.parent.parent}' in steps
    unit = systemd("smg-mlx.service")
    assert Path(shlex.split(unit["ExecStart"])[0]) == program
    assert unit["User"] == account and unit["WorkingDirectory"] == home
    # The Hugging Face cache in the account's home: written by the account, kept across restarts.
    variable, value = unit["Environment"].split("=", 1)
    assert variable == "HF_HOME" and Path(home) in Path(value).parents


DOCKERFILE = REPO / "Dockerfile"


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of each instruction, continuation lines joined."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = (line.strip() for line in text.splitlines())
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def image() -> dict[str, list[str]]:
    """The final stage's instructions by name, each one's arguments in order."""
    steps = dockerfile()
    final = max(i for i, (name, _) in enumerate(steps) if name == "FROM")
    found: dict[str, list[str]] = {}
    for name, args in steps[final:]:
        found.setdefault(name, []).append(args)
    return found


def image_env() -> dict[str, str]:
    """The final stage's ENV settings."""
    return dict(word.split("=", 1) for env in image()["ENV"] for word in shlex.split(env))


def test_the_image_installs_as_the_systemd_recipe_does():
    runs = [args for name, args in dockerfile() if name == "RUN"]
    (install,) = (run for run in runs if "deploy/install.sh" in run)
    words = shlex.split(install)
    prefix = words[words.index("/src/deploy/install.sh") + 1]
    assert words[-1] == "$MLX_EXTRA"
    assert ("ARG", "MLX_EXTRA=cpu") in dockerfile()  # CPU unless the build says cuda13
    final = image()
    assert final["COPY"] == [f"--from=build {prefix} {prefix}"]
    assert image_env()["PATH"].startswith(f"{prefix}/bin:")


def test_the_manifest_runs_the_image_as_its_non_root_user_with_the_cache_volume():
    final, (deployment, _) = image(), kubernetes()
    pod = deployment["spec"]["template"]["spec"]
    (user,) = final["USER"]
    assert int(user) != 0 and f"--uid {user}" in final["RUN"][0]
    assert pod["securityContext"] == {"runAsNonRoot": True, "fsGroup": int(user)}
    env = image_env()
    assert final["VOLUME"] == [env["HF_HOME"]]
    mounts = {m["mountPath"]: m["name"] for m in container()["volumeMounts"]}
    assert env["HF_HOME"] in mounts
    assert mounts[env["HF_HOME"]] in {v["name"] for v in pod["volumes"]}


def test_the_manifest_names_the_image_the_readme_builds():
    blocks = code_blocks(section(DEPLOY_README, "## Kubernetes"))
    (build,) = (c for block in blocks for c in commands(block) if c.startswith("docker build"))
    assert option(build, "--build-arg") == "MLX_EXTRA=cuda13"  # the manifest asks for a GPU
    assert option(build, "-t") == container()["image"]
    assert shlex.split(build)[-1] == "."  # the context: the repository, with its Dockerfile
    assert "nvidia.com/gpu" in container()["resources"]["limits"]


def test_the_images_health_check_asks_the_port_the_manifest_probes():
    final = image()
    entrypoint = json.loads(final["ENTRYPOINT"][0])
    serve = build_parser().parse_args(json.loads(final["CMD"][0]))
    (check,) = final["HEALTHCHECK"]
    program, *health = json.loads(check.split("CMD", 1)[1])
    assert [program] == entrypoint
    probe_port = container()["startupProbe"]["grpc"]["port"]
    assert build_parser().parse_args(health).port == serve.port == probe_port
    assert str(serve.port) in final["EXPOSE"][0].split()


def test_the_images_default_command_serves(tmp_path, model_dir):
    """ENTRYPOINT and CMD as the image runs them (the demo model is there already)."""
    final = image()
    _, serve, *args = json.loads(final["ENTRYPOINT"][0]) + json.loads(final["CMD"][0])
    assert serve == "serve"
    port = free_port()
    env = {"XDG_CACHE_HOME": str(demo_model_cache(tmp_path / "cache", model_dir))}
    worker = Process(tmp_path, *swapped(args, {"--port": str(port)}), port=port, env=env)
    try:
        worker.wait_serving()
    finally:
        worker.close()
