"""api.wire counts a request's lists from its bytes exactly as the parsed
message holds them, however a client encodes it, so that a request refused
unparsed is one the parse would have refused too."""

from __future__ import annotations

import random
import struct

import pytest
from google.protobuf.message import DecodeError

from smg_mlx.api.wire import TooManyFields, Unreadable, list_sizes
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

VARINT, I64, LEN, I32 = 0, 1, 2, 5


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, wire: int, value: int | bytes) -> bytes:
    tag = varint(number << 3 | wire)
    if wire == VARINT:
        return tag + varint(value)
    if wire == LEN:
        return tag + varint(len(value)) + value
    return tag + (b"\0" * (8 if wire == I64 else 4))


def ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(2 ** rng.randrange(1, 33)) for _ in range(count)]


def id_list(rng: random.Random, number: int) -> bytes:
    """A repeated uint32 field: packed, one field per id, or a wrong wire type."""
    values = ids(rng, rng.randrange(40))
    style = rng.choice(["packed", "unpacked", "wrong"])
    if style == "packed":
        return field(number, LEN, b"".join(map(varint, values)))
    if style == "unpacked":
        return b"".join(field(number, VARINT, v) for v in values)
    return field(number, rng.choice([I64, I32]), 0)


def tokenized(rng: random.Random) -> bytes:
    parts = [id_list(rng, 2) for _ in range(rng.randrange(3))]
    if rng.random() < 0.3:
        parts.append(field(1, LEN, b"original"))
    return b"".join(parts)


def sampling(rng: random.Random, keys: list[int]) -> bytes:
    parts = []
    for _ in range(rng.randrange(4)):
        kind = rng.randrange(4)
        if kind == 0:
            parts.append(id_list(rng, 10))
        elif kind == 1:  # logit_bias entries, each key once (a map keeps one per key)
            for _ in range(rng.randrange(5)):
                keys.append(len(keys))
                entry = field(1, VARINT, keys[-1]) + b"\x15" + struct.pack("<f", 1.0)
                parts.append(field(8, LEN, entry))
        elif kind == 2:
            parts.append(field(8, VARINT, 3))  # wrong wire type: skipped
        else:
            parts.append(field(9, VARINT, rng.randrange(100)))
    return b"".join(parts)


def request_bytes(rng: random.Random) -> bytes:
    keys: list[int] = []
    parts = []
    for _ in range(rng.randrange(1, 6)):
        kind = rng.randrange(7)
        if kind == 0:
            parts.append(field(2, LEN, tokenized(rng)))
        elif kind == 1:
            parts.append(field(3, LEN, b"some text"))
        elif kind == 2:  # a oneof member of the wrong wire type leaves the other set
            parts.append(field(rng.choice([2, 3]), VARINT, 1))
        elif kind == 3:
            parts.append(field(4, LEN, sampling(rng, keys)))
        elif kind == 4:
            parts.append(field(5, VARINT, 1))
        elif kind == 5:
            parts.append(field(1, LEN, b"id"))
        else:
            wire = rng.choice([VARINT, LEN, I32, I64])
            parts.append(field(99, wire, b"unknown" if wire == LEN else 5))
    return b"".join(parts)


def parsed_sizes(message: pb.GenerateRequest) -> dict[str, int]:
    params = message.sampling_params
    sizes = {
        "tokenized.input_ids": len(message.tokenized.input_ids)
        if message.WhichOneof("input") == "tokenized"
        else 0,
        "sampling_params.stop_token_ids": len(params.stop_token_ids),
        "sampling_params.logit_bias": len(params.logit_bias),
    }
    return {k: v for k, v in sizes.items() if v}


def test_counts_match_the_parsed_message_however_it_is_encoded():
    rng = random.Random(0)
    checked = 0
    for _ in range(2000):
        raw = request_bytes(rng)
        try:
            message = pb.GenerateRequest.FromString(raw)
        except DecodeError:
            continue
        counted = list_sizes(raw, pb.GenerateRequest.DESCRIPTOR, 10**6)
        assert {k: v for k, v in counted.items() if v} == parsed_sizes(message), raw
        checked += 1
    assert checked > 1500


def test_a_huge_packed_list_is_counted_without_parsing():
    message = pb.GenerateRequest()
    message.sampling_params.stop_token_ids.extend([7] * 3_000_000 + [300_000] * 1000)
    sizes = list_sizes(message.SerializeToString(), pb.GenerateRequest.DESCRIPTOR, 100)
    assert sizes == {"sampling_params.stop_token_ids": 3_001_000}


@pytest.mark.parametrize(
    "raw,needle",
    [
        (field(2, LEN, b"") + b"\x12\x80", "runs past the end"),  # length's varint cut off
        (field(4, LEN, b"\x52\x05\x01"), "runs past the end"),  # a list longer than its message
        (b"\x0b" + field(1, LEN, b"x"), "groups"),
    ],
)
def test_bytes_that_are_no_request_are_unreadable(raw, needle):
    with pytest.raises(Unreadable, match=needle):
        list_sizes(raw, pb.GenerateRequest.DESCRIPTOR, 40)


def test_the_walk_stops_at_its_field_budget_with_what_it_counted():
    unpacked = field(4, LEN, b"".join(field(10, VARINT, 1) for _ in range(50)))
    with pytest.raises(TooManyFields) as err:
        list_sizes(field(5, VARINT, 1) + unpacked, pb.GenerateRequest.DESCRIPTOR, 40)
    # The stream flag, the sampling_params field, then 38 of its stop ids.
    assert err.value.sizes == {"sampling_params.stop_token_ids": 38}
