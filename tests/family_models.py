"""Tiny random-weight models of mlx-lm model families, built offline.

`build_family_model(out, family)` writes a model directory that `mlx_lm.load`
reads: `config.json`, `model.safetensors` and the demo model's tokenizer. The
tests use them to check how the worker serves each kind of family (exact
attention models, hybrids whose recurrent state a padded batch corrupts,
families that cannot batch at all).

Building runs MLX, so it happens in a child process (`python -m
tests.family_models OUT --family F`), as `smg_mlx.demo_model.build_model` does:
the test process never touches MLX.

The weights are drawn with std WEIGHT_STD (seeded; FAMILY_WEIGHT_STD for a
few families), large enough that greedy output varies from step to step and
prompt to prompt: with the families' own small initial values most of these
models repeat one token forever, and an equality test between two ways of
running them would prove nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from smg_mlx.demo_model import built_aside

REPO = Path(__file__).resolve().parent.parent
VOCAB_SIZE = 384
WEIGHT_STD = 0.15
# Families that settle into repeating a token at WEIGHT_STD (measured with 8
# prompts of 7-150 tokens, 24 greedy tokens each) but vary at this one.
FAMILY_WEIGHT_STD = {"gemma2": 0.1, "rwkv7": 0.1}

# Keys every family gets; a family's ModelArgs ignores those it has no field for.
BASE_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

# The Mamba-2 mixer's shape, shared by the families that use one.
_MAMBA2 = {"ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1}

# mlx-lm family (its `mlx_lm.models.<family>` module) -> (HF architecture, config
# overrides). Hybrids list both kinds of layer.
FAMILIES: dict[str, tuple[str, dict]] = {
    # Exact under batching today: the controls.
    "llama": ("LlamaForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        # Three sliding-window layers (a rotating cache that wraps on long
        # prompts), then one global layer.
        {
            "num_hidden_layers": 4,
            "sliding_window": 32,
            "sliding_window_pattern": 4,
            "query_pre_attn_scalar": 16,
            "rope_local_base_freq": 10000.0,
        },
    ),
    "mamba2": (
        "Mamba2ForCausalLM",
        {
            **_MAMBA2,
            "num_heads": 8,
            "state_size": 16,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_limit": [0.0, float("inf")],
            "time_step_rank": "auto",
        },
    ),
    "falcon_h1": (
        "FalconH1ForCausalLM",
        # Every layer runs attention and a Mamba-2 mixer side by side.
        {
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
            "rope_theta": 10000.0,
        },
    ),
    # Wrong or failing under batching in mlx-lm 0.32.2 (issue 42).
    "nemotron_h": (
        "NemotronHForCausalLM",
        {
            **_MAMBA2,
            "hybrid_override_pattern": ["M", "*", "M", "-"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "attention_bias": False,
            "mlp_bias": False,
            "use_bias": False,
            "use_conv_bias": True,
            "layer_norm_epsilon": 1e-5,
        },
    ),
    "jamba": (
        "JambaForCausalLM",
        # Mamba, attention, Mamba, Mamba. One expert: dense MLPs, because
        # mlx's CPU backend has no bf16 gather matmul (MoE stays float32-only).
        {
            "num_hidden_layers": 4,
            "attn_layer_offset": 1,
            "attn_layer_period": 4,
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "num_experts": 1,
            "num_experts_per_tok": 1,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
        },
    ),
    "mamba": (
        "MambaForCausalLM",
        {
            "state_size": 16,
            "conv_kernel": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_rank": "auto",
        },
    ),
    "olmo_hybrid": (
        "OlmoHybridForCausalLM",
        # Gated-delta linear attention, then full attention, twice.
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention"] * 2,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "linear_allow_neg_eigval": True,
            "attention_bias": False,
        },
    ),
    "rwkv7": (
        "RWKV7ForCausalLM",
        {
            "norm_eps": 1e-5,
            "a_low_rank_dim": 16,
            "v_low_rank_dim": 16,
            "gate_low_rank_dim": 16,
            "decay_low_rank_dim": 16,
        },
    ),
    "recurrent_gemma": (
        "RecurrentGemmaForCausalLM",
        # Recurrent, recurrent, local attention (a 32-token window).
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            "block_types": ["recurrent", "recurrent", "attention"],
            "attention_window_size": 32,
            "conv1d_width": 4,
            "logits_soft_cap": 30.0,
            "attention_bias": False,
        },
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        # Grouped-query attention (4 query heads on 2 KV heads): the case whose
        # padded batch cannot broadcast its mask.
        {"query_pre_attn_scalar": 16},
    ),
    "llama4": (
        "Llama4ForConditionalGeneration",
        # Three chunked-attention layers, then one global one; MoE every other
        # layer. Its settings live under `text_config` (see `family_config`).
        {
            "num_hidden_layers": 4,
            "attention_chunk_size": 32,
            "interleave_moe_layer_step": 2,
            "intermediate_size_mlp": 128,
            "num_local_experts": 2,
            "num_experts_per_tok": 1,
            "attention_bias": False,
            "use_qk_norm": True,
            "rope_scaling": None,
        },
    ),
}

# Families whose settings mlx-lm reads from a nested `text_config`.
_NESTED = {"llama4"}


def family_config(family: str, dtype: str, token_ids: dict[str, int]) -> dict:
    """The whole config.json of `family`'s tiny model."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    architecture, overrides = FAMILIES[family]
    settings = {
        "model_type": family,
        **BASE_CONFIG,
        "vocab_size": VOCAB_SIZE,
        **overrides,
        **token_ids,
    }
    head = {"model_type": family, "architectures": [architecture], "torch_dtype": dtype}
    if family in _NESTED:
        return {**head, **token_ids, "text_config": settings}
    return {**settings, **head}


def _initial_value(name: str, value, mx, std: float = WEIGHT_STD):
    """The parameter `name`'s random value (MLX array `value` is the module's own).

    Matrices, embeddings, convolution kernels and per-channel mixing weights are
    drawn afresh; other vectors (biases, decay rates) keep the module's values,
    and so do norms, except a norm that starts at zero (its output would be
    zero: rwkv7's per-head norm), which gets ones. Two Mamba parameters are
    redrawn so that the recurrent state matters to the output, and a corrupted
    state shows in the tokens: the skip term `D` (at its default of ones it
    drowns out the state) and `dt_bias` (Mamba's own initial step sizes,
    log-uniform in [0.001, 0.1]: heads that remember for many tokens).
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "dt_bias":
        dt = mx.exp(mx.random.uniform(math.log(1e-3), math.log(1e-1), value.shape))
        return dt + mx.log(-mx.expm1(-dt))  # softplus(dt_bias) == dt
    if leaf == "D":
        return std * mx.random.normal(value.shape)
    if any("norm" in part for part in name.split(".")[:-1]):
        if name.endswith(".weight") and not mx.any(value).item():
            return mx.ones(value.shape)
        return value
    if value.ndim >= 2:
        return std * mx.random.normal(value.shape)
    return value


def write_family_model(out: Path, family: str, dtype: str = "float32", seed: int = 0) -> Path:
    """Write `family`'s tiny random model to `out` (uses MLX: call it in a child)."""
    import mlx.core as mx

    from smg_mlx.demo_model import save_random_model, special_token_ids, write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, VOCAB_SIZE)
    if vocab > VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {vocab} tokens, more than {VOCAB_SIZE}")
    config = family_config(family, dtype, special_token_ids(out))
    std = FAMILY_WEIGHT_STD.get(family, WEIGHT_STD)
    return save_random_model(
        out, config, dtype, seed, lambda name, value: _initial_value(name, value, mx, std)
    )


def _child(*args: str) -> str:
    """Run this module in a child process (MLX stays out of the caller); its stdout."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "tests.family_models", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
    )
    if done.returncode != 0:
        raise RuntimeError(f"python -m tests.family_models {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def build_family_model(out: Path, family: str, dtype: str = "float32") -> Path:
    """The model directory `out` of `family`, built by a child process unless it
    is there already; built aside and renamed, so an interrupted build is never
    mistaken for a model."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    if _built(out):
        return out
    return built_aside(out, lambda tmp: _child(str(tmp), "--family", family, "--dtype", dtype))


def build_family_models(root: Path, families: list[str]) -> list[Path]:
    """`root / family` for each of `families` (float32), those not there yet built
    by one child process (a child's start, MLX's import, is most of a build)."""
    missing = [f for f in families if not _built(root / f)]
    if missing:
        _child(str(root), "--families", ",".join(missing))
    return [root / f for f in families]


def _built(out: Path) -> bool:
    return (out / "model.safetensors").exists() and (out / "config.json").exists()


# Prompts of `greedy_outputs`: token ids of three different lengths.
CHECK_PROMPTS = [
    [7, 100, 23, 311, 42, 5, 250],
    list(range(10, 60)),
    [300 - 7 * i for i in range(23)],
]


def greedy_outputs(model_dirs: list[Path], max_tokens: int = 16) -> list[list[list[int]]]:
    """For each model directory, the greedy tokens of CHECK_PROMPTS, each prompt
    run alone by mlx-lm's `generate_step`; one child process for them all."""
    return json.loads(_child("--greedy", str(max_tokens), *map(str, model_dirs)))


def _greedy(model_dir: Path, max_tokens: int) -> list[list[int]]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir))
    outputs = []
    for prompt in CHECK_PROMPTS:
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
        outputs.append([int(token) for token, _ in steps])
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.family_models",
        description="Write a tiny random-weight model of an mlx-lm family to OUT, offline.",
    )
    parser.add_argument("out", type=Path, nargs="+", help="the directory to write")
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument(
        "--families", help="comma-separated: build each into OUT/<family> (one OUT)"
    )
    parser.add_argument("--dtype", default="float32", help="of the weights (default: float32)")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights (default: 0)")
    parser.add_argument(
        "--greedy",
        type=int,
        metavar="N",
        help="instead of building, print as JSON N greedy tokens of each check prompt for "
        "each model directory OUT",
    )
    args = parser.parse_args()
    if args.greedy:
        print(json.dumps([_greedy(out, args.greedy) for out in args.out]))
    elif args.family and len(args.out) == 1:
        write_family_model(args.out[0], args.family, args.dtype, args.seed)
    elif args.families and len(args.out) == 1:
        for family in args.families.split(","):
            built_aside(
                args.out[0] / family,
                lambda tmp, f=family: write_family_model(tmp, f, args.dtype, args.seed),
            )
    else:
        parser.error("building takes --family or --families, and one OUT")


if __name__ == "__main__":
    main()
