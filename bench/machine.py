"""What the numbers were measured on, for the report and the file name."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from importlib import metadata

from bench import cores


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def version(package: str) -> str | None:
    """The installed version of `package`, None if it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe() -> dict:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "gpus": _gpus(),
        "placement": (placed := cores.placed()) and placed.to_dict(),
        "versions": {p: version(p) for p in ("mlx", "mlx-lm", "grpcio", "protobuf")},
    }


def slug(info: dict) -> str:
    """A file-name-safe machine name: 'h100' for a GPU box, else the host name."""
    if info["gpus"]:  # "NVIDIA H100 80GB HBM3, 81559 MiB" -> "gpu-h100"
        words = info["gpus"][0].split(",")[0].split()
        name = "gpu-" + (words[1] if len(words) > 1 and words[0] == "NVIDIA" else words[0])
    else:
        name = info["hostname"] or "cpu"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-").lower() or "machine"
