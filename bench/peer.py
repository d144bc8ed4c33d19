"""The published peer worker (`smg-grpc-servicer[mlx]`) in a virtualenv of its own.

It pins mlx-lm < 0.32 and transformers < 5.13, which cannot share a venv with
ours (mlx-lm 0.32.x). Its entry point is the module
`smg_grpc_servicer.mlx.server` (no console script); its flags are --model,
--host, --port, --completion-batch-size (default 32), --prefill-batch-size
(default 8) and --adapter-path; the prefill step size comes from the
MLX_PREFILL_STEP environment variable (default 2048).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.machine import version
from bench.workload import Workload

PEER_SPEC = "smg-grpc-servicer[mlx]==0.14.1"
PEER_MODULE = "smg_grpc_servicer.mlx.server"


# mlx's backend packages on Linux and the extras that install them.
MLX_BACKENDS = {"mlx-cuda-13": "cuda13", "mlx-cuda-12": "cuda12", "mlx-cpu": "cpu"}


def _requirements() -> list[str]:
    """The peer and the mlx that ours runs on, with the same backend, so that the
    two differ only above mlx (Linux wheels need a backend extra; macOS's carry Metal)."""
    extra = next((e for pkg, e in MLX_BACKENDS.items() if version(pkg)), None)
    mlx = f"mlx[{extra}]" if extra else "mlx"
    return [PEER_SPEC, f"{mlx}=={version('mlx')}"]


def ensure_peer_python(venv: Path) -> Path:
    """The peer venv's interpreter, creating the venv on first use."""
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    wanted = " ".join(_requirements())
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"creating the peer virtualenv {venv} ({wanted})", file=sys.stderr, flush=True)
    log = venv.with_name("peer-venv-install.log")
    with log.open("w") as out:  # pip's chatter goes here, not into the table
        for command in (
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", *_requirements()],
        ):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                # The other systems' rounds go on: the peer is reported as failed.
                raise RuntimeError(f"creating the peer venv failed: {' '.join(command)}; see {log}")
    stamp.write_text(wanted)
    return python


def peer_versions(python: Path) -> dict[str, str]:
    """Versions of what the peer runs on, for the report."""
    script = (
        "import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
        "('smg-grpc-servicer', 'mlx', 'mlx-lm', 'transformers')}))"
    )
    out = subprocess.run([str(python), "-c", script], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def peer_command(python: Path, model_dir: Path, port: int, workload: Workload) -> list[str]:
    return [
        str(python), "-m", PEER_MODULE, "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--completion-batch-size", str(workload.completion_batch_size),
        "--prefill-batch-size", str(workload.prefill_batch_size),
    ]  # fmt: skip


def peer_env(workload: Workload) -> dict[str, str]:
    return {"MLX_PREFILL_STEP": str(workload.prefill_step_size)}
