"""The disk tier's folder and the two threads that work in it.

`Folder` owns a writer thread (entries to files, deletions) and a reader
thread (opening the folder, files to numpy buffers), so that neither the
engine thread nor a step waits for the disk. The engine thread hands them
jobs (`Write`, `Read`) and takes back the finished ones (`finished`), each
job carrying its outcome. No MLX is made or used on these threads: a write
reads arrays' memory through byte views the engine thread exported (it keeps
the arrays alive until the write is reported done), and a read hands back
numpy buffers for the engine thread to copy into MLX (`kv_files.Rebuild`).

Opening the folder: the model's fingerprint names it (`engine.prefix_cache.fingerprint`),
so other models' entries are never found; a lock keeps a second worker of
the same model out (it serves without the tier and says why), and is taken
again where its file is deleted under the worker (`_hold_lock`); nothing there
is followed through a link (`engine.prefix_cache.safe_files`: a link in place of the
folder or its lock leaves the tier off, one in place of a file the worker
writes whole is replaced); leftovers of a write a crash cut short are
deleted; each entry's header is read and checked (`folder_contents`) against its length and its
model (a truncated file, another model's, or anything there that is not a
regular file is deleted with a log line), and an entry whose tokens extend
another's is checked whole; a synced write of PROBE_BYTES measures the disk.
The worker waits OPEN_SECONDS at most for all that: a folder slower to open
joins when it is done. A folder deleted under the worker is made again
(`remake`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import multiprocessing
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from smg_mlx.config import DISK_CACHE_MOST, DISK_CACHE_SHARE
from smg_mlx.engine.prefix_cache import folder_contents, kv_files, safe_files
from smg_mlx.engine.prefix_cache.fingerprint import fingerprint
from smg_mlx.logs import format_bytes

log = logging.getLogger(__name__)

PROBE_BYTES = 32 << 20
# Start-up waits this long at most for the folder to open: a disk that hangs
# must not keep the worker from serving.
OPEN_SECONDS = 30.0
# No write leaves less free space than this on the device.
RESERVE_BYTES = 1 << 30
# Seconds between two looks, before a write, at whether the lock file is still
# the one this worker holds (`_hold_lock`).
LOCK_SECONDS = 5.0
class Opened:
    """What opening the folder found."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.max_bytes = 0
        self.files: list[tuple[str, kv_files.Header, tuple[int, ...], int]] = []
        self.bad: list[tuple[str, str]] = []  # (file, why): deleted
        self.error: str | None = None  # unusable
        # The model's entries other settings made (another --kv-bits, mlx or weights),
        # in folders of their own: how many, and their bytes.
        self.apart = (0, 0)
        self.write_rate = 0.0  # bytes/s of a synced write
        self.seconds = 0.0


class Write:
    """An entry on its way to a file (or, with no header, a file to delete)."""

    def __init__(self, name: str, tokens: tuple[int, ...] = (), header: Any = None,
                 arrays: Sequence = (), entry: Any = None) -> None:  # fmt: skip
        self.name = name
        self.tokens = tokens
        self.header: kv_files.Header | None = header
        self.arrays = list(arrays)  # kept alive here, on the engine thread, until done
        self.views: list[memoryview] = []  # made on the engine thread (`DiskTier._hand_over`)
        self.entry = entry  # its memory entry, while that is in memory
        self.nbytes = header.data_bytes if header is not None else 0
        self.cancelled = False  # not to be written after all, if not begun
        self.size = 0  # the file's length, once written
        self.seconds = 0.0
        self.error: Exception | None = None
        self.engine_seconds = 0.0  # the engine thread's time on it (`write_costs`)


class Read:
    """A file being read back into memory for the requests that wait on it
    (the scheduler's `Fetch`)."""

    def __init__(self, name: str, tokens: tuple[int, ...], deadline: float, entry: Any) -> None:
        self.name = name
        self.tokens = tokens
        self.deadline = deadline  # time.monotonic() past which requests stop waiting
        self.entry = entry  # its entry in the disk tier's index
        self.done = False  # in memory, or failed
        self.data: tuple | None = None  # from the reader: (header, tokens, arrays)
        self.rebuild: kv_files.Rebuild | None = None
        self.error: Exception | None = None
        self.seconds = 0.0  # reading the file
        self.copy_seconds = 0.0  # copying it into MLX

    @property
    def failed(self) -> bool:
        return self.error is not None


class Remade:
    """The folder, deleted under the worker, made again (or why it could not be)."""

    def __init__(self) -> None:
        self.error: str | None = None


class _Locked(Exception):
    """The folder is another worker's."""


class Folder:
    """The folder of one model's entries, and its threads."""

    def __init__(self, directory: Path, model_dirs: Sequence[Path], versions: Sequence[str],
                 max_bytes: int | None, wake: Callable[[], None]) -> None:  # fmt: skip
        """Starts opening the folder (see `opened`); `wake` is called from the
        threads after each job they finish."""
        self.directory = directory
        self.path: Path | None = None  # set by the opening, before it is reported
        self.model = ""  # the model's fingerprint, which every file carries: likewise
        self._about = b""  # model.json: likewise
        self.open_seconds = OPEN_SECONDS
        self._open_by = time.monotonic() + OPEN_SECONDS
        self._lock: int | None = None
        self._lock_seen = -LOCK_SECONDS  # when `_hold_lock` last looked (writer thread)
        self._lock_lost: str | None = None  # why the folder is another worker's now
        self._identity: tuple[int, int] | None = None  # the folder's (`safe_files.same_folder`)
        self._wake = wake
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._to_writer: queue.SimpleQueue = queue.SimpleQueue()
        self._to_reader: queue.SimpleQueue = queue.SimpleQueue()
        for name, jobs in (("writer", self._to_writer), ("reader", self._to_reader)):
            threading.Thread(
                target=self._serve, args=(jobs,), name=f"prompt-cache-{name}", daemon=True
            ).start()
        self._to_reader.put((self._open, (list(model_dirs), list(versions), max_bytes)))

    # ---- the engine thread ----

    def opened(self) -> Opened | None:
        """Wait for the folder to open (the first job to finish), until
        OPEN_SECONDS after it began; None: not yet (`finished` reports it)."""
        try:
            return self._done.get(timeout=max(self._open_by - time.monotonic(), 0.0))
        except queue.Empty:
            return None

    def write(self, write: Write) -> None:
        self._to_writer.put((self._write, (write, self.path / write.name, self.model)))

    def delete(self, name: str) -> None:
        self.write(Write(name))

    def read(self, read: Read) -> None:
        self._to_reader.put((self._read, (read, self.path / read.name, self.model)))

    def finished(self, timeout: float | None = None) -> list[Write | Read | Opened | Remade]:
        """The jobs finished since the last call; with `timeout`, waits that
        long for one if none has."""
        jobs = []
        try:
            jobs.append(self._done.get(timeout=timeout) if timeout else self._done.get_nowait())
            while True:
                jobs.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return jobs

    def remake(self) -> None:
        """Make the folder again (it was deleted under the worker); a `Remade`
        job reports it, before any write queued after this call."""
        self._to_writer.put((self._remake, ()))

    def missing(self) -> bool:
        """Whether the folder is gone: deleted under the worker, or something
        else put in its place."""
        return not safe_files.same_folder(self.path, self._identity)

    def free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.path).free
        except OSError:
            return 0

    def close(self, release_lock: bool) -> None:
        """Let the threads end after the jobs queued; drop the lock if asked
        (not while a write may still be going on)."""
        for jobs in (self._to_writer, self._to_reader):
            jobs.put(None)
        if release_lock and self._lock is not None:
            os.close(self._lock)

    # ---- the threads (no MLX) ----

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            work, args = job
            self._done.put(work(*args))
            self._wake()

    def _open(self, model_dirs: list[Path], versions: list[str], max_bytes: int | None) -> Opened:
        opened = Opened()
        began = time.perf_counter()
        try:
            key = self.model = fingerprint(model_dirs, versions)
            path = self.directory / key[:24]
            self._about = json.dumps({"model": [str(d) for d in model_dirs], "fingerprint": key,
                                      "versions": versions}, indent=1).encode()  # fmt: skip
            self._make(path)
            for leftover in path.glob("*.tmp"):  # a write a crash cut short
                leftover.unlink(missing_ok=True)
            folder_contents.index(path, key, opened.files, opened.bad)
            held = sum(f[-1] for f in opened.files)
            if max_bytes is None:
                free = shutil.disk_usage(path).free + held
                max_bytes = min(int(free * DISK_CACHE_SHARE), DISK_CACHE_MOST)
            opened.max_bytes = max_bytes
            self._prune(path, max_bytes, held)
            opened.apart = self._apart(path)
            free = shutil.disk_usage(path).free
            if free < PROBE_BYTES + RESERVE_BYTES:
                raise OSError(
                    errno.ENOSPC,
                    f"only {format_bytes(free)} free; the disk tier leaves "
                    f"{format_bytes(RESERVE_BYTES)} free, and measures the disk with "
                    f"{format_bytes(PROBE_BYTES)} more",
                    str(path),
                )
            opened.write_rate = self._probe(path)
            opened.path = self.path = path
        except Exception as exc:  # noqa: BLE001 - whatever the folder held
            opened.error = self._why(exc)
        opened.seconds = time.perf_counter() - began
        return opened

    def _make(self, path: Path) -> None:
        """Make the folder `path` if need be, take its lock and say whose it is."""
        self._identity = safe_files.make_folder(path)
        self._lock = self._take_lock(path)
        with safe_files.create(path / "model.json") as f:
            f.write(self._about)

    def _remake(self) -> Remade:
        remade = Remade()
        try:
            if self._lock is not None:  # the deleted folder's (None: an earlier remake failed)
                os.close(self._lock)
            self._lock = None
            self._make(self.path)
        except Exception as exc:  # noqa: BLE001 - reported on the engine thread
            remade.error = self._why(exc)
        return remade

    def _why(self, exc: Exception) -> str:
        """What went wrong, as the tier's one warning says it."""
        if isinstance(exc, (_Locked, safe_files.Unsafe)):
            return str(exc)
        if isinstance(exc, OSError):
            return f"{exc.strerror or exc} ({exc.filename or self.directory})"
        log.debug("opening or making the prompt cache's folder failed", exc_info=True)
        return repr(exc)

    def _prune(self, ours: Path, max_bytes: int, held: int) -> None:
        """Delete other models' folders that no worker uses, least recently
        used first, until the directory holds at most `max_bytes` with this
        model's `held`: models served here before would otherwise fill the
        disk one bound at a time."""
        others = []
        for folder in self.directory.iterdir():
            try:
                files = folder_contents.cache_files(folder) if folder != ours else None
                if files is None:
                    continue
                stats = [f.stat() for f in files]
            except OSError:
                continue  # going, or not ours to read
            size = sum(f.st_size for f in stats)
            others.append((max(f.st_mtime for f in stats), size, folder))
            held += size
        for used, size, folder in sorted(others):
            if held <= max_bytes:
                break
            try:
                lock = self._take_lock(folder)
            except (_Locked, OSError):
                continue  # another worker serves that model
            try:
                shutil.rmtree(folder)
            except OSError as exc:
                log.warning("prompt cache: cannot delete %s: %s", folder, exc)
                continue
            finally:
                os.close(lock)
            held -= size
            log.info(
                "prompt cache: deleted %s (%s), the entries of another model or KV format, "
                "last used %s, to keep the directory within %s", folder, format_bytes(size),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(used)), format_bytes(max_bytes),
            )  # fmt: skip

    def _apart(self, ours: Path) -> tuple[int, int]:
        """This model's entries in other folders than `ours` (`Opened.apart`)."""
        model = json.loads(self._about)["model"]
        count = size = 0
        for folder in self.directory.iterdir():
            try:
                about = folder_contents.about(folder) if folder != ours else None
                if about is None or about.get("model") != model:
                    continue
                # Its own entries only: a stray file, which keeps the folder from
                # being deleted, leaves them counted; one copied in is not counted.
                entries = folder_contents.sizes(folder, about["fingerprint"])
            except OSError:
                continue  # going, or not ours to read
            size += sum(entries)
            count += len(entries)
        return count, size

    @staticmethod
    def _take_lock(path: Path) -> int:
        fd = safe_files.open_fd(path / "lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise _Locked(
                f"{path} is in use by another worker serving this model (pid {holder}); "
                "give each worker its own --prompt-cache-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(_worker_pid()).encode())
        return fd

    @staticmethod
    def _probe(path: Path) -> float:
        """Bytes per second of a synced write to `path`."""
        probe = path / "probe.tmp"
        block = os.urandom(1 << 20)
        began = time.perf_counter()
        try:
            with safe_files.create(probe) as f:
                for _ in range(PROBE_BYTES // len(block)):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)
        return PROBE_BYTES / max(time.perf_counter() - began, 1e-6)

    def _write(self, write: Write, path: Path, model: str) -> Write:
        began = time.perf_counter()
        try:
            self._check_folder(path)
            if write.header is None:
                path.unlink(missing_ok=True)
            elif self._hold_lock(path.parent) is not None:
                raise _Locked(self._lock_lost)
            elif not write.cancelled:
                write.size = kv_files.write(path, model, write.header, write.tokens, write.views)
        except Exception as exc:  # noqa: BLE001 - reported on the engine thread
            write.error = exc
        finally:
            for view in write.views:
                view.release()
            write.views = []
        write.seconds = time.perf_counter() - began
        return write

    def _read(self, read: Read, path: Path, model: str) -> Read:
        began = time.perf_counter()
        try:
            self._check_folder(path)
            read.data = kv_files.read(path, model)
        except Exception as exc:  # noqa: BLE001 - reported on the engine thread
            read.error = exc
        else:
            # Its last use, for the next start's order: a hint only. A disk
            # turned read-only (ext4 does so on errors), or a file another user
            # owns, refuses it, but the file read back whole and checked still
            # serves: failing it would prefill the prompt and delete a good file.
            with contextlib.suppress(OSError):
                os.utime(path, follow_symlinks=False)
        read.seconds = time.perf_counter() - began
        return read


    def _hold_lock(self, folder: Path) -> str | None:
        """Why `folder` is another worker's now, else None. Its lock file
        deleted, or something put in its place, would let a second worker take
        the folder through a new one: where it is no longer the file this
        worker holds, the lock is taken again through the new one, and where
        another worker holds that, no entry is written until this one can take
        it. Looked at every LOCK_SECONDS (the engine warns once per spell of
        failed writes)."""
        now = time.monotonic()
        if self._lock is None or now - self._lock_seen < LOCK_SECONDS:
            return self._lock_lost
        self._lock_seen = now
        held = os.fstat(self._lock)
        with contextlib.suppress(FileNotFoundError):
            found = os.lstat(folder / "lock")
            if (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino):
                return self._lock_lost
        try:
            lock = self._take_lock(folder)
        except (_Locked, safe_files.Unsafe) as exc:
            self._lock_lost = f"its lock file was deleted or replaced, and {exc}"
            return self._lock_lost
        os.close(self._lock)
        self._lock, self._lock_lost = lock, None
        log.warning("prompt cache: the lock file in %s was deleted or replaced; this worker "
                    "holds the folder's lock again", folder)  # fmt: skip
        return None

    def _check_folder(self, path: Path) -> None:
        """Raises FileNotFoundError where `path`'s folder is gone or replaced:
        checked again on this thread, just before the file is opened, as the
        engine thread's check (`missing`) may be a turn old."""
        if not safe_files.same_folder(path.parent, self._identity):
            raise FileNotFoundError(errno.ENOENT, "the folder is gone or replaced",
                                    str(path.parent))  # fmt: skip


def _worker_pid() -> int:
    """The pid an operator knows the worker by (the one to signal): the
    engine's own process is a child of the worker's (`api.engine_process`)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else os.getpid()
