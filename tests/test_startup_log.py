"""A worker's output holds only what an operator needs: its own log lines, no
library notices, nothing bare on stdout."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import wait_until

from bench.workers import free_port
from smg_mlx.health_check import probe

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
