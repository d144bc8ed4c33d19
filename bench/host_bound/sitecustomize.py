"""Loaded by every Python process the bench starts under --host-bound-ms (the
bench puts this folder first on PYTHONPATH): each decoding step of mlx-lm's
`GenerationBatch` first spends that many milliseconds in pure Python, holding
the GIL, as a small model's steps do on a GPU, where the host bounds them. A
CPU run then shows what the GIL costs our worker beside the raw engine, which
a CPU's own steps (their time spent in MLX, the GIL released) hide. mlx-lm is
patched as it is imported: a process that never imports it is left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from typing import Any

SECONDS = float(os.environ.get("BENCH_HOST_BOUND_MS") or 0) / 1000
MODULE = "mlx_lm.generate"


def _held(step: Any) -> Any:
    def step_held(self: Any) -> Any:
        end = time.perf_counter() + SECONDS
        while time.perf_counter() < end:
            pass
        return step(self)

    return step_held


class _Patcher(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds MODULE as Python would, and patches it once it has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.GenerationBatch._step = _held(module.GenerationBatch._step)


if SECONDS > 0:
    sys.meta_path.insert(0, _Patcher())
