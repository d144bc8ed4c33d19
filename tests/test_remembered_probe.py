"""Start-up's memory probe runs once per model, setting and machine: a restart
finds its figures; another prefill chunk measures again; a file that is not this
worker's is never trusted."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.parametrize(
    ("part", "damage"),
    [
        ("memory", {"weights": "?"}),
        ("memory", []),
        ("memory", {"kv_per_token": None}),  # (a start that multiplied by these failed, exit 1)
        ("memory", {"kv_per_token": -288}),  # (planned with: KV counted as freeing memory)
        ("speed", {"per_token": "abc"}),
        ("seconds", "1.5"),
        ("at", None),  # (was logged as "measured on None")
    ],
)
def test_a_probe_file_that_is_not_this_workers_is_measured_again(
    restart, model_dir, tmp_path, part, damage
):
    restart(model_dir)
    [kept] = remembered_files(tmp_path, "memory-probe")
    found = json.loads(kept.read_text())
    if isinstance(damage, dict):  # one figure damaged, the others as they were
        damage = {**found[part], **damage}
    kept.write_text(json.dumps({**found, part: damage}))
    log = restart(model_dir)
    assert "memory probe: ignoring what " in log and MEASURES in log
    assert json.loads(kept.read_text())["memory"]["weights"] > 0  # measured and kept again
