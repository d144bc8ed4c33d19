"""Files in the prompt cache's folders, opened without trusting what is there.

Anyone who can write the cache directory can put a symbolic link, a FIFO or
a device where the worker expects one of its files. Following a link would
make the worker (often root) read or overwrite a file of their choosing;
opening a FIFO waits for a writer forever. So every file there is opened
without following a link (O_NOFOLLOW) and without waiting (O_NONBLOCK), and
used only if it is a regular file; one opened for writing must also have no
other name (a hard link would carry the write elsewhere).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

_WRITING = os.O_WRONLY | os.O_RDWR
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)


class NotRegular(Exception):
    """Something other than a regular file of its own where one was expected."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file: left unopened")


def open_fd(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of the regular file `path` (created if `flags` say so);
    raises NotRegular for anything else, at once."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError:
        _refuse(path, os.lstat(path).st_mode)  # a link (ELOOP) or a FIFO without a reader (ENXIO)
        raise
    try:
        found = os.fstat(fd)
        _refuse(path, found.st_mode)
        if flags & _WRITING and found.st_nlink > 1:
            raise NotRegular(path, "a file with other hard links")
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)  # only a FIFO's open waits; the file's reads and writes as usual
    return fd


def open_file(path: Path) -> BinaryIO:
    """The regular file `path`, opened for reading (see `open_fd`)."""
    return os.fdopen(open_fd(path), "rb")


def _refuse(path: Path, mode: int) -> None:
    for test, kind in _KINDS:
        if test(mode):
            raise NotRegular(path, kind)
