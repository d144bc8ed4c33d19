"""The committed gRPC stubs are what proto/ generates, and the runtime versions
the package admits are ones those stubs accept."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
STUBS = REPO / "smg_mlx" / "grpc_stubs"


def files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir() if p.is_file()}


def test_committed_stubs_match_proto(tmp_path):
    out = tmp_path / "grpc_stubs"
    subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), str(out)], check=True)
    generated, committed = files(out), files(STUBS)
    assert sorted(committed) == sorted(generated)
    stale = sorted(name for name in generated if generated[name] != committed[name])
    assert not stale, f"{stale} differ from proto/: run `make stubs` and commit the result"


def stub_requirements() -> dict[str, Version]:
    """The lowest grpcio and protobuf versions that the generated code accepts at import."""
    grpc_code = (STUBS / "mlx_engine_pb2_grpc.py").read_text()
    pb_code = (STUBS / "mlx_engine_pb2.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_code)[1]
    pb_version = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
        r"(\d+),\s*(\d+),\s*(\d+),",
        pb_code,
    )
    return {"grpcio": Version(grpc_version), "protobuf": Version(".".join(pb_version.groups()))}


def test_dependency_bounds_admit_only_runtimes_the_stubs_accept():
    # An older runtime makes `import smg_mlx.grpc_stubs...` raise at start-up.
    declared = {
        req.name: req.specifier
        for req in map(Requirement, requires("smg-mlx") or [])
        if req.marker is None
    }
    for name, needed in stub_requirements().items():
        specifier = declared[name]
        lowest = [Version(s.version) for s in specifier if s.operator in (">=", "==", "~=")]
        assert lowest and min(lowest) >= needed, f"{name}{specifier} admits versions below {needed}"
        assert needed in specifier


def test_grpcio_tools_is_not_a_runtime_dependency():
    runtime = {Requirement(r).name for r in requires("smg-mlx") or [] if "extra ==" not in r}
    assert "grpcio-tools" not in runtime
