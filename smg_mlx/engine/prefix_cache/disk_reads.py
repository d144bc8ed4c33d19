"""The disk tier's reads (`engine.prefix_cache.disk_tier`): which file to read
back for a prompt, and the copy of what the reader thread read into MLX, a
few arrays a turn, on the engine thread.

A read is started where reading the file and copying it into MLX beats
prefilling the tokens it holds beyond what memory holds; the disk's rate and
the copy's are learnt from the reads that ran.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from smg_mlx.engine.prefix_cache import kv_files
from smg_mlx.engine.prefix_cache.disk_folder import Folder, Read
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier
from smg_mlx.engine.prefix_cache.token_tree import Entry, TokenTree
from smg_mlx.logs import format_bytes

log = logging.getLogger(__name__)

# Fewer tokens are not worth a file (nor a read).
MIN_TOKENS = 64
# The disk's speed, until reads measure it, is taken to be what the synced
# write shows when the folder opens (a disk reads at least that fast, and
# files written lately are read from memory); a copy into MLX is taken to run
# at FIRST_COPY_RATE (bytes/s) until one is measured.
FIRST_COPY_RATE = 2 << 30
RATE_WEIGHT = 0.3
# A request waits for its prefix's read at most this many times the read's
# expected time (and at least MIN_WAIT seconds), then prefills instead.
WAIT_FACTOR = 2.0
MIN_WAIT = 1.0
# Engine-thread time a turn spends copying read entries into MLX.
COPY_SECONDS = 0.02


class DiskReads:
    """`DiskTier`'s reads. It works on the tier's index (`tree`), folder and
    counters (`stats`), and asks the tier whether its folder is gone (`_gone`); the
    entries it copies into memory supersede older ones there (`superseded`)."""

    tree: TokenTree
    open: bool
    prefill_seconds: Callable[[int, int], float]
    _folder: Folder
    _reads: dict[str, Read]  # by file name
    _copying: list[Read]
    _read_rate: float  # measured when the folder opens
    _copy_rate: float

    @property
    def busy(self) -> bool:
        """Read entries wait to be copied into MLX: the engine has work."""
        return bool(self._copying)

    def read_seconds(self, nbytes: int) -> float:
        """What reading a file of `nbytes` and copying it into MLX would take."""
        return nbytes / self._read_rate + nbytes / self._copy_rate

    def _worth(self, entry: Entry, context: int = 0) -> bool:
        """Whether reading `entry` back beats prefilling its tokens after `context`."""
        return entry.length - context >= MIN_TOKENS and self._saving(entry, context) > 0

    def _saving(self, entry: Entry, context: int = 0) -> float:
        """Seconds reading `entry` back saves against prefilling its tokens after `context`."""
        tokens = entry.length - context
        return self.prefill_seconds(tokens, context) - self.read_seconds(entry.nbytes)

    def fetch(self, prompt: Sequence[int], cached: int, room: int) -> Read | None:
        """Start (or join) reading back the file that holds more of `prompt`
        than the `cached` tokens memory holds, if reading it beats prefilling
        the difference and it fits in `room` bytes of memory."""
        if not self.open or not len(self.tree):
            return None
        found = self.tree.longest(prompt, MIN_TOKENS)
        if found is None or found[0] - cached < MIN_TOKENS:
            return None
        n, entry = found
        if entry.value.name in self._reads:
            return self._reads[entry.value.name]
        if entry.nbytes > room:
            return None
        seconds = self.read_seconds(entry.nbytes)
        if seconds >= self.prefill_seconds(n - cached, cached):
            return None
        self.tree.touch(entry)
        entry.value.reading = True
        deadline = time.monotonic() + max(MIN_WAIT, WAIT_FACTOR * seconds)
        read = Read(entry.value.name, TokenTree.tokens(entry), deadline, entry)
        self._reads[read.name] = read
        self._folder.read(read)
        return read

    def _fetched(self, read: Read) -> None:
        read.entry.value.reading = False
        if read.error is not None:
            self._fail(read)
            return
        self.stats.read_seconds += read.seconds
        size = read.entry.nbytes
        if read.seconds > 0:
            self._read_rate += RATE_WEIGHT * (size / read.seconds - self._read_rate)
        header, tokens, arrays = read.data
        read.data = None
        if tokens != read.tokens:
            read.error = kv_files.BadFile("its tokens are not those of its name")
            self._fail(read)
            return
        read.rebuild = kv_files.Rebuild(header, arrays)
        self._copying.append(read)

    def _fail(self, read: Read) -> None:
        """A read that failed: a bad file is deleted, the request goes on without it
        (from what else is cached, or prefilling).
        Nothing is said of a file no longer indexed (its folder deleted, or
        a newer file made it redundant meanwhile)."""
        if not self._gone() and self.tree.get(read.entry.id) is read.entry:
            if isinstance(read.error, FileNotFoundError):  # deleted by someone else
                log.warning("prompt cache: %s is gone; the request goes on without it", read.name)
            else:
                log.warning("prompt cache: ignored and deleted %s: %s", read.name, read.error)
            if isinstance(read.error, kv_files.BadFile):
                self.stats.corrupt += 1
            self.tree.remove(read.entry)
            self._folder.delete(read.name)
            self._count()
        self._finish(read)

    def _finish(self, read: Read) -> None:
        read.done = True
        del self._reads[read.name]

    def _copy(self, memory: MemoryTier) -> None:
        """Copy read entries into MLX for at most COPY_SECONDS, then into memory."""
        end = time.perf_counter() + COPY_SECONDS
        while self._copying and time.perf_counter() < end:
            read = self._copying[0]
            began = time.perf_counter()
            read.rebuild.advance(end - began)
            copied = time.perf_counter() - began
            read.copy_seconds += copied
            self.stats.read_seconds += copied
            if not read.rebuild.done:
                continue
            self._copying.pop(0)
            # The cache alone holds the arrays from here: a read lingers where
            # the reader thread last saw it, and would keep a copy's worth alive.
            rebuild, read.rebuild = read.rebuild, None
            try:
                cache = rebuild.cache()
            except Exception as exc:  # noqa: BLE001 - a file we cannot make a cache of
                read.error = kv_files.BadFile(f"its caches cannot be rebuilt ({exc!r})")
                self._fail(read)
                continue
            size = read.entry.nbytes
            rate = size / max(read.copy_seconds, 1e-6)
            self._copy_rate += RATE_WEIGHT * (rate - self._copy_rate)
            entry, removed = memory.insert(read.tokens, cache, loaded=True)
            if entry is not None:
                memory.materialize([cache])
            self.superseded(removed)
            self.stats.loaded += 1
            self.stats.loaded_bytes += size
            log.debug(
                "prompt cache: read back %d tokens (%s) from disk in %.3fs",
                len(read.tokens), format_bytes(size), read.seconds + read.copy_seconds,
            )  # fmt: skip
            self._finish(read)
