"""Whether mlx-lm can load a model directory, checked before the engine starts:
its weights, and a model family mlx-lm has. Each is the operator's to fix, so it
is refused at once (exit 2) rather than failing in the engine (exit 1), which a
supervisor would restart into the same failure.

mlx-lm's own loader imports MLX, which this side never does: its families are
read from its package directory, and the names it serves with another family's
module from its source (`mlx_lm/utils.py`), without running either.
"""

from __future__ import annotations

import ast
import difflib
import json
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

from smg_mlx.model_config import BadModelConfig, read_json

WEIGHTS = "model*.safetensors"  # what mlx_lm.utils.load_model reads
# mlx-lm's tables of model types served by another family's module.
REMAPPINGS = ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING")


def weights_on_disk(model_dir: Path) -> int:
    """Bytes of the model's weight files (what loading them takes, about)."""
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def missing_shards(model_dir: Path) -> tuple[list[str], int]:
    """The weight files the directory's shard index lists and it lacks, and how
    many the index lists (none: no index, or one mlx-lm would refuse itself)."""
    try:
        index = read_json(model_dir / "model.safetensors.index.json")
        shards = {name for name in index["weight_map"].values() if isinstance(name, str)}
    except (OSError, BadModelConfig, KeyError, TypeError, AttributeError):
        return [], 0
    return sorted(name for name in shards if not (model_dir / name).is_file()), len(shards)


def check(model_dir: Path) -> None:
    """Raises BadModelConfig, saying what to fix, when mlx-lm cannot load `model_dir`."""
    if not any(model_dir.glob(WEIGHTS)):
        raise BadModelConfig(
            f"{model_dir} has no weights (no {WEIGHTS} file): serve an mlx-lm model directory "
            "(other formats' weights, such as PyTorch's, need converting with mlx_lm.convert)"
        )
    for weights in sorted(model_dir.glob(WEIGHTS)):
        # (A safetensors file begins with its header's 8-byte length.)
        if not weights.is_file() or weights.stat().st_size < 8:
            what = "not a file" if not weights.is_file() else "empty, or all but empty"
            raise BadModelConfig(
                f"{weights} is {what}: not a weights file; copy it in again, or download "
                "the model again"
            )
    absent, listed = missing_shards(model_dir)
    if absent:
        raise BadModelConfig(
            f"{model_dir} lacks {len(absent)} of the {listed} weight files its "
            f"model.safetensors.index.json lists ({absent[0]} first): copy them in, or "
            "download the model again"
        )
    config_file = model_dir / "config.json"
    config = read_json(config_file)
    family = config.get("model_type")
    if family is None or family == "":
        raise BadModelConfig(f"{config_file} names no model_type (the model's family)")
    if not isinstance(family, str):
        raise BadModelConfig(f"{config_file} gives model_type as {family!r}, not a family's name")
    _check_settings(config_file, config)
    generation = model_dir / "generation_config.json"
    why = _unreadable_to_mlx_lm(generation)
    if why is not None:
        raise BadModelConfig(
            f"{generation} {why}: mlx-lm reads it as it loads the model (even with "
            "--generation-config none) and fails on it; fix the file or remove it"
        )
    known = families()
    if known is not None and family not in known:
        # A few: the single nearest of 'qwen99' is 'qwen', where qwen2 or qwen3 was meant.
        nearest = ", ".join(map(repr, difflib.get_close_matches(family, known, n=3)))
        raise BadModelConfig(
            f"{config_file} names model_type {family!r}, a model family mlx-lm "
            f"{version('mlx-lm')} does not have" + (f" (the nearest: {nearest})" if nearest else "")
        )


def _check_settings(config_file: Path, config: dict) -> None:
    """Refuse settings of config.json of the wrong shape, in the file's words:
    transformers and mlx-lm would say it in their own (a list for rope_scaling
    is "rope_parameters" to transformers, a text for quantization a TypeError)."""
    fix = "fix it, or serve the config.json that came with the model"
    rope = config.get("rope_scaling")
    if rope is not None and not isinstance(rope, dict):
        raise BadModelConfig(
            f"{config_file} gives rope_scaling as {json.dumps(rope)}, not an object (such as "
            f'{{"rope_type": "linear", "factor": 2.0}}): {fix}'
        )
    quantization = config.get("quantization")
    if quantization is None:
        return
    shape = 'an object such as {"group_size": 64, "bits": 4}, as mlx_lm.convert writes it'
    if not isinstance(quantization, dict):
        raise BadModelConfig(
            f"{config_file} gives quantization as {json.dumps(quantization)}: it must be "
            f"{shape}; {fix}"
        )
    for key in ("group_size", "bits"):
        if type(quantization.get(key)) is not int:  # (true is no number of bits)
            what = f"as {json.dumps(quantization[key])}" if key in quantization else "none"
            raise BadModelConfig(
                f"{config_file} gives quantization's {key} {what}: it must be a whole number, "
                f"in {shape}; {fix}"
            )


def _unreadable_to_mlx_lm(path: Path) -> str | None:
    """Why mlx-lm's loader would fail on the generation config `path` (None: it
    reads it, or passes over it: text that is not JSON, or no such file)."""
    if not path.exists():
        return None
    if not path.is_file():
        return "is not a file"
    try:
        value = json.loads(path.read_bytes().decode())
    except UnicodeDecodeError:
        return "is not UTF-8 text"
    except ValueError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if isinstance(value, dict):
        return None
    return f"holds a JSON {type(value).__name__}, not an object"


def families() -> frozenset[str] | None:
    """The model types mlx-lm loads; None where its files cannot be read as expected
    (another layout): the engine's load then says what it says."""
    spec = find_spec("mlx_lm")  # a top-level package: found, not imported
    if spec is None or spec.origin is None:
        return None
    package = Path(spec.origin).parent
    modules = {p.stem for p in (package / "models").glob("*.py") if p.stem != "__init__"}
    try:
        tree = ast.parse((package / "utils.py").read_text())
        tables = {
            target.id: ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name) and target.id in REMAPPINGS
        }
    except (OSError, SyntaxError, ValueError):
        return None
    if not modules or set(tables) != set(REMAPPINGS):
        return None
    remapped = set(tables["MODEL_REMAPPING"])
    remapped.update(family for family, _ in tables["MODEL_ARCHITECTURE_REMAPPING"])
    return frozenset(modules | remapped)
