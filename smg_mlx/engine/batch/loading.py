"""Loading the model on the engine thread: alone (with a LoRA adapter, if one
is named), or this rank's part of it when a group of ranks serves it."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_adapters, load_model

from smg_mlx.config import EngineConfig, cache_home
from smg_mlx.engine.batch.attention_shapes import SHAPES_REMEMBERED
from smg_mlx.engine.batch.batch_kv import steady_widths
from smg_mlx.engine.types import Unservable
from smg_mlx.logs import format_bytes, one_line
from smg_mlx.model_files import weights_on_disk

log = logging.getLogger(__name__)

# Of a reason mlx-lm gives for refusing weights: it may list every parameter.
WHY_CHARS = 300

# mlx's CUDA backend keeps per-shape caches (cuDNN attention graphs, CUDA
# graphs) and, past twice a cache's size in misses over the process's life,
# raises on every new shape: a worker that sees many prompt lengths would fail
# after hours of healthy serving. A missed shape costs one build, not an error.
# Read when each cache is first used; a value set by the operator wins.
CUDA_CACHE_SETTINGS = {
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    "MLX_CUDA_SDPA_CACHE_SIZE": str(SHAPES_REMEMBERED),
}


def kernel_folder(config: EngineConfig) -> Path:
    """Where mlx's CUDA backend keeps the kernels it compiles on first use
    (MLX_PTX_CACHE_DIR; its own default is under /tmp, which a container or a
    reboot empties: then every start compiles them again).
    Beside the batch check's verdicts, on the volume a deployment keeps; one
    folder per mlx version and device, as kernels are built for both."""
    device = re.sub(r"[^A-Za-z0-9.]+", "-", mx.device_info().get("device_name", "gpu")).strip("-")
    return (config.prompt_cache_dir or cache_home()) / "kernels" / f"mlx-{mx.__version__}-{device}"


def as_served() -> None:
    """mlx's settings the worker serves with (the benches that run passes
    without it take them too)."""
    for name, value in CUDA_CACHE_SETTINGS.items():
        os.environ.setdefault(name, value)
    if mx.cuda.is_available():
        # the kernels of a pass the same from pass to pass: its CUDA graphs replay
        steady_widths(True)


def load_for(config: EngineConfig, group: mx.distributed.Group | None) -> nn.Module:
    """The model (with its LoRA adapter, if one is named), or this rank's part
    of it when a group of ranks serves it."""
    as_served()
    if mx.cuda.is_available() and "MLX_PTX_CACHE_DIR" not in os.environ:
        # Read when the first kernel is compiled, after this.
        os.environ["MLX_PTX_CACHE_DIR"] = str(kernel_folder(config))
        log.info("kernels compiled on first use are kept in %s", os.environ["MLX_PTX_CACHE_DIR"])
    started = time.perf_counter()
    log.info("loading the weights (%s)", format_bytes(weights_on_disk(config.model_path)))
    if group is None:
        # The model alone: the worker's process tokenizes, not this one.
        model, _ = built_model(config.model_path, lazy=False, strict=True)
        adapter = config.adapter_path
        if adapter is not None:
            try:
                model = load_adapters(model, str(adapter))
            except (ValueError, AttributeError, KeyError, TypeError) as exc:
                # An adapter made for another model, or a config that misstates it.
                raise Unservable(
                    f"--adapter-path {adapter} does not fit {config.model_path} "
                    f"({type(exc).__name__}: {exc}): give an adapter trained for this model"
                ) from None
            model.eval()
        log.info(
            "weights loaded in %.1fs%s",
            time.perf_counter() - started,
            "" if adapter is None else f", with the adapter {adapter}",
        )
        _say_tf32(model)
        return model
    model, model_config = built_model(config.model_path, lazy=True, strict=False)
    family = model_config.get("model_type", "this model")
    if config.pipeline:
        if not hasattr(getattr(model, "model", None), "pipeline"):
            raise Unservable(
                f"{family} cannot be split as a pipeline (mlx-lm has no pipeline() for it); "
                "leave out --pipeline to split it tensor parallel"
            )
        try:
            model.model.pipeline(group)
        except ValueError as exc:
            raise Unservable(
                f"{family} cannot be split as a pipeline over {group.size()} ranks ({exc}): "
                "start fewer ranks, or leave out --pipeline"
            ) from None
    else:
        if not hasattr(model, "shard"):
            raise Unservable(
                f"{family} cannot be split tensor parallel (mlx-lm has no shard() for it); "
                "try --pipeline"
            )
        try:
            model.shard(group)
        except ValueError as exc:
            raise Unservable(
                f"{family} cannot be split tensor parallel over {group.size()} ranks ({exc}): "
                "start a number of ranks its sizes divide by (2 or 4, often), or try --pipeline"
            ) from None
    mx.eval(model.parameters())
    log.info(
        "rank %d of %d holds its %s part of the model (loaded in %.1fs)",
        group.rank(),
        group.size(),
        "pipeline" if config.pipeline else "tensor-parallel",
        time.perf_counter() - started,
    )
    _say_tf32(model)
    return model


def _say_tf32(model: nn.Module) -> None:
    """Tell an operator of float32 weights on CUDA that mlx multiplies them in
    TF32 (its default, MLX_ENABLE_TF32=1): rounded to TF32's 10-bit mantissa, in
    an order that depends on the batch's shape, so a row's output batched may
    differ from its output alone where two tokens nearly tie (with quantized KV
    more so: a small difference moves a code to its neighbour)."""
    if not mx.cuda.is_available() or os.environ.get("MLX_ENABLE_TF32") == "0":
        return
    if any(w.ndim == 2 and w.dtype == mx.float32 for _, w in tree_flatten(model.parameters())):
        log.info(
            "float32 weights: mlx multiplies them in TF32 on CUDA, so outputs solo and batched "
            "may differ where two tokens nearly tie; MLX_ENABLE_TF32=0 makes them the same "
            "(slower)"
        )


def built_model(path: Path, lazy: bool, strict: bool) -> tuple[nn.Module, dict]:
    """mlx-lm's model of `path` and its config. A config.json that lacks what its
    family's settings need, or weights that do not fit the model it describes,
    are refused naming the directory: restarts cannot cure either."""
    try:
        return load_model(path, lazy=lazy, strict=strict)
    except (TypeError, KeyError) as exc:
        raise Unservable(
            f"cannot build the model {path}/config.json describes ({type(exc).__name__}: "
            f"{exc}): the file lacks or misstates settings its model_type needs"
        ) from None
    except ValueError as exc:
        said = one_line(exc)
        said = said if len(said) <= WHY_CHARS else said[:WHY_CHARS] + " …"
        if not _raised_in(exc, "load_weights"):
            # Building the model from config.json failed (a RoPE type mlx-lm does
            # not implement, say): the weights were not even read.
            raise Unservable(
                f"cannot build the model {path}/config.json describes ({said}): the file "
                "names a setting mlx-lm does not support for its model_type"
            ) from None
        # mlx's check of the weights against the model (shapes, names, the
        # quantization the config names); a list of every parameter is cut short.
        raise Unservable(
            f"the weights in {path} do not fit the model its config.json describes "
            f"({said}): serve the config.json that came with these weights, or download "
            "the model again"
        ) from None


def _raised_in(exc: BaseException, function: str) -> bool:
    """Whether `exc` came through a call of a function of that name."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False
