"""A model's fingerprint: which prefix-cache files on disk belong to it.

KV caches are only valid for the exact model that computed them, so the
fingerprint covers the model directory's files (config, tokenizer, weights,
and an adapter's), the versions of mlx and mlx-lm (their kernels round
differently) and the device kind. Small files are hashed whole; large ones
(weights) by their size, their first MiB (a safetensors header names every
tensor), samples spread over the rest, and the times they were last written
and last changed: an 8B model is fingerprinted in milliseconds rather than
the seconds a full hash takes. Fully fine-tuned weights differ in almost
every byte, but a few tensors changed (an adapter fused in) may miss every
sample, while writing them changes the file's times (a written time put back,
as `cp -p` does, changes the other). Hidden files (a Finder's .DS_Store) and
Markdown (a model card) cannot change the model and are left out, so adding
them keeps the cache warm. No MLX here: it runs on the disk tier's thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

WHOLE_BELOW = 64 << 20  # files smaller than this are hashed whole
HEAD_BYTES = 1 << 20
SAMPLES = 64
SAMPLE_BYTES = 64 << 10


def _file(digest: hashlib._Hash, path: Path) -> None:
    stat = path.stat()
    size = stat.st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if size < WHOLE_BELOW:
            digest.update(f.read())
            return
        digest.update(f"{stat.st_mtime_ns}\0{stat.st_ctime_ns}\0".encode())
        digest.update(f.read(HEAD_BYTES))
        for i in range(1, SAMPLES + 1):
            f.seek((size - SAMPLE_BYTES) * i // SAMPLES)
            digest.update(f.read(SAMPLE_BYTES))


def fingerprint(directories: Iterable[Path], versions: Iterable[str]) -> str:
    """The fingerprint of the model in `directories` (the model's, then an
    adapter's), computed with `versions` (format, libraries, device)."""
    digest = hashlib.sha256()
    for version in versions:
        digest.update(f"{version}\0".encode())
    for directory in directories:
        for path in sorted(Path(directory).iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.suffix != ".md":
                _file(digest, path)
    return digest.hexdigest()
