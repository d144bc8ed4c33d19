"""`--adapter-path`: a LoRA adapter applied to the model as mlx-lm loads it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from smg_mlx.demo_model import build_model

from helpers import generate, prompt

RANK = 4


def write_adapter(out: Path, model_dir: Path) -> Path:
    """A LoRA adapter of random weights for the query and value projections of
    every layer, in the files mlx_lm.lora writes."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    outputs = {
        "q_proj": config["num_attention_heads"] * config["head_dim"],
        "v_proj": config["num_key_value_heads"] * config["head_dim"],
    }
    rng = np.random.default_rng(0)
    weights = {}
    for layer in range(layers):
        for name, size in outputs.items():
            key = f"model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_a"] = rng.normal(0, 0.5, (hidden, RANK)).astype(np.float32)
            weights[f"{key}.lora_b"] = rng.normal(0, 0.5, (RANK, size)).astype(np.float32)
    out.mkdir()
    save_file(weights, str(out / "adapters.safetensors"))
    lora = {"rank": RANK, "scale": 20.0, "dropout": 0.0}
    lora["keys"] = [f"self_attn.{name}" for name in outputs]
    adapter = {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": lora}
    (out / "adapter_config.json").write_text(json.dumps(adapter))
    return out


def test_an_adapter_changes_what_the_model_says(start_worker, model_dir, tmp_path, caplog):
    adapter = write_adapter(tmp_path / "adapter", model_dir)
    caplog.set_level(logging.INFO, "smg_mlx.engine.batch.loading")
    base = start_worker(model_dir)
    adapted = start_worker(model_dir, adapter_path=adapter)
    assert f"with the adapter {adapter}" in caplog.text
    prompts = [prompt(8, i) for i in range(3)]
    before = [generate(base.stub, p, max_tokens=8, ignore_eos=True).tokens for p in prompts]
    after = [generate(adapted.stub, p, max_tokens=8, ignore_eos=True).tokens for p in prompts]
    assert before != after


def test_an_adapter_made_for_another_model_is_refused_for_good(model_dir, tmp_path, refused):
    wide_model = build_model(tmp_path / "m128", ["--hidden-size", "128"])
    wider = write_adapter(tmp_path / "wider", wide_model)
    no_config = write_adapter(tmp_path / "no-config", model_dir)
    (no_config / "adapter_config.json").write_text("{}")
    for adapter in (wider, no_config):
        refusal = refused(model_dir, adapter_path=adapter)
        # 2: a restart cannot cure it (a supervisor stops trying).
        assert refusal.exit_code == 2, refusal
        assert f"--adapter-path {adapter} does not fit {model_dir}" in str(refusal)


def test_an_adapter_whose_weights_cannot_be_read_is_named(model_dir, tmp_path, refused):
    adapter = write_adapter(tmp_path / "adapter", model_dir)
    (adapter / "adapters.safetensors").write_bytes(b"not weights" * 10)
    refusal = refused(model_dir, adapter_path=adapter)
    assert refusal.exit_code == 1
    assert str(refusal).endswith(
        "(the adapter's weights file cannot be read: write or copy it again)"
    )
