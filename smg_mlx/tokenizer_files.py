"""The tokenizer bundle GetTokenizer streams: a zip of the model's tokenizer files."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 64 * 1024
# What the router's tokenizer loader reads, plus the configs that name special tokens.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def tokenizer_zip(model_dir: Path) -> tuple[bytes, str]:
    """The zip archive and its sha256 hex. Only regular files with listed names go in."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            path = model_dir / name
            if path.is_file():
                archive.writestr(name, path.read_bytes())
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[tuple[bytes, str]]:
    """(slice, sha256-or-empty) pairs; the digest rides on the last one only."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = start + CHUNK_BYTES
        yield data[start:end], sha256 if end >= len(data) else ""
