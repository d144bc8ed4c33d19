"""A worker's output holds only what an operator needs: its own log lines, no
library notices, nothing bare on stdout."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import wait_until

from bench.workers import free_port

TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) smg_mlx(\.\w+)*: \S")


def test_the_demo_workers_output_to_serving_is_only_its_own_log(tmp_path):
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
    try:
        assert wait_until(lambda: " SERVING " in output.read_text(), 60), output.read_text()
    finally:
        worker.kill()
        worker.wait()
    lines = output.read_text().splitlines()
    assert any("building the demo model" in line for line in lines)
    foreign = [line for line in lines if not TEXT_LINE.match(line)]
    assert not foreign, foreign
