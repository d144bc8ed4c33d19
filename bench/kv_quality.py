"""What --kv-bits changes in a model's output (`python -m bench.kv_quality`).

For each model and each setting (8 and 4 bits), against the model's own KV
cache: a prompt of random token ids, then the model's own greedy continuation
with its own cache (the reference). The same tokens are fed again with a
quantized cache, the prompt in chunks as the worker prefills and the rest one
token at a time as it decodes, and at every continuation position we compare
the next-token distributions:

- KL divergence of the quantized run's distribution from the reference's,
  mean and 99th percentile, in nats;
- top-1 agreement: how often the quantized run's most likely token is the
  reference's greedy token (where the reference's two likeliest tokens are
  close, the median margin between them says how close, a small change flips it);
- free-running greedy: how many tokens the quantized run's own greedy output
  matches the reference before the first difference.

Random-weight models say how far the cache's rounding moves a distribution of
a given sharpness (the reference's mean entropy is reported beside it), not
what a trained model loses on real text: run it with `--model` on yours.
It runs MLX in this process, through the worker's own quantized cache (a
batch of one row) and quantized attention, so on any backend it measures what
the worker does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import KVCache

from bench.model import quantizable
from smg_mlx.config import KV_GROUP_SIZES
from smg_mlx.demo_model import build_model
from smg_mlx.engine.batch import quantized_attention
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache

# Test models whose heads split into quantization groups (64), with greedy
# output that varies: the suite's (float32) and a wider, deeper one.
MODELS: dict[str, list[str]] = {
    "tiny-head64": ["--head-dim", "64"],
    "small-head64": [
        "--hidden-size", "256", "--layers", "6", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "64", "--intermediate-size", "768", "--context-length", "8192",
    ],
}  # fmt: skip
PREFILL_CHUNK = 512


def _next_logprobs(model, tokens: list[int], cache: list, prompt_len: int) -> mx.array:
    """Log-probabilities of the token after each continuation position (the last
    prompt position on), with the prompt prefilled in chunks and the rest fed one
    token at a time."""
    rows = []
    for start in range(0, prompt_len, PREFILL_CHUNK):
        chunk = tokens[start : min(start + PREFILL_CHUNK, prompt_len)]
        logits = model(mx.array([chunk]), cache=cache)
    rows.append(logits[0, -1])
    for token in tokens[prompt_len:-1]:
        rows.append(model(mx.array([[token]]), cache=cache)[0, -1])
        mx.eval(rows[-1])
    logits = mx.stack(rows).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _greedy(model, prompt: list[int], n: int, cache: list) -> list[int]:
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(logits)))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def measure(model_dir: Path, prompt_len: int, new_tokens: int, group: int,
            seed: int, widths: tuple[int, ...] = (8, 4)) -> dict | None:  # fmt: skip
    """The model's figures at each of `widths` bits (None: its KV cannot be
    quantized at `group`, said why)."""
    quantized_attention.install(None)
    model, _ = load(str(model_dir))
    if not quantizable(model, 8, group, "--model: a model whose heads --kv-group-size divides"):
        return None
    layers = len(model.layers)
    vocab = model.args.vocab_size
    prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).tolist()

    def own() -> list:
        return [KVCache() for _ in range(layers)]

    reference = _greedy(model, prompt, new_tokens, own())
    tokens = prompt + reference
    ref_lp = _next_logprobs(model, tokens, own(), prompt_len)
    entropy = float(-(mx.exp(ref_lp) * ref_lp).sum(-1).mean())
    top2 = mx.sort(ref_lp, axis=-1)[:, -2:]
    margin = float(np.median(np.array(top2[:, 1] - top2[:, 0])))
    result = {
        "model": str(model_dir), "prompt_tokens": prompt_len, "new_tokens": new_tokens,
        "distinct_reference_tokens": len(set(reference)), "reference_entropy_nats": entropy,
        "reference_top1_margin_nats": margin,
        "settings": {},
    }  # fmt: skip
    for bits in widths:

        def quantized(bits: int = bits) -> list:
            return [BatchQuantizedKVCache([0], group_size=group, bits=bits) for _ in range(layers)]

        lp = _next_logprobs(model, tokens, quantized(), prompt_len)
        kl = np.array((mx.exp(ref_lp) * (ref_lp - lp)).sum(-1))
        top1 = np.array(mx.argmax(lp, axis=-1)) == np.array(reference)
        free = _greedy(model, prompt, new_tokens, quantized())
        pairs = enumerate(zip(free, reference, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), new_tokens)
        result["settings"][f"{bits}-bit, group {group}"] = {
            "kl_mean_nats": float(kl.mean()),
            "kl_p99_nats": float(np.percentile(kl, 99)),
            "top1_agreement": float(top1.mean()),
            "greedy_tokens_before_first_difference": same,
        }
    return result


def format_row(r: dict) -> list[str]:
    name = Path(r["model"]).name
    lines = []
    for setting, s in r["settings"].items():
        lines.append(
            f"| {name} | {setting} | {s['kl_mean_nats']:.2e} | {s['kl_p99_nats']:.2e} | "
            f"{100 * s['top1_agreement']:.1f}% | "
            f"{s['greedy_tokens_before_first_difference']} of {r['new_tokens']} | "
            f"{r['reference_entropy_nats']:.2f} | {r['reference_top1_margin_nats']:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.kv_quality",
        description=__doc__,
        formatter_class=type("Formatter", (argparse.RawDescriptionHelpFormatter,
                                           argparse.ArgumentDefaultsHelpFormatter), {}),
    )
    p.add_argument(
        "--model",
        type=Path,
        action="append",
        help="a model directory (repeatable; default: the bench's test models)",
    )
    p.add_argument("--work-dir", type=Path, default=Path(".bench"), help="the test models")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="each model's prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens compared after it")
    p.add_argument("--kv-group-size", type=int, default=64, choices=KV_GROUP_SIZES,
                   help="the quantization's group size")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the prompt's")
    p.add_argument("--out", type=Path, help="JSON results")
    args = p.parse_args(argv)
    for path in args.model or ():
        if not path.is_dir():
            p.error(f"--model {path}: not a folder (an mlx-lm model directory)")
    models = args.model or [build_model(args.work_dir / n, a) for n, a in MODELS.items()]
    head = ("model", "KV", "KL mean (nats)", "KL p99", "top-1 agrees", "greedy same for",
            "entropy", "top-1 margin")  # fmt: skip
    print(f"| {' | '.join(head)} |\n|{'---|' * len(head)}")
    results = []
    for model_dir in models:
        r = measure(model_dir, args.prompt_tokens, args.new_tokens, args.kv_group_size, args.seed)
        if r is None:
            continue
        results.append(r)
        print("\n".join(format_row(r)), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
