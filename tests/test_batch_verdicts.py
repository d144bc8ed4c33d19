"""Start-up's batch check runs once per model and machine: its verdict is
remembered across restarts, an explicit --batching skips it, and a verdict
file that is not this model's or cannot be read is never trusted."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from smg_mlx.engine import progress

from helpers import remembered_files

CHECKS = "batch check: running prompts"
REMEMBERED = "batch check: remembered verdict"


def verdict_files(tmp_path: Path) -> list[Path]:
    return remembered_files(tmp_path, "batch-check")


def test_the_second_start_of_a_model_reuses_its_verdict(restart, model_dir, tmp_path):
    first = restart(model_dir)
    assert CHECKS in first and REMEMBERED not in first
    [kept] = verdict_files(tmp_path)
    assert json.loads(kept.read_text())["mode"] == "batched"
    second = restart(model_dir)
    assert CHECKS not in second
    assert f"{REMEMBERED} batched from " in second
    assert "serving batched: batching changes no output (as checked on " in second
    # --batching check checks again, and remembers what it finds.
    again = restart(model_dir, batching="check")
    assert CHECKS in again and REMEMBERED not in again
    assert verdict_files(tmp_path) == [kept]


def test_another_models_weights_are_checked_again(restart, model_dir, other_model_dir, tmp_path):
    restart(model_dir)
    log = restart(other_model_dir)  # the same shapes and files, other weights
    assert CHECKS in log and REMEMBERED not in log
    assert len(verdict_files(tmp_path)) == 2


@pytest.mark.parametrize(
    "damage", ["garbage", "another model's", "a link", "a folder", "a list", "text for seconds"]
)
def test_a_verdict_file_that_is_not_this_models_is_ignored_and_checked_again(
    restart, model_dir, tmp_path, damage
):
    restart(model_dir)
    [kept] = verdict_files(tmp_path)
    outside = tmp_path / "outside.json"
    outside.write_text(kept.read_text())
    if damage == "garbage":
        kept.write_bytes(b"\x00{not json")
    elif damage == "another model's":
        kept.write_text(kept.read_text().replace('"fingerprint": "', '"fingerprint": "0'))
    elif damage == "a list":
        kept.write_text("[1, 2]")
    elif damage == "text for seconds":  # (its log line failed with a traceback)
        kept.write_text(json.dumps({**json.loads(kept.read_text()), "seconds": "x"}))
    elif damage == "a link":  # never followed: not read, and not written through
        kept.unlink()
        kept.symlink_to(outside)
    else:
        kept.unlink()
        kept.mkdir()
    before = outside.read_text()
    log = restart(model_dir)
    assert "batch check: ignoring what " in log and "Traceback" not in log
    assert CHECKS in log and REMEMBERED not in log
    assert outside.read_text() == before
    if damage == "a list":
        assert "(ValueError: not a JSON object)" in log
    if damage != "a folder":  # the check's verdict replaces it
        assert json.loads(kept.read_text())["mode"] == "batched"
        assert not kept.is_symlink()


@pytest.mark.parametrize("mode", ["batched", "equal-lengths", "one-at-a-time"])
def test_a_mode_named_by_batching_skips_the_check(restart, model_dir, tmp_path, mode):
    log = restart(model_dir, batching=mode)
    assert f"batch check: skipped, --batching names {mode}" in log
    assert CHECKS not in log and not verdict_files(tmp_path)
    if mode == "batched":
        assert "serving batched as --batching asks (not checked: " in log
    else:
        assert f"serving {mode}, which is slower than batched: " in log


def test_a_mode_a_remembered_check_found_wrong_is_not_served(restart, family_model):
    # mamba (v1) runs padding through its state: the check serves it equal-lengths.
    model = family_model("mamba")
    restart(model)
    log = restart(model, batching="batched")
    assert CHECKS not in log
    assert (
        "serving equal-lengths, which is slower than batched: prompts prefill together only at "
        "equal lengths, since batched, its rows come out other than alone"
    ) in log
    assert "not batched as --batching asks, which would change outputs" in log


def test_a_long_check_says_how_far_it_has_come(restart, model_dir, monkeypatch):
    monkeypatch.setattr(progress, "EVERY_SECONDS", 0.0)
    log = restart(model_dir)
    assert "batch check: 1 of 5 runs, " in log  # its total known from the first line
    assert "batch check: 5 of 5 runs, " in log
    assert "memory probe: 1 of 3 prompts, " in log
    assert "warm-up: one short request ran, in " in log


def test_a_cache_folder_that_cannot_be_written_is_one_warning_of_the_start_ups_checks(
    start_worker, model_dir, tmp_path, caplog
):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.INFO, logger="smg_mlx.engine.remembered"):
        start_worker(model_dir, prompt_cache_dir=blocked, prompt_cache_disk_bytes=0)
    said = [r for r in caplog.records if "cannot remember it in" in r.getMessage()]
    # The batch check's verdict and the memory probe's figures, one warning between them.
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO], said
