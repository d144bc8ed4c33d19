"""The family test models are what the batching tests need: each loads offline
with `mlx_lm.load`, and its greedy output varies (an equality test between two
ways of running a model that repeats one token would prove nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from family_models import FAMILIES, build_family_model, greedy_outputs


@pytest.fixture(scope="module")
def greedy(family_model) -> dict[str, list[list[int]]]:
    """Each family's greedy outputs (run in one child)."""
    families = sorted(FAMILIES)
    paths = [family_model(family) for family in families]
    return dict(zip(families, greedy_outputs(paths), strict=True))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_model_loads_and_its_greedy_output_varies(
    family_model, greedy: dict[str, list[list[int]]], family: str
) -> None:
    config = json.loads((family_model(family) / "config.json").read_text())
    assert config["model_type"] == family
    outputs = greedy[family]
    for tokens in outputs:
        assert len(set(tokens)) > 2, f"{family} repeats itself: {tokens}"
    assert len({tuple(tokens) for tokens in outputs}) == len(outputs), outputs


def test_build_returns_at_once_when_the_model_is_there(family_model) -> None:
    path = family_model("llama")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_family_model(path, "llama") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_unknown_family_is_refused_before_any_child_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown family"):
        build_family_model(tmp_path / "x", "no_such_family")
    assert not (tmp_path / "x").exists()
