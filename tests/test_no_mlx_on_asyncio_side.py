"""The asyncio side (handlers, translation, health, server) never imports MLX."""

from __future__ import annotations

import subprocess
import sys
import textwrap

ASYNCIO_SIDE = [
    "smg_mlx.cli",
    "smg_mlx.config",
    "smg_mlx.engine",
    "smg_mlx.metrics",
    "smg_mlx.model_info",
    "smg_mlx.request_log",
    "smg_mlx.request_translation",
    "smg_mlx.responses",
    "smg_mlx.rpc_handlers",
    "smg_mlx.server",
    "smg_mlx.servicer",
    "smg_mlx.tokenizer_files",
]


def test_asyncio_side_modules_do_not_import_mlx(model_dir):
    # A fresh interpreter: import every asyncio-side module and do what the
    # event loop does at start-up (tokenizer, model info), then look.
    script = textwrap.dedent(
        f"""
        import importlib, sys
        from pathlib import Path
        for name in {ASYNCIO_SIDE!r}:
            importlib.import_module(name)
        from smg_mlx.server import load_tokenizer
        from smg_mlx.model_info import load_model_info
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
