"""The random-weight models the bench measures, built once under the work folder."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from smg_mlx.demo_model import build_model

# Named shapes; the flags are `python -m smg_mlx.demo_model`'s.
SHAPES: dict[str, list[str]] = {
    # The CPU workload: demo_model's defaults (hidden 64, 2 layers, float32).
    "tiny": [],
    # A small llama for CPU runs where prefill must take time (the mixed workload):
    # 2,000 prompt tokens take seconds on two cores.
    "small": [
        "--hidden-size", "192", "--layers", "4", "--heads", "4", "--kv-heads", "2",
        "--intermediate-size", "512", "--context-length", "8192",
    ],
    # Qwen3-0.6B's shapes, random bf16 weights: the GPU workload.
    "qwen3-0.6b": [
        "--family", "qwen3", "--hidden-size", "1024", "--layers", "28", "--heads", "16",
        "--kv-heads", "8", "--head-dim", "128", "--intermediate-size", "3072",
        "--vocab-size", "151936", "--tie-word-embeddings", "--dtype", "bfloat16",
        "--context-length", "40960",
    ],
    # Qwen3-8B's shapes, random bf16 weights: slow enough on one GPU for model
    # parallel over several to pay.
    "qwen3-8b": [
        "--family", "qwen3", "--hidden-size", "4096", "--layers", "36", "--heads", "32",
        "--kv-heads", "8", "--head-dim", "128", "--intermediate-size", "12288",
        "--vocab-size", "151936", "--dtype", "bfloat16", "--context-length", "40960",
    ],
    # Llama-3-8B's shapes, random bf16 weights: speculative decoding's targets.
    "llama-8b": [
        "--family", "llama", "--hidden-size", "4096", "--layers", "32", "--heads", "32",
        "--kv-heads", "8", "--intermediate-size", "14336", "--vocab-size", "128256",
        "--dtype", "bfloat16", "--context-length", "8192",
    ],
    # Llama-3.2-1B's shapes (its tokenizer is llama-8b's): a draft for llama-8b.
    "llama-1b": [
        "--family", "llama", "--hidden-size", "2048", "--layers", "16", "--heads", "32",
        "--kv-heads", "8", "--intermediate-size", "8192", "--vocab-size", "128256",
        "--tie-word-embeddings", "--dtype", "bfloat16", "--context-length", "8192",
    ],
}  # fmt: skip


def ensure_model(shape: str, root: Path) -> Path:
    """The model directory for `shape` under `root`, built on first use (in a child
    process: the bench itself never runs MLX, it only measures)."""
    return build_model(root / shape, SHAPES[shape])


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --shape and --work-dir, for the benches that run a model in process."""
    p.add_argument("--model", type=Path, help="a model directory (else one built of --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="the random-weight model built where --model is not given")  # fmt: skip
    p.add_argument("--work-dir", type=Path, default=Path(".bench/models"),
                   help="where built models are kept")  # fmt: skip


def load_model(args: argparse.Namespace) -> Any:
    """The model those flags name, loaded in this process."""
    from mlx_lm import load  # (the bench's own process runs no MLX: imported here)

    return load(str(args.model or ensure_model(args.shape, args.work_dir)))[0]


def quantizable(model: Any, bits: int, group_size: int, instead: str) -> bool:
    """Whether a loaded model's KV can be stored in `bits` at `group_size`; if
    not, the worker's reason on stderr, and what to give `instead` here."""
    from smg_mlx.config import EngineConfig
    from smg_mlx.engine.batch import kv_format
    from smg_mlx.engine.types import Unservable

    config = EngineConfig(model_path=Path("."), kv_bits=bits, kv_group_size=group_size)
    try:
        kv_format.caches_for(config, model)
    except Unservable as exc:
        print(f"skipped: {exc} (here: {instead})", file=sys.stderr)
        return False
    return True


def describe(model_dir: Path) -> dict:
    """The config facts the report names."""
    config = json.loads((model_dir / "config.json").read_text())
    keys = (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
        "tie_word_embeddings", "torch_dtype",
    )  # fmt: skip
    return {"path": str(model_dir), **{k: config.get(k) for k in keys}}
