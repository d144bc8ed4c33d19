"""The tokenizer bundle GetTokenizer streams: a zip of the model's tokenizer files."""

from __future__ import annotations

import hashlib
import io
import logging
import zipfile
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import NamedTuple

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
# Files that hold a tokenizer's vocabulary (a tokenizer_config.json alone has none):
# the tokenizers library's file, sentencepiece and tiktoken models, BPE and WordPiece lists.
VOCABULARY_PATTERNS = ("tokenizer.json", "*.model", "*.tiktoken", "vocab.json", "vocab.txt")


class Bundle(NamedTuple):
    """What GetTokenizer serves: the zip of the files it may serve and its
    sha256 hex, or why it refuses (none of them holds a vocabulary)."""

    data: bytes
    sha256: str
    refused: str = ""


def _why_not(path: Path, model_root: Path) -> str | None:
    """Why a listed file is not served (None: it is). Symlinks are followed
    only to a regular file that is itself a listed file of the model directory,
    or a blob of the Hugging Face cache a snapshot directory (snapshots/<rev>/)
    links into, so a link named vocab.json never hands out the weights or
    /etc/passwd."""
    real = path.resolve()
    if not real.is_file():
        return "its link leads to no file" if path.is_symlink() else "it is not a regular file"
    if real.parent == model_root:
        if real.name in TOKENIZER_FILES:
            return None
        return f"it links to {real.name}, which is not a tokenizer file"
    if model_root.parent.name == "snapshots" and real.parent == model_root.parent.parent / "blobs":
        return None
    return (
        f"it links to {real}, outside the model directory (links are followed only within "
        "it: copy the file in)"
    )


def tokenizer_zip(model_dir: Path) -> Bundle:
    """The listed files that are servable, zipped (each left out is logged)."""
    model_root = model_dir.resolve()
    buffer = io.BytesIO()
    left_out: dict[str, str] = {}
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in TOKENIZER_FILES:
            path = model_dir / name
            if not (path.exists() or path.is_symlink()):
                continue
            why = _why_not(path, model_root)
            if why is None:
                archive.writestr(name, path.read_bytes())
            else:
                left_out[name] = why
                log.warning("not serving %s: %s", path, why)
        served = set(archive.namelist())
    data = buffer.getvalue()
    if not any(fnmatch(name, pattern) for name in served for pattern in VOCABULARY_PATTERNS):
        # The worker's own tokenizer read them; a router given the rest could not.
        reasons = "; ".join(f"{name}: {why}" for name, why in left_out.items()) or "none found"
        refused = (
            f"{model_dir} has no tokenizer vocabulary GetTokenizer may serve ({reasons}): "
            "copy the tokenizer files into the model directory"
        )
        log.warning("GetTokenizer will refuse: %s", refused)
        return Bundle(b"", "", refused)
    return Bundle(data, hashlib.sha256(data).hexdigest())


def chunks(data: bytes, sha256: str) -> Iterator[tuple[bytes, str]]:
    """(slice, sha256-or-empty) pairs; the digest rides on the last one only."""
    for start in range(0, len(data), CHUNK_BYTES):
        end = start + CHUNK_BYTES
        yield data[start:end], sha256 if end >= len(data) else ""
