#!/bin/sh
# Installs smg-mlx from this checkout into a new virtual environment PREFIX, with MLX's
# backend EXTRA: cpu or cuda13 on Linux, none on macOS (its wheels carry Metal).
# The systemd steps in deploy/README.md and the Dockerfile install with this; so does
# tests/test_package.py. PYTHON names the interpreter (default python3, 3.10 or later).
set -eu
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 PREFIX [cpu|cuda13]" >&2
    exit 2
fi
prefix=$1
source=$(cd "$(dirname "$0")/.." && pwd)
"${PYTHON:-python3}" -m venv "$prefix"
"$prefix/bin/python" -m pip install --quiet --no-cache-dir "$source${2:+[$2]}"
"$prefix/bin/smg-mlx" --version
