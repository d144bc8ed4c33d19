"""The random-weight model every system loads, built once per shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Named shapes; the flags are `python -m smg_mlx.demo_model`'s.
SHAPES: dict[str, list[str]] = {
    # The CPU workload of the issue: demo_model's defaults (hidden 64, 2 layers, float32).
    "tiny": [],
    # Qwen3-0.6B's shapes, random bf16 weights: the GPU workload.
    "qwen3-0.6b": [
        "--family", "qwen3", "--hidden-size", "1024", "--layers", "28", "--heads", "16",
        "--kv-heads", "8", "--head-dim", "128", "--intermediate-size", "3072",
        "--vocab-size", "151936", "--tie-word-embeddings", "--dtype", "bfloat16",
        "--context-length", "40960",
    ],
}  # fmt: skip


def ensure_model(shape: str, root: Path) -> Path:
    """The model directory for `shape` under `root`, built by a child process if missing.

    A child process, because building runs MLX and the bench process itself
    never should (it only measures); built aside and renamed, so an
    interrupted build is never mistaken for a model.
    """
    out = root / shape
    if (out / "model.safetensors").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{shape}.tmp"
    subprocess.run(
        [sys.executable, "-m", "smg_mlx.demo_model", str(tmp), *SHAPES[shape]],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    tmp.rename(out)
    return out


def describe(model_dir: Path) -> dict:
    """The config facts the report names."""
    config = json.loads((model_dir / "config.json").read_text())
    keys = (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
        "tie_word_embeddings", "torch_dtype",
    )  # fmt: skip
    return {"path": str(model_dir), **{k: config.get(k) for k in keys}}
