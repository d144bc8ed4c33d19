#!/bin/sh
# Installs smg-mlx from this checkout into a new virtual environment PREFIX, with MLX's
# backend EXTRA: cpu or cuda13 on Linux (none: no backend, for one added later), none on
# macOS (its wheels carry Metal).
# The systemd steps in deploy/README.md and the Dockerfile install with this; so does
# tests/test_package.py. PYTHON names the interpreter (default python3, 3.10 or later).
set -eu
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 PREFIX [cpu|cuda13|none]" >&2
    exit 2
fi
prefix=$1
extra=${2:-}
# Linux wheels of MLX hold no library: without a backend the worker cannot start.
if [ -z "$extra" ] && [ "$(uname -s)" = Linux ]; then
    echo "$0: on Linux, name MLX's backend: cpu (the CPU) or cuda13 (NVIDIA GPUs, CUDA 13)," \
        "as in: $0 $prefix cpu (none installs without one)" >&2
    exit 2
fi
case $extra in
    ''|cpu|cuda13) ;;
    none) extra= ;;
    *) echo "$0: no backend '$extra': name cpu, cuda13 or none" >&2; exit 2 ;;
esac
source=$(cd "$(dirname "$0")/.." && pwd)
"${PYTHON:-python3}" -m venv "$prefix"
"$prefix/bin/python" -m pip install --quiet --no-cache-dir "$source${extra:+[$extra]}"
"$prefix/bin/smg-mlx" --version
