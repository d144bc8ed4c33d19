"""How many entries a message's lists hold, read from its bytes without parsing it.

Parsing a request is one call into protobuf's C code, which holds the GIL from
start to end: 50 ms for 7 MiB of one-byte ids on an idle machine, several times
that on a busy one, and every health check waits for it. Counting needs no
parse: a packed list of varints holds one entry per byte below 0x80, which
`bytes.translate` counts at memory speed, and everything else is walked here
in Python, which yields the GIL every few milliseconds. So a request whose
lists are over their limits is refused before it is parsed, and a parse only
ever meets lists within them.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

# Bytes that continue a varint; every other byte ends one.
_CONTINUATION = bytes(range(0x80, 0x100))
# Bytes counted per C call: the GIL is free between calls.
_COUNT_SLICE = 1 << 20
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_FIXED_SIZE = {_I64: 8, _I32: 4}
# The wire type of each field type but the varint ones.
_WIRE_TYPES = {
    FieldDescriptor.TYPE_MESSAGE: _LEN,
    FieldDescriptor.TYPE_STRING: _LEN,
    FieldDescriptor.TYPE_BYTES: _LEN,
    FieldDescriptor.TYPE_FIXED64: _I64,
    FieldDescriptor.TYPE_SFIXED64: _I64,
    FieldDescriptor.TYPE_DOUBLE: _I64,
    FieldDescriptor.TYPE_FIXED32: _I32,
    FieldDescriptor.TYPE_SFIXED32: _I32,
    FieldDescriptor.TYPE_FLOAT: _I32,
}


class Unreadable(ValueError):
    """The bytes are not a message of the expected type."""


class TooManyFields(ValueError):
    """The message has more fields than `most_fields`; `sizes` holds what was
    counted up to there."""

    def __init__(self, most_fields: int, sizes: dict[str, int]) -> None:
        super().__init__(f"more than {most_fields} fields")
        self.most_fields = most_fields
        self.sizes = sizes


def list_sizes(raw: bytes, descriptor: Descriptor, most_fields: int) -> dict[str, int]:
    """Entries of each repeated field (maps included) that `raw` sets, by dotted
    path ("sampling_params.stop_token_ids"), as the parsed message would hold
    them: lists in a repeated submessage add up, and setting one member of a
    oneof drops what another held (a map's entries are counted as sent, a key
    sent twice twice). Walks at most `most_fields` fields, else raises
    TooManyFields."""
    reader = _Reader(raw, most_fields)
    reader.message(0, len(raw), descriptor, "")
    return reader.sizes


class _Reader:
    def __init__(self, raw: bytes, most_fields: int) -> None:
        self.raw = raw
        self.most_fields = most_fields
        self.fields_left = most_fields
        self.sizes: dict[str, int] = {}  # entries by path, so far

    def varint(self, at: int, end: int) -> tuple[int, int]:
        value = shift = 0
        while at < end:
            byte = self.raw[at]
            value |= (byte & 0x7F) << shift
            at += 1
            if byte < 0x80:
                return value, at
            shift += 7
        raise Unreadable("a varint runs past the end of its message")

    def message(self, at: int, end: int, descriptor: Descriptor, prefix: str) -> None:
        while at < end:
            self.fields_left -= 1
            if self.fields_left < 0:
                raise TooManyFields(self.most_fields, self.sizes)
            tag, at = self.varint(at, end)
            number, wire = tag >> 3, tag & 7
            if wire == _VARINT:
                _, value_end = self.varint(at, end)
            elif wire == _LEN:
                length, at = self.varint(at, end)
                value_end = at + length
            elif wire in _FIXED_SIZE:
                value_end = at + _FIXED_SIZE[wire]
            else:
                raise Unreadable(f"wire type {wire} (groups) is not used by this service")
            if value_end > end:
                raise Unreadable("a field runs past the end of its message")
            field = descriptor.fields_by_number.get(number)
            if field is not None:
                self.field(field, wire, at, value_end, prefix)
            at = value_end

    def field(self, field: FieldDescriptor, wire: int, at: int, end: int, prefix: str) -> None:
        expected = _WIRE_TYPES.get(field.type, _VARINT)
        packed = field.is_repeated and wire == _LEN and expected != _LEN
        if wire != expected and not packed:
            return  # the parser keeps it as an unknown field
        path = prefix + field.name
        if field.containing_oneof is not None:
            for other in field.containing_oneof.fields:
                if other is not field:
                    self.drop(prefix + other.name)
        if not field.is_repeated:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                self.message(at, end, field.message_type, path + ".")
            return
        count = self.packed(expected, at, end) if packed else 1
        self.sizes[path] = self.sizes.get(path, 0) + count

    def drop(self, path: str) -> None:
        for key in [k for k in self.sizes if k == path or k.startswith(path + ".")]:
            del self.sizes[key]

    def packed(self, wire: int, at: int, end: int) -> int:
        if wire in _FIXED_SIZE:
            return (end - at) // _FIXED_SIZE[wire]
        return sum(
            len(self.raw[i : min(i + _COUNT_SLICE, end)].translate(None, _CONTINUATION))
            for i in range(at, end, _COUNT_SLICE)
        )
