"""Start-up's memory probe runs once per model, setting and machine: a restart
finds its figures; another prefill chunk measures again; a file that is not this
worker's is never trusted."""

from __future__ import annotations

import json

from helpers import remembered_files

MEASURES = "measuring the model's memory and speed"
REMEMBERED = "; remembered)"


def test_a_restart_finds_the_figures_the_probe_measured(restart, model_dir, tmp_path):
    first = restart(model_dir)
    assert MEASURES in first and REMEMBERED not in first
    [kept] = remembered_files(tmp_path, "memory-probe")
    measured = json.loads(kept.read_text())["memory"]
    second = restart(model_dir)
    assert MEASURES not in second and REMEMBERED in second
    # The budget planned with the same figures: the same longest request either way.
    longest = [line for line in first.splitlines() if "may have up to" in line]
    assert longest and longest[-1].split("] ")[-1] in second
    assert json.loads(kept.read_text())["memory"] == measured
    # A smaller prefill chunk, which the probe is cut to: measured apart, kept apart.
    smaller = restart(model_dir, prefill_step_size=64)
    assert MEASURES in smaller
    assert len(remembered_files(tmp_path, "memory-probe")) == 2


def test_a_probe_file_that_is_not_this_workers_is_measured_again(restart, model_dir, tmp_path):
    restart(model_dir)
    [kept] = remembered_files(tmp_path, "memory-probe")
    kept.write_text(json.dumps({**json.loads(kept.read_text()), "memory": {"weights": "?"}}))
    log = restart(model_dir)
    assert "memory probe: ignoring what " in log and MEASURES in log
    assert json.loads(kept.read_text())["memory"]["weights"] > 0  # measured and kept again
