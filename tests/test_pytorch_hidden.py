"""The worker never runs PyTorch, and where it is installed transformers would
import it (seconds of every start, and on CUDA its own libnccl): a worker's
processes find it absent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LOADS_THE_TOKENIZER_AND_MODEL = """
import sys
import smg_mlx.engine.start_up as start_up
from smg_mlx.server import load_tokenizer
start_up.import_mlx()
load_tokenizer(sys.argv[1])
from mlx_lm import load
load(sys.argv[1])
"""


def fake_pytorch(root: Path, marker: Path) -> None:
    """An installed `torch` (package and metadata) that leaves `marker` when imported."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n__version__ = '2.9.0'\n"
    )
    (root / "torch-2.9.0.dist-info").mkdir()
    (root / "torch-2.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n"
    )


def test_an_installed_pytorch_is_never_imported(model_dir, tmp_path):
    marker = tmp_path / "torch-was-imported"
    fake_pytorch(tmp_path / "site", marker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.getcwd()])}
    run = subprocess.run(
        [sys.executable, "-c", LOADS_THE_TOKENIZER_AND_MODEL, str(model_dir)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert not marker.exists()
    # Without the package imported first, the same environment imports it.
    subprocess.run(
        [sys.executable, "-c", "import mlx_lm.utils"], env=env, capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert marker.exists()
