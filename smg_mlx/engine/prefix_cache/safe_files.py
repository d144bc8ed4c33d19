"""Files in the prompt cache's folders, opened without trusting what is there.

Anyone who can write the cache directory can put a symbolic link, a FIFO or
a device where the worker expects one of its files. Following a link would
make the worker (often root) read or overwrite a file of their choosing;
opening a FIFO waits for a writer forever. So every file there is opened
without following a link (O_NOFOLLOW) and without waiting (O_NONBLOCK), and
used only if it is a regular file; one opened for writing must also have no
other name (a hard link would carry the write elsewhere). Files the worker
writes whole are made new (`create`): what was in their place is removed,
never written through.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_WRITING = os.O_WRONLY | os.O_RDWR
_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


class Unsafe(OSError):
    """Something other than what the worker makes where it expected one of its own."""

    def __init__(self, path: Path, found: str, expected: str = "a regular file") -> None:
        super().__init__(f"{path} is {found}, not {expected}: not used")


def open_fd(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of the regular file `path` (created if `flags` say so);
    raises Unsafe for anything else, at once."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as failed:
        try:
            there = os.lstat(path).st_mode
        except OSError:  # nothing there (a create refused): the open's own reason
            raise failed from None
        _expect(path, there)  # a link (ELOOP), a FIFO without a reader (ENXIO)
        raise
    try:
        found = os.fstat(fd)
        _expect(path, found.st_mode)
        if flags & _WRITING and found.st_nlink > 1:
            raise Unsafe(path, "a file with other hard links")
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)  # only a FIFO's open waits; reads and writes go on as usual
    return fd


def open_file(path: Path) -> BinaryIO:
    """The regular file `path`, opened for reading (see `open_fd`)."""
    return os.fdopen(open_fd(path), "rb")


def create(path: Path) -> BinaryIO:
    """A new, empty regular file at `path`, opened for writing: whatever was
    there (a leftover, a link) is removed first, never written through."""
    path.unlink(missing_ok=True)
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")


def write_whole(path: Path, data: bytes) -> None:
    """`path` holding `data`, or as it was: written to a new file beside it,
    then renamed over it (which replaces a link there, never its target)."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with create(temporary) as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def make_folder(path: Path) -> tuple[int, int]:
    """The folder `path`, made (with its parents) if need be: its device and
    inode, which tell it from anything put in its place later. Raises Unsafe
    if something else is there (a link to a folder elsewhere would carry
    every file the worker writes there)."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        pass
    found = os.lstat(path)
    _expect(path, found.st_mode, stat.S_ISDIR, "a folder")
    return found.st_dev, found.st_ino


def same_folder(path: Path, identity: tuple[int, int] | None) -> bool:
    """Whether `path` is still the folder `make_folder` made (`identity`):
    not deleted, nor anything put in its place (a link to a folder elsewhere,
    which every later open through `path` would follow)."""
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and (found.st_dev, found.st_ino) == identity


def _expect(
    path: Path,
    mode: int,
    test: Callable[[int], bool] = stat.S_ISREG,
    expected: str = "a regular file",
) -> None:
    if not test(mode):
        found = next((kind for is_kind, kind in _KINDS if is_kind(mode)), "something else")
        raise Unsafe(path, found, expected)
