"""Build small random-weight mlx-lm models on disk, offline.

`smg-mlx serve --demo` (and so `make serve`) serves one (its text is noise);
`python -m smg_mlx.demo_model OUT` writes one for a user to try things with
(README: "Small models to try things with"); the tests and the bench build
their own. The weights are random but fixed by a seed, so greedy output is
deterministic. Building runs MLX, so callers use `build_model`, which runs
`write_model` in a child process: in the worker only the engine thread touches
MLX, and the tests and the bench never do.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from subprocess import PIPE
from typing import Any

from smg_mlx import __version__
from smg_mlx.config import cache_home

log = logging.getLogger(__name__)

# How long a build asked to stop may take before it is killed.
STOP_SECONDS = 5.0
# The builds under way (their processes, and the folders they write), for `stop_builds`;
# a build starts under `_starting`, and none once `_stopped`.
_building: dict[subprocess.Popen, Path] = {}
_starting = threading.Lock()
_stopped = False

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. MLX runs models on Apple silicon. "
    "A worker streams tokens to the router as soon as they are made. "
    "Hello, world! How are you today? 0123456789 user assistant system "
)


# Model families write_model can write: mlx-lm module name -> HF architecture.
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The tokenizer's vocabulary: the model's is this at least (--vocab-size: more).
TOKENIZER_VOCAB = 512
# MLX's arrays are at most this wide (a dimension is an int32).
MOST_WIDTH = (1 << 31) - 1


def default_demo_dir() -> Path:
    return cache_home() / f"demo-llama-{__version__}"


# Special tokens a family's tokenizer class adds where the vocabulary lacks
# them, past the model's ids (transformers' Qwen2Tokenizer: its unk token).
FAMILY_TOKENS = {"qwen2": ("<|endoftext|>",)}


def write_tokenizer(out: Path, vocab_size: int, family: str = "llama") -> int:
    """Train a byte-level BPE tokenizer on a fixed corpus (with the special
    tokens `family`'s tokenizer class expects); returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[
            PAD, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>", *FAMILY_TOKENS.get(family, ())
        ],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "model_max_length": 1 << 30,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def write_model(
    out: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    context_length: int = 2048,
    llama3_rope: bool = True,
    dtype: str = "float32",
    vocab_size: int = TOKENIZER_VOCAB,
    seed: int = 0,
    sliding_window: int | None = None,
    family: str = "llama",
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    model_vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random-weight model directory that `mlx_lm.load` reads (uses MLX).

    `family` is one of FAMILIES (benchmarks use a Qwen3-shaped model on GPUs; qwen2
    splits as a pipeline over several ranks).
    `model_vocab_size` lets the model's vocabulary exceed the small trained
    tokenizer's, so embedding and output shapes match a real model's.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(out, vocab_size, family)
    config = {
        "model_type": family,
        "architectures": [FAMILIES[family]],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size or hidden_size * 2,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "rms_norm_eps": 1e-5 if family == "llama" else 1e-6,
        "vocab_size": max(vocab, model_vocab_size or 0),
        "max_position_embeddings": context_length,
        "rope_theta": 10000.0 if family == "llama" else 1000000.0,
        "tie_word_embeddings": tie_word_embeddings,
        **special_token_ids(out),
        "torch_dtype": dtype,
    }
    if llama3_rope and family == "llama":
        # Rope frequencies computed lazily at construction: the case that
        # crashes servers which load on one thread and generate on another.
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": context_length // 2,
        }
    if sliding_window:
        # Every other layer attends to a window: a rotating cache that cannot be
        # cut back once it wraps (what the prefix cache must handle).
        config["sliding_window"] = sliding_window
        # One type per layer: transformers refuses a list of another length.
        config["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)
        ]
    return save_random_model(out, config, dtype, seed)


def weight_count(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head: int, intermediate: int,
    vocab: int, tied: bool,
) -> int:  # fmt: skip
    """The weights of a model of these sizes, about: its matrices (norms and
    biases are a rounding error)."""
    attention = hidden * head * (2 * heads + 2 * kv_heads)  # q and o, k and v
    return vocab * hidden * (1 if tied else 2) + layers * (attention + 3 * hidden * intermediate)


def special_token_ids(out: Path) -> dict[str, int]:
    """The config's ids of the special tokens of the tokenizer in `out`."""
    ids = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    return {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}


def save_random_model(
    out: Path,
    config: dict,
    dtype: str,
    seed: int,
    draw: Callable[[str, Any], Any] | None = None,
) -> Path:
    """Write `config` and random weights of its model (mlx-lm's module for its
    model_type) to `out`: the module's own initial values from `seed`, each
    passed through `draw(name, value)` if given, as `dtype` (uses MLX)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {
        name: (draw(name, value) if draw else value).astype(getattr(mx, dtype))
        for name, value in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def built_aside(out: Path, build: Callable[[Path], object]) -> Path:
    """`out`, written by `build` into a directory beside it and renamed into
    place, so that an interrupted build is never mistaken for a model (where
    another process finished first, its copy stays)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for left in out.parent.glob(f".{out.name}.tmp*"):  # by builds stopped by a signal
        if not _alive(left.name.rpartition(".tmp")[2]):
            shutil.rmtree(left, ignore_errors=True)
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _alive(pid: str) -> bool:
    """Whether a process of this number runs (True where it cannot be told)."""
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's
    return True


def build_model(out: Path, args: Sequence[str] = ()) -> Path:
    """The model directory `out`, written by a child process (`main` with `args`)
    unless it is there already. Built aside and renamed, so an interrupted build
    is never mistaken for a model."""
    if (out / "model.safetensors").exists():
        return out

    def build(tmp: Path) -> None:
        command = [sys.executable, "-m", "smg_mlx.demo_model", str(tmp), *args]
        with _starting:  # (so that `stop_builds` meets every build that started)
            if _stopped:
                raise RuntimeError(f"building the model in {out}: the worker is stopping")
            child = subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True)
            _building[child] = tmp
        with child:
            try:
                said = child.communicate()[1]
            except BaseException:  # (a signal, on the main thread: not waited for)
                child.kill()
                raise
            finally:
                _building.pop(child, None)
        if child.returncode != 0:
            raise RuntimeError(f"building the model in {out} failed:\n{said}")

    return built_aside(out, build)


def stop_builds() -> None:
    """End the builds under way and remove what they wrote, and start none
    after: the worker stops while it starts, and exits without waiting for the
    thread that waits for them (a child would outlive it, still writing)."""
    global _stopped
    with _starting:
        _stopped = True
        building = list(_building.items())
    for child, tmp in building:
        child.terminate()
        try:
            child.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_demo_model() -> Path:
    """The demo model directory, built on first use."""
    path = default_demo_dir()
    if not (path / "model.safetensors").exists():
        log.info("building the demo model in %s (first run only)", path)
    return build_model(path)


def _check_fits(parser: argparse.ArgumentParser, args: argparse.Namespace, head: int) -> None:
    """Refuse sizes MLX cannot build (it crashes, or fails in its own words): arrays
    wider than it takes, or weights more than the machine's memory holds while
    they are made (float32 first, then a copy as --dtype)."""
    from smg_mlx.engine.memory.probe import host_memory
    from smg_mlx.logs import format_bytes as size

    intermediate = args.intermediate_size or 2 * args.hidden_size
    vocab = max(TOKENIZER_VOCAB, args.vocab_size or 0)
    widest = max(args.hidden_size, intermediate, vocab, args.heads * head)
    if widest > MOST_WIDTH:
        parser.error(f"weights {widest} wide: MLX's arrays are at most {MOST_WIDTH} wide; give "
                     "smaller --hidden-size, --intermediate-size, --vocab-size or --heads "
                     "x --head-dim")  # fmt: skip
    count = weight_count(
        hidden=args.hidden_size, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        head=head, intermediate=intermediate, vocab=vocab, tied=args.tie_word_embeddings,
    )  # fmt: skip
    weights = count * (4 if args.dtype == "float32" else 2)
    building = count * 4 + (weights if args.dtype != "float32" else 0)
    made = f"; {size(building)} while they are made, in float32 first" if building > weights else ""
    memory = host_memory()
    if building > memory:
        parser.error(f"the weights would take {size(weights)} ({args.dtype}{made}): more than "
                     f"this machine's memory, {size(memory)}; give smaller --hidden-size, "
                     "--layers, --intermediate-size or --vocab-size")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m smg_mlx.demo_model",
        description="Write a random-weight mlx-lm model directory OUT, offline. Its text is "
        "noise, but it serves as a real model of its family does: serve it with "
        "`smg-mlx serve --model OUT`.",
    )
    default = " (default: %(default)s)"
    parser.add_argument(
        "out", type=lambda text: Path(text).expanduser(), help="the directory to write"
    )
    parser.add_argument(
        "--family", choices=sorted(FAMILIES), default="llama", help="model family" + default
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="hidden size" + default)
    parser.add_argument("--layers", type=int, default=2, help="layers" + default)
    parser.add_argument("--heads", type=int, default=4, help="attention heads" + default)
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads" + default)
    parser.add_argument(
        "--head-dim", type=int, help="size of a head (default: hidden / heads)"
    )
    parser.add_argument(
        "--intermediate-size", type=int,
        help="the MLP's hidden size (default: 2 x hidden size)",
    )  # fmt: skip
    parser.add_argument(
        "--vocab-size", type=int,
        help="the model's vocabulary, the tokenizer's at least (a few hundred ids): a "
        "smaller one is taken as the tokenizer's (default: the tokenizer's)",
    )
    parser.add_argument(
        "--tie-word-embeddings", action="store_true", help="share the input and output embeddings"
    )
    parser.add_argument(
        "--context-length", type=int, default=2048, help="context length" + default
    )
    parser.add_argument(
        "--no-llama3-rope", action="store_true", help="a llama without llama3 rope scaling"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
        help="of the weights" + default,
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="of the random weights" + default)
    parser.add_argument(
        "--sliding-window", type=int, help="window of every other layer (default: none)"
    )
    parser.add_argument(
        "--force", action="store_true", help="write over OUT's files where it is not empty"
    )
    args = parser.parse_args()
    for name, value in vars(args).items():
        if isinstance(value, int) and not isinstance(value, bool) and value < 1 and name != "seed":
            parser.error(f"--{name.replace('_', '-')}: expected at least 1, got {value}")
    if args.context_length < 2:
        # The worker refuses such a model: a request needs a prompt token and one to generate.
        parser.error(f"--context-length: expected at least 2 (a prompt token and one to "
                     f"generate), got {args.context_length}")  # fmt: skip
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"{args.out} is a file: name a new or empty directory")
    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        parser.error(f"{args.out} is not empty: name a new or empty directory, or give --force "
                     "to write over its files")  # fmt: skip
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.sliding_window and args.family != "llama":
        # mlx-lm's other families here read no window from the config: the model
        # would attend to everything, as if none were asked for.
        parser.error(f"--sliding-window: mlx-lm's {args.family} has no sliding windows; "
                     "use --family llama")  # fmt: skip
    if args.sliding_window and args.layers < 2:
        # mlx-lm's llama needs a layer of full attention beside the windowed ones.
        parser.error("--sliding-window windows every other layer, and needs a full-attention "
                     "layer beside them: give --layers 2 or more")  # fmt: skip
    if args.head_dim is not None and args.family == "qwen2":
        # mlx-lm's qwen2 reads no head size from the config: its heads are hidden / heads.
        if args.head_dim * args.heads != args.hidden_size:
            parser.error(f"--head-dim: mlx-lm's qwen2 makes its heads --hidden-size / --heads "
                         f"({args.hidden_size} / {args.heads}) wide: leave --head-dim out, or "
                         "use --family llama or qwen3")  # fmt: skip
    if args.head_dim is None and args.hidden_size % args.heads:
        parser.error(f"--hidden-size {args.hidden_size} does not split into --heads "
                     f"{args.heads}: give a multiple of it, or --head-dim")  # fmt: skip
    head = args.head_dim or args.hidden_size // args.heads
    if head % 2:  # RoPE turns pairs of a head's values: the worker would refuse the model
        parser.error(f"heads {head} wide: RoPE needs an even head size; give another "
                     + ("--head-dim" if args.head_dim else "--hidden-size or --heads"))
    _check_fits(parser, args, head)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"cannot make the directory {args.out}: {exc.strerror or exc}")
    write_model(
        args.out,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        context_length=args.context_length,
        llama3_rope=not args.no_llama3_rope,
        dtype=args.dtype,
        seed=args.seed,
        sliding_window=args.sliding_window,
        family=args.family,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        model_vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    print(f"wrote a random-weight {args.family} model ({args.dtype}) to {args.out}: "
          f"serve it with `smg-mlx serve --model {args.out}`")  # fmt: skip


if __name__ == "__main__":
    main()
