"""The package works outside this checkout: deploy/install.sh run from a clean copy
of the tree gives a fresh virtualenv that serves; without an MLX backend the worker
names the command that installs one, and that command works.

The fresh virtualenv installs from the wheelhouse `make install` fills
(.venv/wheelhouse: the runtime dependencies and the build backend), so pip
resolves the wheel's own requirements for real, offline."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib.machinery import ModuleSpec
from importlib.metadata import distribution
from pathlib import Path

import grpc
import pytest

from bench.workers import free_port
from smg_mlx import __version__, mlx_backend
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import generate, prompt, serving_within

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"


def pip(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-index", "--find-links", str(WHEELHOUSE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def clean_copy(out: Path) -> Path:
    """The files a clone would have: tracked ones, and new ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, out / name)
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux wheels of MLX lack a backend")
def test_without_a_backend_library_the_message_names_the_commands(tmp_path, monkeypatch):
    # An mlx package as `pip install smg-mlx` leaves it on Linux: bindings, no library.
    spec = ModuleSpec("mlx", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(mlx_backend, "find_spec", lambda name: spec)
    monkeypatch.setattr(mlx_backend, "_installed", lambda distribution: False)
    message = mlx_backend.missing_backend()
    # This environment's pip, MLX's own extras, the MLX installed (test_install_sh_... runs one).
    for extra in ("cpu", "cuda13"):
        command = f"{sys.executable} -m pip install 'mlx[{extra}]=={distribution('mlx').version}'"
        assert command in message
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmlx.so").touch()  # a source build carries its own
    assert mlx_backend.missing_backend() is None


def test_this_environment_has_a_backend():
    assert mlx_backend.missing_backend() is None


@pytest.mark.skipif(sys.platform != "linux", reason="only Linux wheels of MLX lack a backend")
def test_install_sh_on_linux_asks_which_backend_before_installing(tmp_path):
    done = subprocess.run(
        [REPO / "deploy" / "install.sh", tmp_path / "venv"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "name MLX's backend: cpu (the CPU) or cuda13 (NVIDIA GPUs, CUDA 13)" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_install_sh_refuses_a_backend_it_does_not_know_before_installing(tmp_path):
    done = subprocess.run(
        [REPO / "deploy" / "install.sh", tmp_path / "venv", "cuda12"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "no backend 'cuda12': name cpu, cuda13 or none" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_install_sh_from_a_clean_tree_installs_and_serves(tmp_path):
    """deploy/install.sh, the install of the systemd recipe and of the image; on Linux
    first without a backend, whose message names the command that adds one."""
    if not WHEELHOUSE.is_dir():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: run `make install`")
    source = clean_copy(tmp_path / "src")
    built = pip("wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(source))
    # setuptools warns of deprecated metadata (a license table) through pip.
    assert "deprecat" not in built.lower() and "BuildBackendWarning" not in built, built

    # Offline: pip takes everything from the wheelhouse. PIP_COMPILE=0 (pip's --no-compile)
    # skips byte-compiling every installed module, a third of the install's time; what
    # the worker imports is compiled as it imports it.
    offline = {"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE),
               "PIP_COMPILE": "0"}  # fmt: skip
    venv = tmp_path / "venv"
    # On Linux without a backend (`none`), as `pip install` of the bare package is.
    bare = ["none"] if sys.platform == "linux" else []
    installed = subprocess.run(
        [source / "deploy" / "install.sh", venv, *bare],
        env={**offline, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert installed.stdout.strip() == f"smg-mlx {__version__}"
    python, smg_mlx = venv / "bin" / "python", venv / "bin" / "smg-mlx"
    tools = subprocess.run([python, "-c", "import grpc_tools"], capture_output=True)
    assert tools.returncode != 0, "grpcio-tools is a runtime dependency again"

    # Only what the venv holds: no PYTHONPATH, not this checkout as the working directory.
    isolated = {"cwd": tmp_path, "env": {"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path)}}
    if sys.platform == "linux":
        # Installed without a backend extra, as `pip install` of the bare package is.
        bare = subprocess.run(
            [smg_mlx, "serve", "--demo", "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            **isolated,
        )
        assert bare.returncode == 2  # an install to fix: no supervisor should restart it
        assert "Traceback" not in bare.stderr
        command = re.search(r"install one with (.+?) for the CPU", bare.stderr)
        assert command is not None, bare.stderr
        added = subprocess.run(
            ["bash", "-c", command[1]], env=offline, capture_output=True, text=True, timeout=300
        )
        assert added.returncode == 0, added.stdout + added.stderr

    port, log = free_port(), tmp_path / "worker.log"
    worker = subprocess.Popen(
        [smg_mlx, "serve", "--demo", "--port", str(port)],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        **isolated,
    )
    try:
        assert serving_within(port, 120), log.read_text()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
            assert len(generate(stub, prompt(8), max_tokens=4).tokens) == 4
        worker.terminate()
        assert worker.wait(30) == 0, log.read_text()
    finally:
        worker.kill()
        worker.wait()
    assert "Traceback" not in log.read_text()
