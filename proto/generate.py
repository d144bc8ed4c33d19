"""Write the Python gRPC stubs for proto/ into smg_mlx/grpc_stubs (`make stubs`).

The stubs are committed, so every way of installing the package (a wheel, an
sdist, `pip install git+...`) carries them without grpcio-tools.
tests/test_stubs.py regenerates them with the pinned grpcio-tools of the test
extra and checks they are what is committed.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("common.proto", "mlx_engine.proto")
PACKAGE_DIR = PROTO_DIR.parent / "smg_mlx" / "grpc_stubs"
INIT = '"""Generated from proto/ by `make stubs` (proto/generate.py); do not edit."""\n'


def generate(out: Path) -> None:
    """Replace `out` with freshly generated stubs (modules, type stubs, __init__)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    status = protoc.main(
        [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *(str(PROTO_DIR / name) for name in PROTOS),
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed with status {status}")
    # protoc writes top-level imports of sibling modules; the package needs relative ones.
    for path in sorted(out.glob("*_pb2*.py*")):
        text = path.read_text()
        path.write_text(re.sub(r"^import (\w+_pb2) ", r"from . import \1 ", text, flags=re.M))
    (out / "__init__.py").write_text(INIT)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_DIR)
