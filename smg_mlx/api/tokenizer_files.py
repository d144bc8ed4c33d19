"""The tokenizer bundle GetTokenizer streams: a zip of the model's tokenizer files."""

from __future__ import annotations

import hashlib
import io
import logging
import zipfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

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


def _servable(path: Path, model_root: Path) -> bool:
    """Whether a listed file may be served. Symlinks are followed only to a
    regular file that is itself a listed file of the model directory, or a blob
    of the Hugging Face cache a snapshot directory (snapshots/<rev>/) links into,
    so a link named vocab.json never hands out the weights or /etc/passwd."""
    real = path.resolve()
    if not real.is_file():
        return False
    if real.parent == model_root:
        return real.name in TOKENIZER_FILES
    return model_root.parent.name == "snapshots" and real.parent == (
        model_root.parent.parent / "blobs"
    )


def tokenizer_zip(model_dir: Path) -> tuple[bytes, str]:
    """The zip archive and its sha256 hex: the listed files that are servable."""
    model_root = model_dir.resolve()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            path = model_dir / name
            if _servable(path, model_root):
                archive.writestr(name, path.read_bytes())
            elif path.exists() or path.is_symlink():
                log.warning("not serving %s: it is not a tokenizer file of the model", path)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[tuple[bytes, str]]:
    """(slice, sha256-or-empty) pairs; the digest rides on the last one only."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = start + CHUNK_BYTES
        yield data[start:end], sha256 if end >= len(data) else ""
