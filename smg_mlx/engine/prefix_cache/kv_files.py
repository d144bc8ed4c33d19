"""One prefix-cache entry as a file: its tokens and its per-layer caches.

Layout: MAGIC, the header's length (8 bytes), the header (JSON: the
fingerprint of the model that made it, the layers' cache classes and states,
with each array named by its index, and each array's dtype, shape and size),
the tokens (4 bytes each), the arrays' bytes one after another, then a
trailer: the CRC-32 of everything before it and the file's whole length. A
file whose trailer does not match (torn by a crash, truncated, corrupted),
that another model made (copied from its folder), or of an older format
(which named no model) is refused, never loaded as KV.

Three halves run on two threads: `export` and `Rebuild` on the engine thread
(they use MLX), `write`, `read_key`, `read` and `verify` on the disk tier's
own threads (plain bytes and numpy: no MLX object is made or used there;
`write` reads the arrays' memory through buffers the engine thread exported,
and the engine thread keeps the arrays alive until the write is done).
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from smg_mlx.engine.prefix_cache import safe_files

MAGIC = b"SMGKV02\n"  # 01 named no model
_LENGTH = struct.Struct("<Q")
_TRAILER = struct.Struct("<IQ")  # CRC-32, file length
_TOKEN = np.dtype("<u4")
_CHUNK = 4 << 20  # what `verify` reads at a time
# Cache classes are restored from mlx-lm's own modules only.
_CACHE_MODULES = "mlx_lm."
_HEADER_FIELDS = ("layers", "arrays", "tokens", "trimmable")  # Header's, in its order


class BadFile(ValueError):
    """A file that is not a whole, intact entry of this format."""


@dataclass(frozen=True)
class Header:
    layers: list  # per layer: {"class": "module:name", "state": skeleton}
    arrays: list[dict]  # per array: {"dtype", "shape", "nbytes"}
    tokens: int
    trimmable: bool

    @property
    def data_bytes(self) -> int:
        return sum(a["nbytes"] for a in self.arrays)


# ---- the engine thread: arrays out, arrays in ----


def _skeleton(value: Any, arrays: list, held: set[int]) -> Any:
    """`value` (a cache's state) as JSON, each array replaced by its index in
    `arrays`. Arrays in `held` (by id: a cache's own, evaluated when it was
    kept) go as they are where contiguous; others are copied contiguous."""
    if isinstance(value, mx.array):
        own = id(value) in held and memoryview(value).c_contiguous
        arrays.append(value if own else mx.contiguous(value))
        return {"array": len(arrays) - 1}
    if isinstance(value, (list, tuple)):
        return [_skeleton(v, arrays, held) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a prompt cache holding a {type(value).__name__} cannot go to disk")


def _state(layer: Any) -> Any:
    """What `from_state` makes `layer` again from. A QuantizedKVCache's state
    is its whole buffer (KVCache's stops at its offset): only the positions
    it holds are written, as quantized as they are."""
    if isinstance(layer, QuantizedKVCache) and layer.keys is not None:
        return (*layer.keys_and_values(), layer.offset, layer.group_size, layer.bits)
    return layer.state


def export(cache: list, tokens: int, trimmable: bool, settled: bool = False) -> tuple[Header, list]:
    """The header of `cache` (one sequence's layers, holding `tokens` tokens)
    and its arrays, contiguous; copies are evaluated asynchronously, so their
    buffers are ready by the time they are read. `settled`: the cache's own
    arrays were evaluated a while ago (reading one that was not would wait for
    the step running): those already contiguous go uncopied."""
    arrays: list = []
    layers = []
    for layer in cache:
        kind = type(layer)
        own = (getattr(layer, "keys", None), getattr(layer, "values", None)) if settled else ()
        held = {id(a) for a in own if a is not None}
        state = _skeleton(_state(layer), arrays, held)
        layers.append({"class": f"{kind.__module__}:{kind.__qualname__}", "state": state})
    mx.async_eval(arrays)
    described = [
        {"dtype": str(a.dtype).rsplit(".", 1)[-1], "shape": list(a.shape), "nbytes": a.nbytes}
        for a in arrays
    ]
    return Header(layers, described, tokens, trimmable), arrays


def buffers(arrays: list) -> list[memoryview]:
    """Byte views of evaluated, contiguous arrays (no copy), for `write`."""
    return [memoryview(a).cast("B") if a.nbytes else memoryview(b"") for a in arrays]


class Rebuild:
    """A cache made again from a file's arrays, a few arrays at a time
    (each a copy into MLX memory), so a large entry does not stall a step."""

    def __init__(self, header: Header, data: list[np.ndarray]) -> None:
        self.header = header
        self._data = data
        self._made: list = []

    @property
    def done(self) -> bool:
        return len(self._made) == len(self._data)

    def advance(self, seconds: float) -> None:
        """Copy arrays in for about `seconds` (at least one)."""
        end = time.perf_counter() + seconds
        made = []
        while not self.done and (not made or time.perf_counter() < end):
            spec = self.header.arrays[len(self._made)]
            raw = self._data[len(self._made)]
            array = mx.array(raw).view(getattr(mx, spec["dtype"])).reshape(spec["shape"])
            self._data[len(self._made)] = None  # the copy is all that is kept
            self._made.append(array)
            made.append(array)
        mx.eval(made)

    def cache(self) -> list:
        """The layers' caches, once `done`."""
        return [
            _cache_class(layer["class"]).from_state(self._fill(layer["state"]))
            for layer in self.header.layers
        ]

    def _fill(self, skeleton: Any) -> Any:
        if isinstance(skeleton, dict):
            return self._made[skeleton["array"]]
        if isinstance(skeleton, list):
            return [self._fill(v) for v in skeleton]
        return skeleton


def _cache_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_CACHE_MODULES):
        raise BadFile(f"cache class {name!r} is not mlx-lm's")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


# ---- the disk tier's threads: bytes ----


def write(
    path: Path, model: str, header: Header, tokens: Sequence[int], data: list[memoryview]
) -> int:
    """Write the entry that `model` (a fingerprint) made to `path` (whole, or
    not at all: through a temporary file renamed into place); returns the
    file's length."""
    head = json.dumps(
        {
            "model": model,
            "byteorder": sys.byteorder,
            "layers": header.layers,
            "arrays": header.arrays,
            "tokens": header.tokens,
            "trimmable": header.trimmable,
        }
    ).encode()
    parts = [MAGIC, _LENGTH.pack(len(head)), head, np.asarray(tokens, _TOKEN).tobytes(), *data]
    temporary = path.with_suffix(".tmp")
    crc, length = 0, 0
    try:
        with safe_files.create(temporary) as f:
            for part in parts:
                f.write(part)
                crc = zlib.crc32(part, crc)
                length += len(part)
            length += _TRAILER.size
            f.write(_TRAILER.pack(crc, length))
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return length


def _read_into(f: Any, view: memoryview, crc: int) -> int:
    """Fill `view` from `f`; the checksum `crc` carried on over it."""
    if f.readinto(view) != len(view):
        raise BadFile("truncated in its arrays")
    return zlib.crc32(view, crc)


def _read_exactly(f: Any, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise BadFile(f"truncated in its {what}")
    return data


def _header(f: Any, model: str) -> tuple[Header, bytes, bytes]:
    """The header of an entry `model` made, and the raw bytes read for it
    (for the checksum)."""
    magic = f.read(len(MAGIC))
    if not magic:
        raise BadFile("empty")
    if magic != MAGIC:
        raise BadFile("not a prompt-cache file of this version")
    length_bytes = _read_exactly(f, _LENGTH.size, "header")
    (length,) = _LENGTH.unpack(length_bytes)
    if length > 1 << 30:
        raise BadFile("its header is implausibly long")
    raw = _read_exactly(f, length, "header")
    try:
        fields = json.loads(raw)
    except ValueError as exc:
        raise BadFile(f"its header is unreadable ({exc})") from None
    header = _checked(fields, model)
    # The rest is read only when the file is as long as the header says.
    size = os.fstat(f.fileno()).st_size
    if size != _expected_length(header, f.tell()):
        raise BadFile(f"{size} bytes long, not what its header says")
    return header, magic + length_bytes, raw


def _checked(fields: Any, model: str) -> Header:
    """The header `fields` hold, each field as `write` writes it, if `model`
    made the entry: the checksum covers the header only once the whole file
    is read."""
    if not isinstance(fields, dict) or not {"model", "byteorder", *_HEADER_FIELDS} <= fields.keys():
        raise BadFile("its header lacks fields")
    if fields["model"] != model:
        made_by = str(fields["model"])[:24]
        raise BadFile(f"another model or KV format made it (fingerprint {made_by!r})")
    if fields["byteorder"] != sys.byteorder:
        raise BadFile("written on a machine of the other byte order")
    arrays = fields["arrays"]
    if not (
        isinstance(fields["layers"], list)
        and _count(fields["tokens"])
        and isinstance(fields["trimmable"], bool)
        and isinstance(arrays, list)
        and all(
            isinstance(a, dict)
            and isinstance(a.get("dtype"), str)
            and isinstance(a.get("shape"), list)
            and all(_count(n) for n in a["shape"])
            and _count(a.get("nbytes"))
            for a in arrays
        )
    ):
        raise BadFile("its header is malformed")
    return Header(*(fields[name] for name in _HEADER_FIELDS))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tokens(f: Any, header: Header) -> bytes:
    """The raw tokens that follow the header."""
    return _read_exactly(f, header.tokens * _TOKEN.itemsize, "tokens")


def _token_ids(raw: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(raw, _TOKEN).tolist())


def _expected_length(header: Header, header_end: int) -> int:
    return header_end + header.tokens * _TOKEN.itemsize + header.data_bytes + _TRAILER.size


def _open(path: Path) -> BinaryIO:
    """`path` opened for reading, if it is a regular file (anything else in
    the folder, a FIFO or a link, is not an entry: refused at once)."""
    try:
        return safe_files.open_file(path)
    except safe_files.Unsafe as exc:
        raise BadFile(str(exc)) from None


def read_key(path: Path, model: str) -> tuple[Header, tuple[int, ...], int]:
    """The header and tokens of the entry in `path`, and the file's length,
    checked against the header (the data itself is checked by `read`); a
    file `model` did not make is refused."""
    with _open(path) as f:
        header, _, _ = _header(f, model)
        tokens = _tokens(f, header)
        size = os.fstat(f.fileno()).st_size
    return header, _token_ids(tokens), size


def read(path: Path, model: str) -> tuple[Header, tuple[int, ...], list[np.ndarray]]:
    """The whole entry in `path`, its checksum verified; a file `model` did
    not make is refused."""
    return _whole(path, model, keep=True)


def verify(path: Path, model: str) -> None:
    """Check the entry in `path` as `read` does, keeping nothing: a large
    entry is read through a small buffer."""
    _whole(path, model, keep=False)


def _whole(path: Path, model: str, keep: bool) -> tuple[Header, tuple[int, ...], list[np.ndarray]]:
    """The whole entry in `path`, its checksum verified (its arrays only if `keep`)."""
    with _open(path) as f:
        header, first, raw = _header(f, model)
        crc = zlib.crc32(raw, zlib.crc32(first))
        tokens = _tokens(f, header)
        crc = zlib.crc32(tokens, crc)
        data = []
        scratch = memoryview(np.empty(0 if keep else _CHUNK, np.uint8))
        for spec in header.arrays:
            size = spec["nbytes"]
            if keep:
                data.append(np.empty(size, np.uint8))
                crc = _read_into(f, memoryview(data[-1]), crc)
                continue
            for start in range(0, size, len(scratch)):
                crc = _read_into(f, scratch[: min(len(scratch), size - start)], crc)
        trailer = f.read(_TRAILER.size + 1)
        if len(trailer) != _TRAILER.size:
            raise BadFile("truncated or with bytes past its end")
        stored_crc, length = _TRAILER.unpack(trailer)
        if stored_crc != crc or length != f.tell():
            raise BadFile("its checksum does not match: corrupted")
    return header, _token_ids(tokens), data
