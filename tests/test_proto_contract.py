"""Our proto/ is wire-identical to the router's published definitions (smg-grpc-proto)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent
published = pytest.importorskip("smg_grpc_proto", reason="the test extra installs smg-grpc-proto")
PUBLISHED_DIR = Path(published.__file__).parent / "proto"


def descriptor_set(include: Path, tmp: Path) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    out = tmp / f"{include.parent.name}.pb"
    status = protoc.main(
        [
            "protoc",
            f"-I{include}",
            f"--descriptor_set_out={out}",
            "--include_imports",
            str(include / "mlx_engine.proto"),
        ]
    )
    assert status == 0, f"protoc failed on {include}"
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    return {f.name: f for f in files}


def messages(file: descriptor_pb2.FileDescriptorProto) -> dict[str, descriptor_pb2.DescriptorProto]:
    """Every message by full name, nested ones (map entries included) too."""
    found = {}

    def walk(prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{message.name}"
        found[name] = message
        for nested in message.nested_type:
            walk(name, nested)

    for message in file.message_type:
        walk(file.package, message)
    return found


def wire_shape(message: descriptor_pb2.DescriptorProto) -> dict[int, tuple]:
    """What the wire depends on, by field number."""
    oneofs = [o.name for o in message.oneof_decl]
    return {
        f.number: (
            f.name,
            f.type,
            f.label,
            f.type_name,
            f.proto3_optional,
            oneofs[f.oneof_index] if f.HasField("oneof_index") else None,
        )
        for f in message.field
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("descriptors")
    return descriptor_set(REPO / "proto", tmp), descriptor_set(PUBLISHED_DIR, tmp)


def test_packages_and_service_match(files):
    ours, theirs = files
    assert (
        ours["mlx_engine.proto"].package
        == theirs["mlx_engine.proto"].package
        == ("mlx.grpc.engine")
    )
    assert ours["common.proto"].package == "smg.grpc.common"

    def methods(file):
        (service,) = file.service
        return service.name, {
            m.name: (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for m in service.method
        }

    assert methods(ours["mlx_engine.proto"]) == methods(theirs["mlx_engine.proto"])


def test_every_message_matches_field_by_field(files):
    ours, theirs = files
    our_messages = {k: v for f in ours.values() for k, v in messages(f).items()}
    their_messages = {k: v for f in theirs.values() for k, v in messages(f).items()}
    # All of the engine service's messages, and each one we declare, exist in both.
    needed = set(messages(theirs["mlx_engine.proto"])) | set(our_messages)
    assert needed <= set(their_messages), needed - set(their_messages)
    assert needed <= set(our_messages), needed - set(our_messages)
    for name in sorted(needed):
        ours_m, theirs_m = our_messages[name], their_messages[name]
        assert wire_shape(ours_m) == wire_shape(theirs_m), name
        assert ours_m.options.map_entry == theirs_m.options.map_entry, name
        assert [o.name for o in ours_m.oneof_decl] == [o.name for o in theirs_m.oneof_decl], name
