"""What a model's folder of the disk tier holds: its entries' files, named by
their tokens (`file_name`), indexed and checked when the folder opens
(`index`); and how a model's folder is told from anything else in the
directory (`cache_files`), before another model's is deleted for room.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from smg_mlx.engine.prefix_cache import kv_files, safe_files

log = logging.getLogger(__name__)

SUFFIX = ".kv"
# What a model's folder holds, and nothing else: a folder holding anything
# more is not deleted for room, whatever its name.
FOLDER_FILES = {"model.json", "lock"}
FOLDER_SUFFIXES = {SUFFIX, ".tmp"}
FOLDER_NAME = re.compile(r"[0-9a-f]{24}")


def file_name(tokens: Sequence[int]) -> str:
    """The file of the entry holding exactly `tokens`."""
    key = np.asarray(tokens, np.uint32).tobytes()
    return hashlib.blake2b(key, digest_size=16).hexdigest() + SUFFIX


def index(
    path: Path, model: str, entries: list[tuple[str, kv_files.Header, tuple[int, ...], int]],
    bad: list[tuple[str, str]],
) -> None:  # fmt: skip
    """Read the key of every entry in `path`, least recently used first, into
    `entries` (name, header, tokens, size), and why each bad file went into
    `bad`. A file whose tokens extend another's is read whole and checked
    first: indexing it deletes the other (it serves all the other served),
    and a bad file must never cost a good one."""
    files = _entry_files(path)
    if len(files) > 1000:
        log.info("prompt cache: indexing %d files in %s", len(files), path)
    for file in files:
        try:
            entries.append((file.name, *_key(file, model)))
        except Exception as exc:  # noqa: BLE001 - whatever is wrong, only this file's
            _discard(file, exc, bad)
    extending = _extending(entries)
    for entry in [f for f in entries if f[0] in extending]:
        try:
            kv_files.verify(path / entry[0], model)
        except Exception as exc:  # noqa: BLE001 - likewise
            _discard(path / entry[0], exc, bad)
            entries.remove(entry)


def sizes(path: Path, model: str) -> list[int]:
    """The lengths of the entries in `path` that `model` made, as `index`
    would find them, deleting nothing: a file copied in from elsewhere (or
    cut short) is not one of them."""
    found = []
    for file in _entry_files(path):
        try:
            found.append(_key(file, model)[-1])
        except Exception:  # noqa: BLE001 - as `index`: whatever is wrong, only this file's
            continue
    return found


def _entry_files(path: Path) -> list[Path]:
    """The entries' files in `path`, least recently used first (by their own
    times: a link is not followed)."""
    found = []
    with os.scandir(path) as listing:
        for file in listing:
            if file.name.endswith(SUFFIX):
                try:
                    found.append((file.stat(follow_symlinks=False).st_mtime, file.name))
                except OSError:
                    continue  # gone meanwhile
    return [path / name for _, name in sorted(found)]


def _key(file: Path, model: str) -> tuple[kv_files.Header, tuple[int, ...], int]:
    """`kv_files.read_key`, and the file's name checked against its tokens."""
    header, tokens, size = kv_files.read_key(file, model)
    if file.name != file_name(tokens):
        raise kv_files.BadFile("its tokens are not those of its name")
    return header, tokens, size


def _extending(files: Sequence[tuple[str, kv_files.Header, tuple[int, ...], int]]) -> set[str]:
    """The names of the trimmable entries among `files` whose tokens extend
    another entry's (sorted, an entry's extensions follow it)."""
    keys = sorted((tokens, name, header.trimmable) for name, header, tokens, _ in files)
    found = set()
    for i, (shorter, _, _) in enumerate(keys):
        for tokens, name, trimmable in keys[i + 1 :]:
            if tokens[: len(shorter)] != shorter:
                break
            if trimmable:
                found.add(name)
    return found


def _discard(file: Path, why: Exception, bad: list[tuple[str, str]]) -> None:
    """Delete the bad entry `file`; `bad` says why (and why it stays, if it does)."""
    said = str(why) or repr(why)
    try:
        file.unlink(missing_ok=True)
    except OSError as exc:  # a directory: not ours to delete
        said += f" (it stays: {exc.strerror})"
    bad.append((file.name, said))


def about(folder: Path) -> dict | None:
    """`folder`'s model.json if it is a model's folder of a prompt cache, as
    `_open` makes them, else None."""
    if not FOLDER_NAME.fullmatch(folder.name) or not folder.is_dir():
        return None
    try:
        with safe_files.open_file(folder / "model.json") as f:
            said = json.loads(f.read())
        fingerprint = said.get("fingerprint")
    except (OSError, ValueError, AttributeError):  # safe_files.Unsafe is an OSError
        return None
    if not isinstance(fingerprint, str) or not fingerprint.startswith(folder.name):
        return None
    return said


def cache_files(folder: Path) -> list[os.DirEntry] | None:
    """The files of `folder` if it is a model's folder of a prompt cache, as
    `_open` makes them, else None."""
    if about(folder) is None:
        return None
    with os.scandir(folder) as listing:
        files = list(listing)
    ours = all(
        f.is_file(follow_symlinks=False)
        and (f.name in FOLDER_FILES or os.path.splitext(f.name)[1] in FOLDER_SUFFIXES)
        for f in files
    )
    return files if ours else None
