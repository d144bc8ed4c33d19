"""Whether MLX can run here, found without importing it (the asyncio side never does).

On Linux the `mlx` wheel holds only the Python bindings; its library comes from a
backend distribution (`mlx-cpu`, `mlx-cuda-13`, `mlx-cuda-12`) that installs
`mlx/lib/libmlx.so`. Without one, importing MLX fails deep in model loading with
`ImportError: libmlx.so: cannot open shared object file`.
"""

from __future__ import annotations

import shlex
import sys
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

BACKEND_DISTRIBUTIONS = ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12")
# MLX's own extras, each of which installs one backend distribution.
BACKEND_EXTRAS = {"cpu": "the CPU", "cuda13": "NVIDIA GPUs (CUDA 13)"}


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def install_command(extra: str) -> str:
    """The command that adds MLX's backend `extra` to this environment, pinned to
    the installed MLX so that pip changes nothing else."""
    try:
        pin = f"=={metadata.version('mlx')}"
    except metadata.PackageNotFoundError:
        pin = ""
    return f"{shlex.quote(sys.executable)} -m pip install 'mlx[{extra}]{pin}'"


def missing_backend() -> str | None:
    """What to install when MLX cannot load on this machine; None when it can.
    macOS wheels always carry their Metal library."""
    if sys.platform != "linux" or any(map(_installed, BACKEND_DISTRIBUTIONS)):
        return None
    spec = find_spec("mlx")  # finds the package without running it
    # A source build carries its own library.
    for location in (spec and spec.submodule_search_locations) or ():
        if any((Path(location) / "lib").glob("libmlx.so*")):
            return None
    choices = "; or ".join(f"{install_command(x)} for {what}" for x, what in BACKEND_EXTRAS.items())
    return f"MLX has no backend library (libmlx.so) in this environment: install one with {choices}"
