"""The disk tier of the prefix cache (`engine.prefix_cache`): entries kept in files, read back on a
hit, found again after a restart.

`DiskTier` runs on the engine thread: it decides what to write, what to read
back and what to delete, and keeps the index of the files (a `TokenTree` of
their tokens); its folder's own threads do the file work
(`engine.prefix_cache.disk_folder`), and the engine thread copies what they
read into MLX a few arrays a turn (`engine.prefix_cache.disk_reads`, which
also decides which file to read back).

- **What is written.** An entry that stayed in memory WRITE_AFTER seconds
  without a newer one replacing it (a conversation's next turn replaces its
  last within seconds: that one is never written), one the memory tier drops
  for room (a spill), and at a graceful stop whatever is left; only where
  reading it back would be faster than prefilling its tokens again, and,
  while requests run, where a hit would repay what the write costs the
  engine thread (`engine.prefix_cache.write_costs`; the others wait for an
  idle turn).
- **What is read back.** The entry holding more of a prompt than memory does,
  where reading it (and copying it into MLX) beats prefilling the difference,
  and where memory has room for it. The worker knows its prefill speed from
  start-up (`engine.memory.probe`) and learns the disk's from its own reads.
- **Safety.** A folder per model fingerprint, locked (`engine.prefix_cache.disk_folder`);
  files written whole, checksummed and carrying the fingerprint
  (`engine.prefix_cache.kv_files`): one that fails its check, or that another model made,
  is deleted with a log line, never loaded. The folder stays under its size
  bound, least recently used first; an unusable directory (missing and not
  creatable, read-only, full) logs one warning and the worker serves on with
  memory alone. Writes that fail later (a full disk, no inodes left, a
  failing device) or find too little space log one warning and are tried
  again every RETRY_SECONDS, the entries still in memory among them; a folder
  deleted under the worker is made again, with one warning, and what memory
  still holds is written there.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm

from smg_mlx.engine.prefix_cache import kv_files
from smg_mlx.engine.prefix_cache.disk_folder import (
    RESERVE_BYTES,
    Folder,
    Opened,
    Read,
    Remade,
    Write,
)
from smg_mlx.engine.prefix_cache.disk_reads import FIRST_COPY_RATE, DiskReads
from smg_mlx.engine.prefix_cache.folder_contents import file_name
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier
from smg_mlx.engine.prefix_cache.token_tree import Entry, TokenTree
from smg_mlx.engine.prefix_cache.write_costs import WriteCosts
from smg_mlx.logs import counted, format_bytes

log = logging.getLogger(__name__)

FORMAT = "smg-mlx prompt cache 2"
# An entry is written once it has stayed in memory this long unreplaced.
WRITE_AFTER = 2.0
# How often the device's free space is asked (see DiskTier._free_bytes).
FREE_SECONDS = 1.0
# Writes queued at once; spilled entries' bytes in memory awaiting their write.
MAX_QUEUED_WRITES = 4
SPILL_BACKLOG = 1 << 30
# After a write fails, none starts for this long.
RETRY_SECONDS = 10.0
# Entries waiting for an idle turn to be written, at most (the oldest go first).
DEFERRED_MOST = 4096


@dataclass
class DiskStats:
    """What the disk tier holds, and has done since start (as `CacheStats` names them)."""

    disk_entries: int = 0
    disk_bytes: int = 0
    disk_evicted: int = 0
    written: int = 0
    written_bytes: int = 0
    write_seconds: float = 0.0
    loaded: int = 0
    loaded_bytes: int = 0
    read_seconds: float = 0.0
    corrupt: int = 0


class _File:
    """A file in the folder, as the index holds it."""

    __slots__ = ("name", "reading")

    def __init__(self, name: str) -> None:
        self.name = name
        self.reading = False  # a read is under way: not deleted meanwhile


class DiskTier(DiskReads):
    """The disk tier. Every method runs on the engine thread."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int | None,
        model_dirs: Sequence[Path],
        wake: Callable[[], None] = lambda: None,
        kv_format: str | None = None,
    ) -> None:
        """Starts opening the folder (see `ready`); `kv_format`: how the
        entries' KV is stored when quantized (`EngineConfig.kv_format`)."""
        self.directory = Path(directory).expanduser()
        # What prefilling n tokens after c would take (the scheduler's learnt clock).
        self.prefill_seconds: Callable[[int, int], float] = lambda tokens, context: 0.0
        self.stats = DiskStats()
        self.tree = TokenTree()
        self.open = False
        self.off = False  # unusable: the worker serves without the tier
        self._max_bytes = 0
        self._read_rate = 0.0  # measured when the folder opens
        self._copy_rate = float(FIRST_COPY_RATE)
        self._candidates: deque[tuple[float, int]] = deque()  # (kept at, memory entry id)
        # Candidates whose write would not pay while requests run, for an idle turn.
        self._deferred: deque[tuple[float, int]] = deque(maxlen=DEFERRED_MOST)
        self._busy = False  # requests were running at this turn's `tick`
        self._costs = WriteCosts()
        self._writes: dict[str, Write] = {}  # by file name, queued or under way
        self._exported: list[Write] = []  # started this turn: handed to the folder next turn
        self._reads: dict[str, Read] = {}  # by file name
        self._copying: list[Read] = []
        self._full_warned = False
        self._cap_warned = False
        self._retry_at: float | None = None  # writes failed: none starts before then
        # Files the index dropped whose deletion failed (a disk turned read-only):
        # deleted again once a write succeeds, or they would stay past the bound.
        self._undeleted: set[str] = set()
        self._free, self._free_at, self._started_bytes = 0, -FREE_SECONDS, 0  # see _free_bytes
        self._remaking = False  # the folder was deleted: it is being made again
        self._unmade = False  # making it again failed: tried again every RETRY_SECONDS
        versions = (FORMAT, f"mlx {mx.__version__}", f"mlx-lm {mlx_lm.__version__}",
                    str(mx.default_device()))  # fmt: skip
        if kv_format is not None:  # another format's entries live in another folder
            versions += (kv_format,)
        self._folder = Folder(self.directory, model_dirs, versions, max_bytes, wake)

    def ready(self, prefill_seconds: Callable[[int, int], float]) -> None:
        """Wait until the folder is open (or found unusable): a restarted worker
        finds its entries from its first request on. One that takes longer
        than its `open_seconds` joins once it is open (`tick`).
        `prefill_seconds` says what prefilling n tokens after c takes, to
        weigh reads against."""
        self.prefill_seconds = prefill_seconds
        opened = self._folder.opened()
        if opened is not None:
            self._opened(opened)
        else:
            log.warning(
                "prompt cache: %s is not open after %gs; serving without the disk tier "
                "until it is", self.directory, self._folder.open_seconds,
            )  # fmt: skip

    def due(self) -> float | None:
        """Seconds until the next write falls due (None: none waits)."""
        if self._exported:
            return 0.0
        if not self.open or self._remaking or not (self._candidates or self._deferred):
            return None  # (a folder being made again wakes the engine when it is)
        if len(self._writes) >= MAX_QUEUED_WRITES:
            return None  # until a write ends, which wakes the engine
        since = self._deferred[0][0] if self._deferred else self._candidates[0][0]
        due = max(since + WRITE_AFTER, self._retry_at or 0.0)
        return max(0.0, due - time.monotonic())

    @property
    def pending_bytes(self) -> int:
        """Memory held by writes whose entries have left memory, until they are done."""
        return sum(w.nbytes for w in self._writes.values() if w.entry is None)

    def tick(self, memory: MemoryTier, busy: bool) -> bool:
        """Take in what the threads finished, go on copying read entries into
        memory, and start the writes now due (`busy`: with requests running,
        those that pay for themselves alone); whether anything changed."""
        self._busy = busy
        if not busy and self._deferred:  # older than every candidate: first
            self._candidates.extendleft(reversed(self._deferred))
            self._deferred.clear()
        self._hand_over()
        finished = self._folder.finished()
        changed = bool(self._copying or finished)
        for job in finished:
            if isinstance(job, Write):
                self._written(job, memory)
            elif isinstance(job, Read):
                self._fetched(job)
            elif isinstance(job, Remade):
                self._remade(job)
            else:  # the folder, open after start-up stopped waiting for it
                self._opened(job)
        self._copy(memory)
        now = time.monotonic()
        while self._candidates and now - self._candidates[0][0] >= WRITE_AFTER:
            if not self._writable():
                break
            since, id = self._candidates.popleft()
            entry = memory.tree.get(id)
            if entry is not None and not entry.value.carried and self._start_write(entry):
                self._candidates.appendleft((since, id))  # no room now: first, later
                break
        return changed

    def offer(self, entry: Entry) -> None:
        """`entry` was just kept in memory: a candidate for writing, later."""
        if self.open:
            self._candidates.append((entry.value.since, entry.id))

    def spill(self, entries: Sequence[Entry]) -> None:
        """These entries leave memory for room: write those worth keeping."""
        for entry in entries:
            write = self._writing(entry)
            if write is not None:
                write.entry = None  # it now holds the arrays alone
            elif self.pending_bytes < SPILL_BACKLOG and self._writable():
                self._start_write(entry, in_memory=False)

    def superseded(self, entries: Sequence[Entry]) -> None:
        """These entries left memory for a newer one that serves all they
        served: their writes, if not begun, are not wanted."""
        for entry in entries:
            write = self._writing(entry)
            if write is not None:
                write.entry, write.cancelled = None, True

    def _writing(self, entry: Entry) -> Write | None:
        """The write under way of this memory entry, if any."""
        return next((w for w in self._writes.values() if w.entry is entry), None)

    def _opened(self, opened: Opened) -> None:
        for name, reason in opened.bad:
            self.stats.corrupt += 1
            log.warning("prompt cache: ignored and deleted %s: %s", name, reason)
        if opened.error is not None:
            self._turn_off(f"cannot use {self.directory}: {opened.error}")
            return
        self._max_bytes, self._read_rate = opened.max_bytes, opened.write_rate
        for name, header, tokens, size in opened.files:
            self._index(tokens, name, size, header.trimmable, logging.INFO)
        found, found_bytes = len(self.tree), self.tree.nbytes
        self._evict(0)
        self.open = True
        evicted = found - len(self.tree)
        log.info(
            "prompt cache on disk: %s, up to %s (--prompt-cache-disk-bytes); %s "
            "(%s) from earlier runs%s, indexed in %.2fs; writes %s/s%s",
            opened.path, format_bytes(self._max_bytes), counted(found, "entry", "entries"),
            format_bytes(found_bytes),
            f", the oldest {evicted} ({format_bytes(found_bytes - self.tree.nbytes)}) deleted "
            "to fit that" if evicted else "",
            opened.seconds, format_bytes(opened.write_rate), _apart(*opened.apart),
        )  # fmt: skip

    def _turn_off(self, why: str) -> None:
        log.warning("prompt cache: %s; serving on with the memory tier alone", why)
        self.off, self.open = True, False
        self._candidates.clear()
        self._deferred.clear()

    def _index(
        self, tokens: tuple[int, ...], name: str, size: int, trimmable: bool,
        level: int = logging.DEBUG,
    ) -> None:  # fmt: skip
        """Index a good file; delete those it makes redundant, logging each at
        `level` (routine after a write; at start-up, what a crash left)."""
        entry, removed = self.tree.insert(tokens, _File(name), size, trimmable)
        redundant = [name] if entry is None else []  # a longer file serves all it would
        redundant += [old.value.name for old in removed if old.value.name != name]
        for old in redundant:
            log.log(level, "prompt cache: deleted %s: a longer entry holds all its tokens", old)
            self._folder.delete(old)
        self._count()

    def _count(self) -> None:
        self.stats.disk_entries, self.stats.disk_bytes = len(self.tree), self.tree.nbytes

    def _writable(self) -> bool:
        return (
            self.open
            and not self._remaking
            and len(self._writes) < MAX_QUEUED_WRITES
            and (self._retry_at is None or time.monotonic() >= self._retry_at)
        )

    def _covered(self, tokens: tuple[int, ...], trimmable: bool) -> bool:
        """Whether a file already serves every prompt an entry of `tokens` would."""
        found = self.tree.longest((*tokens, -1), len(tokens))
        return found is not None and (found[1].trimmable or not trimmable)

    def _start_write(self, entry: Entry, in_memory: bool = True) -> bool:
        """Start writing `entry` where it is worth it; whether to try again
        later (the device had too little room, or the folder was gone)."""
        held = entry.value
        if held.written or not self._worth(entry):
            return False
        if self._busy and not self._costs.pays(self._saving(entry)):
            if in_memory:
                self._deferred.append((held.since, entry.id))
            return False
        tokens = TokenTree.tokens(entry)
        name = file_name(tokens)
        if name in self._writes or self._covered(tokens, entry.trimmable):
            return False
        room = self._room_for(entry.nbytes)
        if room is not True:
            return room is None
        # An entry kept WRITE_AFTER ago was evaluated long since; one dropped
        # for room may have been kept this turn.
        began = time.perf_counter()
        header, arrays = kv_files.export(held.cache, entry.length, entry.trimmable, in_memory)
        self._started_bytes += header.data_bytes
        write = Write(name, tokens, header, arrays, entry if in_memory else None)
        write.engine_seconds = time.perf_counter() - began
        self._writes[name] = write
        self._exported.append(write)
        return False

    def _hand_over(self) -> None:
        """Give the writes started a turn ago to the folder's writer. Their
        arrays' copies were queued behind the step then running, and ahead
        of the one the turn since has queued: reading them now waits for the
        copies alone. Read in the turn they were started, they would wait for
        the running step, and the device would idle while the engine thread
        prepares the next."""
        for write in self._exported:
            began = time.perf_counter()
            write.views = kv_files.buffers(write.arrays)
            write.engine_seconds += time.perf_counter() - began
            self._folder.write(write)
        self._exported.clear()

    def _room_for(self, nbytes: int) -> bool | None:
        """Make room under the size bound, and check the device's free space:
        whether there is room (None: not now, later perhaps)."""
        if nbytes > self._max_bytes:
            if not self._cap_warned:
                log.warning(
                    "prompt cache: an entry of %s does not fit --prompt-cache-disk-bytes (%s): "
                    "entries that large are not written to disk (memory may keep them)",
                    format_bytes(nbytes), format_bytes(self._max_bytes),
                )  # fmt: skip
                self._cap_warned = True
            return False
        self._evict(nbytes + sum(w.nbytes for w in self._writes.values()))
        free = self._free_bytes()
        if free - nbytes < RESERVE_BYTES:
            if self._gone():
                return None
            if not self._full_warned:
                log.warning(
                    "prompt cache: %s has %s free; not writing entries until there is more "
                    "(asked again every %gs)", self._folder.path, format_bytes(free), RETRY_SECONDS,
                )  # fmt: skip
                self._full_warned = True
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return None
        self._full_warned = False
        return True

    def _free_bytes(self) -> int:
        """The device's free space: asked again every FREE_SECONDS (each write
        asking would cost the engine thread a system call), less what the writes
        started since will take."""
        now = time.monotonic()
        if now - self._free_at >= FREE_SECONDS:
            self._free, self._free_at = self._folder.free_bytes(), now
            self._started_bytes = 0
        return self._free - self._started_bytes

    def _evict(self, incoming: int) -> None:
        if self.tree.nbytes + incoming <= self._max_bytes:
            return  # the usual case: looking through every file would cost a copy of the list
        for entry in self.tree:
            if self.tree.nbytes + incoming <= self._max_bytes:
                break
            if not entry.value.reading:
                self.tree.remove(entry)
                self._folder.delete(entry.value.name)
                self.stats.disk_evicted += 1
        self._count()

    def _written(self, write: Write, memory: MemoryTier) -> None:
        if write.header is None:  # a deletion
            if write.error is not None and not self._gone():  # (gone: the file went with it)
                log.warning("prompt cache: cannot delete %s: %s", write.name, write.error)
                self._undeleted.add(write.name)
            return
        del self._writes[write.name]
        began = time.perf_counter()
        write.arrays = []  # released here, on the engine thread
        self._costs.measured(write.engine_seconds + time.perf_counter() - began)
        if write.cancelled and not write.size:
            return
        if write.error is not None:
            if not self._gone():
                self._write_failed(write.error)
            if write.entry is not None:  # still in memory: written later
                self._candidates.appendleft((write.entry.value.since, write.entry.id))
            return
        if self._retry_at is not None:
            log.info("prompt cache: writing to %s again", self._folder.path)
            self._retry_at = None
        self.stats.written += 1
        self.stats.written_bytes += write.size
        self.stats.write_seconds += write.seconds
        if write.entry is not None:
            write.entry.value.written = True
        self._index(write.tokens, write.name, write.size, write.header.trimmable)
        if self._undeleted:
            self._delete_again()

    def _delete_again(self) -> None:
        """Delete again the files whose deletion failed, now that the folder
        takes writes: but for one written anew since (its name is its tokens')."""
        kept = {entry.value.name for entry in self.tree} | set(self._writes)
        for name in self._undeleted - kept:
            self._folder.delete(name)
        self._undeleted.clear()

    def _write_failed(self, error: Exception) -> None:
        """A write failed (a full disk, no inodes, a failing device): one
        warning until one succeeds again, and none starts for RETRY_SECONDS."""
        if self._retry_at is None:
            log.warning(
                "prompt cache: cannot write to %s (%s); entries stay in memory only until "
                "a write succeeds (tried again every %gs)", self._folder.path, error, RETRY_SECONDS,
            )  # fmt: skip
        self._retry_at = time.monotonic() + RETRY_SECONDS

    def _gone(self) -> bool:
        """Whether the folder was deleted under the worker (or something put in
        its place): then it is made again (with one warning), and the index,
        whose files went with it, emptied."""
        if self._remaking:
            return True
        if not self._folder.missing():
            return False
        if not self._unmade:
            log.warning("prompt cache: %s was deleted or replaced; making it again (its entries "
                        "are lost)", self._folder.path)  # fmt: skip
        self._remaking = True
        for entry in self.tree:
            self.tree.remove(entry)
        self._count()
        self._folder.remake()
        return True

    def _remade(self, remade: Remade) -> None:
        self._remaking = False
        self._free_at = -FREE_SECONDS  # asked while it was gone: ask again
        if remade.error is None:
            if self._unmade:
                log.info("prompt cache: made %s again", self._folder.path)
            self._unmade = False
            return
        if not self._unmade:
            log.warning(
                "prompt cache: cannot make %s again: %s; entries stay in memory only until it "
                "can be (tried again every %gs)", self._folder.path, remade.error, RETRY_SECONDS,
            )  # fmt: skip
        self._unmade = True
        self._retry_at = time.monotonic() + RETRY_SECONDS

    def close(self, memory: MemoryTier, until: Callable[[], float] | None) -> None:
        """A graceful stop: write what memory holds that is worth it and not on
        disk yet, until `until()` (a time.monotonic(), asked as it goes; -inf:
        a second stop signal ended the writes; None: nothing); then let the
        threads go."""
        began = time.monotonic()
        self._busy = False  # (what is left is written now, whatever it costs)
        if self.open and until is not None:
            self._candidates.clear()
            self._deferred.clear()
            given = until() - began  # none where the requests in flight took the grace
            entries, started = list(memory.tree), 0
            for entry in entries:
                self._drain(memory, until, MAX_QUEUED_WRITES - 1)
                if time.monotonic() >= until():
                    break
                self._start_write(entry)
                started += 1
            self._drain(memory, until, 0)
            # Those the time given left unwritten (others were not worth it,
            # or not to be written: covered, too large, no room).
            left = sum(not e.value.written and self._worth(e) for e in entries[started:])
            if left or self._writes:
                log.warning(
                    "prompt cache: %s not written to disk %s%s",
                    counted(left + len(self._writes), "entry", "entries"),
                    "(a second stop signal ended the writes)" if until() == -math.inf else
                    f"in the {time.monotonic() - began:.1f}s given" if given > 0 else
                    "(the requests in flight took all of --shutdown-grace-seconds)",
                    f"; {len(self._writes)} of them begun, which may yet end" if self._writes
                    else "",
                )  # fmt: skip
        self._folder.close(release_lock=not self._writes)

    def _drain(self, memory: MemoryTier, until: Callable[[], float], most: int) -> None:
        """Wait for writes until at most `most` are left or `until()` passes."""
        self._hand_over()
        while len(self._writes) > most and (left := until() - time.monotonic()) > 0:
            for job in self._folder.finished(timeout=min(0.1, max(left, 0.01))):
                if isinstance(job, Write):
                    self._written(job, memory)


def _apart(count: int, nbytes: int) -> str:
    """The open line's note of the model's entries kept apart (`Opened.apart`)."""
    if not count:
        return ""
    return (
        f"; {counted(count, 'entry', 'entries')} ({format_bytes(nbytes)}) of this model under "
        "other settings (another --kv-bits or --kv-group-size, mlx or weights) "
        f"{'is' if count == 1 else 'are'} kept apart, unused"
    )
