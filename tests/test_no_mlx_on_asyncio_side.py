"""The asyncio side (handlers, translation, health, server) never imports MLX."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap

import smg_mlx

# Modules that only the engine thread (or a child process) runs; every other
# module of the package, present or future, is asyncio side.
MLX_SIDE = {
    "smg_mlx.engine.batch.batch",
    "smg_mlx.engine.batch.lanes",
    "smg_mlx.engine.batch.layer_waits",
    "smg_mlx.engine.batch.prefix_calls",
    "smg_mlx.engine.batch.ended_rows",
    "smg_mlx.engine.batch.joining",
    "smg_mlx.engine.batch.rows",
    "smg_mlx.engine.batch.batch_kv",
    "smg_mlx.engine.batch.kv_format",
    "smg_mlx.engine.batch.quantized_kv",
    "smg_mlx.engine.batch.quantized_attention",
    "smg_mlx.engine.batch.fused_quantized_attention",
    "smg_mlx.engine.batch.few_rows_matmul",
    "smg_mlx.engine.batch.attention_shapes",
    "smg_mlx.engine.memory.buffer_cache",
    "smg_mlx.engine.memory.probe",
    "smg_mlx.engine.memory.probe_results",
    "smg_mlx.engine.remembered",
    "smg_mlx.engine.batch.verdicts",
    "smg_mlx.engine.ranks.lockstep",
    "smg_mlx.engine.ranks.placement",
    "smg_mlx.engine.prefix_cache.cache",
    "smg_mlx.engine.prefix_cache.memory_tier",
    "smg_mlx.engine.prefix_cache.disk_tier",
    "smg_mlx.engine.prefix_cache.disk_reads",
    "smg_mlx.engine.prefix_cache.disk_folder",
    "smg_mlx.engine.prefix_cache.folder_contents",
    "smg_mlx.engine.batch.batch_check",
    "smg_mlx.engine.batch.batch_mode",
    "smg_mlx.engine.batch.loading",
    "smg_mlx.engine.prefix_cache.kv_files",
    "smg_mlx.engine.batch.sampling",
    "smg_mlx.engine.batch.row_places",
    "smg_mlx.engine.speculative.decoding",
    "smg_mlx.engine.speculative.ragged_kv",
    "smg_mlx.engine.speculative.choice",
    "smg_mlx.engine.speculative.draft_model",
    "smg_mlx.demo_model",
    "smg_mlx.__main__",
}
ASYNCIO_SIDE = sorted(
    m.name
    for m in pkgutil.walk_packages(smg_mlx.__path__, "smg_mlx.")
    if m.name not in MLX_SIDE and not m.name.startswith("smg_mlx.grpc_stubs.")
)


def test_the_asyncio_side_is_most_of_the_package():
    assert {"smg_mlx.server", "smg_mlx.api.servicer", "smg_mlx.engine.core"} <= set(ASYNCIO_SIDE)


def test_asyncio_side_modules_do_not_import_mlx(model_dir):
    # A fresh interpreter: import every asyncio-side module and do what the
    # event loop does at start-up (model files, tokenizer, model info), then look.
    script = textwrap.dedent(
        f"""
        import importlib, sys
        from pathlib import Path
        for name in {ASYNCIO_SIDE!r}:
            importlib.import_module(name)
        from smg_mlx import model_files
        from smg_mlx.server import load_tokenizer
        model_files.check(Path({str(model_dir)!r}))
        from smg_mlx.api.model_info import load_model_info
        tok = load_tokenizer(Path({str(model_dir)!r}))
        load_model_info(Path({str(model_dir)!r}), tok, None)
        tok.encode("hello")
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm"))
        print(",".join(bad))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"asyncio-side code imported MLX modules: {out}"
