"""The prefix cache's disk tier: entries spilled and read back, found after a
restart, bad files and other models' files never used, unusable directories.

Every hit is checked against a worker without any prefix cache: greedy output
must not change whether a prefix came from memory, from disk or was prefilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import signal
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from smg_mlx.demo_model import build_model
from smg_mlx.engine.batch import verdicts
from smg_mlx.engine.batch.batch import Batch
from smg_mlx.engine.memory import probe_results
from smg_mlx.engine.prefix_cache import disk_folder, disk_tier, fingerprint, kv_files, safe_files
from smg_mlx.engine.prefix_cache.disk_folder import Folder
from smg_mlx.engine.prefix_cache.folder_contents import file_name
from smg_mlx.engine.schedule.bursts import BurstGatherer
from smg_mlx.server import ONE_STOP_SECONDS

from helpers import generate, prompt, request, wait_until

# Longer than the disk tier's minimum, and the tiny model prefills them in milliseconds.
A = prompt(400, 1)


@pytest.fixture(scope="module")
def cold(model_dir):
    """A worker without a prefix cache: the outputs to compare with."""
    from conftest import RunningWorker, worker_config

    w = RunningWorker(worker_config(model_dir, prompt_cache_bytes=0))
    yield w
    w.stop()


def files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


def _model_folders(directory: Path) -> Iterator[Path]:
    """The models' folders in a prompt cache's directory (what start-up
    remembers is kept there too)."""
    return (f for f in directory.iterdir() if f.name not in (verdicts.FOLDER, probe_results.FOLDER))


def same_as_cold(worker, cold, ids: list[int], max_tokens: int = 8):
    """Generate on `worker`, check the output equals the cold worker's, return it."""
    got = generate(worker.stub, ids, max_tokens=max_tokens)
    assert got.tokens == generate(cold.stub, ids, max_tokens=max_tokens).tokens
    return got


def stats(worker):
    return worker.worker.engine.cache


def logged(caplog, naming: str = "", level: int = logging.NOTSET) -> list[str]:
    """The log lines captured that name `naming`, at `level` or above."""
    said = (r.getMessage() for r in caplog.records if r.levelno >= level)
    return [line for line in said if naming in line]


def test_entries_memory_drops_are_spilled_and_read_back(start_worker, model_dir, cold, tmp_path):
    # Memory holds about one entry: each new one pushes the last out, to disk.
    w = start_worker(model_dir, prompt_cache_dir=tmp_path, prompt_cache_bytes=300_000)
    first = same_as_cold(w, cold, A)
    same_as_cold(w, cold, prompt(400, 2))
    same_as_cold(w, cold, prompt(400, 3))  # its turn drops A's entry from memory
    assert wait_until(lambda: len(files(tmp_path)) >= 1, 10)
    history = A + first.tokens
    again = same_as_cold(w, cold, history + prompt(30, 4))
    assert again.complete.cached_tokens == len(history)
    assert wait_until(lambda: stats(w).disk_tokens == len(history))
    assert stats(w).loaded >= 1 and stats(w).written >= 1 and stats(w).memory_evicted >= 1


def test_a_file_read_back_from_a_disk_turned_read_only_still_serves(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch
):
    """Marking a file's last use is a hint for the next start: a disk that turned
    read-only while the worker ran (ext4 does so on errors) refuses it, and the
    file, read back whole and checked, must still serve, not be taken for bad."""
    w = start_worker(model_dir, prompt_cache_dir=tmp_path, prompt_cache_bytes=300_000)
    first = same_as_cold(w, cold, A)
    same_as_cold(w, cold, prompt(400, 2))
    same_as_cold(w, cold, prompt(400, 3))  # its turn drops A's entry from memory
    assert wait_until(lambda: len(files(tmp_path)) >= 1, 10)
    written = files(tmp_path)
    utime = os.utime

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".kv"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return utime(path, *args, **kwargs)

    monkeypatch.setattr(disk_folder.os, "utime", read_only)
    history = A + first.tokens
    with caplog.at_level(logging.WARNING):
        again = same_as_cold(w, cold, history + prompt(30, 4))
    assert again.complete.cached_tokens == len(history)
    assert stats(w).loaded >= 1 and stats(w).corrupt == 0
    assert not logged(caplog, "ignored and deleted")
    assert all(path.exists() for path in written)


def test_a_restarted_worker_finds_the_entries_it_held_in_memory(
    start_worker, model_dir, cold, tmp_path
):
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    first = same_as_cold(w, cold, A)
    w.stop()  # a graceful stop writes what memory holds
    again = start_worker(model_dir, prompt_cache_dir=tmp_path)
    # Counted as soon as it serves, before any request (metrics read these).
    assert wait_until(lambda: again.worker.engine.cache.disk_entries > 0)
    history = A + first.tokens
    got = same_as_cold(again, cold, history + prompt(30, 5))
    assert got.complete.cached_tokens == len(history)
    # What was read back lives in the cache alone: no read still holds a copy
    # of its arrays (one did, where the reader thread last saw it: a whole
    # entry's worth of memory past what the budget counts).
    reads = [o for o in gc.get_objects() if isinstance(o, disk_folder.Read)]
    assert reads and all(read.rebuild is None for read in reads)
    # A prompt that diverges inside the entry reuses it cut back.
    assert same_as_cold(again, cold, A[:300] + prompt(50, 6)).complete.cached_tokens == 300


def test_a_killed_worker_keeps_what_it_wrote_behind(spawn, model_dir, cold, tmp_path):
    flags = ("--model", str(model_dir), "--prompt-cache-dir", str(tmp_path))
    w = spawn(*flags)
    w.wait_serving()
    first = generate(w.stub, A, max_tokens=8)
    assert wait_until(lambda: len(files(tmp_path)) == 1, 15), w.log.read_text()
    w.stop(signal.SIGKILL)
    again = spawn(*flags)
    again.wait_serving()
    history = A + first.tokens
    got = generate(again.stub, history + [7], max_tokens=8)
    assert got.complete.cached_tokens == len(history)
    assert got.tokens == generate(cold.stub, history + [7], max_tokens=8).tokens


def test_entries_of_earlier_runs_deleted_to_fit_a_smaller_bound_are_said(
    start_worker, model_dir, tmp_path, caplog
):
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    for key in (1, 2):
        generate(w.stub, prompt(400, key), max_tokens=8)
    w.stop()
    written = files(tmp_path)
    assert len(written) == 2
    bound = max(f.stat().st_size for f in written) + 1000  # room for one
    with caplog.at_level(logging.INFO):
        start_worker(model_dir, prompt_cache_dir=tmp_path, prompt_cache_disk_bytes=bound)
        assert wait_until(lambda: "from earlier runs" in caplog.text, 10)
    line = next(r.getMessage() for r in caplog.records if "from earlier runs" in r.getMessage())
    assert "; 2 entries (" in line and ", the oldest 1 (" in line, line
    assert wait_until(lambda: len(files(tmp_path)) == 1)


def test_files_whose_deletion_failed_are_deleted_once_the_disk_takes_writes_again(
    start_worker, model_dir, tmp_path, caplog, monkeypatch
):
    """A file the index drops whose deletion fails (a disk turned read-only for a
    while) would stay past --prompt-cache-disk-bytes, known to no index, until a
    restart: once a write succeeds again, it is deleted."""
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    generate(w.stub, prompt(400, 1), max_tokens=8)
    w.stop()
    (first,) = files(tmp_path)
    bound = first.stat().st_size + 1000  # room for one
    refused = {"on": True}
    write = Folder._write

    def deleting(folder, job, path, model):
        if job.header is None and refused["on"]:
            job.error = OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return job
        return write(folder, job, path, model)

    monkeypatch.setattr(Folder, "_write", deleting)
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path, prompt_cache_disk_bytes=bound)
    with caplog.at_level(logging.WARNING):
        generate(w.stub, prompt(400, 2), max_tokens=8)  # its file takes the first's place
        assert wait_until(lambda: logged(caplog, f"cannot delete {first.name}"), 10)
    assert wait_until(lambda: len(files(tmp_path)) == 2, 10)  # one past the bound
    refused["on"] = False
    generate(w.stub, prompt(400, 3), max_tokens=8)
    assert wait_until(lambda: len(files(tmp_path)) == 1, 10), files(tmp_path)
    assert not first.exists()


def _written(start_worker, model: Path, directory: Path) -> tuple[list[int], Path]:
    """Serve A once and stop: its entry is in `directory`."""
    w = start_worker(model, prompt_cache_dir=directory)
    history = A + generate(w.stub, A, max_tokens=8).tokens
    w.stop()
    (path,) = files(directory)
    return history, path


def test_a_corrupted_file_is_ignored_and_deleted(
    start_worker, model_dir, cold, tmp_path, caplog
):
    history, path = _written(start_worker, model_dir, tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the middle of the KV
    path.write_bytes(bytes(data))
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == 0
    assert "checksum" in caplog.text and path.name in caplog.text
    assert wait_until(lambda: not path.exists())
    assert wait_until(lambda: stats(w).corrupt == 1)


def test_a_prompt_whose_best_file_is_bad_is_served_from_the_next_best(
    start_worker, model_dir, cold, tmp_path
):
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    history = A + generate(w.stub, A, max_tokens=8).tokens
    generate(w.stub, A[:300] + prompt(50, 6), max_tokens=8)  # shares 300 tokens with A
    w.stop()
    best = max(files(tmp_path), key=lambda f: f.stat().st_size)  # the file holding A
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0xFF
    best.write_bytes(bytes(data))
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    assert same_as_cold(w, cold, history + [7]).complete.cached_tokens == 300
    assert stats(w).corrupt == 1


def _two_turns(start_worker, model: Path, directory: Path) -> tuple[list[int], Path, Path]:
    """A conversation's two turns served and stopped, both files left as a
    crash between writing the second and deleting the first leaves them:
    the first turn's history, its file and the second's (which extends it)."""
    history, first = _written(start_worker, model, directory)
    kept = first.read_bytes()
    w = start_worker(model, prompt_cache_dir=directory)
    longer = history + [7] + generate(w.stub, history + [7], max_tokens=8).tokens
    w.stop()
    assert wait_until(lambda: not first.exists())  # replaced by the second
    first.write_bytes(kept)
    return history, first, first.with_name(file_name(longer))


def test_a_bad_file_claiming_to_extend_a_good_one_never_costs_the_good_one(
    start_worker, model_dir, cold, tmp_path, caplog
):
    history, good, bad = _two_turns(start_worker, model_dir, tmp_path)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)
        got = same_as_cold(w, cold, history + [9])
    assert got.complete.cached_tokens == len(history)
    lines = logged(caplog, bad.name)
    assert len(lines) == 1 and "checksum" in lines[0]
    assert good.name not in caplog.text and good.exists() and not bad.exists()


def test_a_file_that_a_longer_good_one_extends_is_deleted_with_a_line_at_start(
    start_worker, model_dir, cold, tmp_path, caplog
):
    history, shorter, longer = _two_turns(start_worker, model_dir, tmp_path)
    with caplog.at_level(logging.INFO):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)
        got = same_as_cold(w, cold, history + [7, 9])
    assert got.complete.cached_tokens == len(history) + 1  # from the longer one, cut back
    assert f"deleted {shorter.name}: a longer entry holds all its tokens" in caplog.text
    assert wait_until(lambda: not shorter.exists()) and longer.exists()


@pytest.mark.parametrize(
    "cut,reason", [(100, "bytes long, not what its header says"), (None, ": empty")],
    ids=["its end", "all"],
)  # fmt: skip
def test_a_truncated_file_is_ignored_and_deleted_at_start(
    start_worker, model_dir, cold, tmp_path, caplog, cut, reason
):
    history, path = _written(start_worker, model_dir, tmp_path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - cut if cut else 0)  # as a crash mid-write would
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == 0
    (line,) = logged(caplog, f"ignored and deleted {path.name}")
    assert reason in line
    assert not path.exists()


def test_a_file_deleted_under_a_running_worker_is_said_gone_and_the_request_prefills(
    start_worker, model_dir, cold, tmp_path, caplog
):
    history, path = _written(start_worker, model_dir, tmp_path)
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)  # it indexes the file
        path.unlink()  # as an operator clearing the folder would
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == 0
    (line,) = logged(caplog, path.name)
    assert f"prompt cache: {path.name} is gone; the request goes on without it" in line


def test_a_file_with_a_damaged_header_costs_only_its_own_entry(
    start_worker, model_dir, cold, tmp_path, caplog
):
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    histories = [ids + generate(w.stub, ids, max_tokens=8).tokens for ids in (A, prompt(400, 2))]
    w.stop()
    damaged, kept = files(tmp_path)
    data = damaged.read_bytes()
    damaged.write_bytes(data.replace(b'"nbytes"', b'"nbyTes"', 1))  # one bit flipped
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)
        cached = [same_as_cold(w, cold, h + [7]).complete.cached_tokens for h in histories]
    assert sorted(cached) == [0, len(histories[0])]  # the other entry still serves
    assert f"ignored and deleted {damaged.name}" in caplog.text
    assert "memory tier alone" not in caplog.text
    assert not damaged.exists() and kept.exists()


def test_a_fifo_among_the_entries_is_refused_at_start_and_the_rest_serve(
    start_worker, model_dir, cold, tmp_path, caplog
):
    history, path = _written(start_worker, model_dir, tmp_path)
    fifo = path.with_name("0" * 32 + ".kv")
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == len(history)
    lines = logged(caplog, fifo.name)
    assert len(lines) == 1 and "a FIFO, not a regular file" in lines[0]
    assert not os.path.lexists(fifo)


def test_an_entry_replaced_by_a_fifo_costs_only_its_own_hit(
    start_worker, model_dir, cold, tmp_path, caplog
):
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    histories = [ids + generate(w.stub, ids, max_tokens=8).tokens for ids in (A, prompt(400, 2))]
    w.stop()
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    fifo = files(tmp_path)[0].with_name(file_name(histories[0]))
    fifo.unlink()
    os.mkfifo(fifo)  # after indexing: the request for it reads it
    with caplog.at_level(logging.WARNING):
        assert same_as_cold(w, cold, histories[0] + [7]).complete.cached_tokens == 0
        got = same_as_cold(w, cold, histories[1] + [7])
    assert got.complete.cached_tokens == len(histories[1])  # not stuck behind the FIFO
    lines = logged(caplog, fifo.name)
    assert len(lines) == 1 and "a FIFO, not a regular file" in lines[0]
    assert wait_until(lambda: not os.path.lexists(fifo))


def test_a_folder_slow_to_open_does_not_hold_the_worker_back(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch
):
    history, _ = _written(start_worker, model_dir, tmp_path)
    stuck = threading.Event()
    read_key = kv_files.read_key

    def slow(*args):
        stuck.wait(60)  # a disk that hangs while the folder is indexed
        return read_key(*args)

    monkeypatch.setattr(kv_files, "read_key", slow)
    monkeypatch.setattr(disk_folder, "OPEN_SECONDS", 0.5, raising=False)
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)  # SERVING meanwhile
        same_as_cold(w, cold, prompt(100, 3))
    assert "is not open after 0.5s" in caplog.text
    stuck.set()  # the indexing ends: the tier joins
    assert wait_until(lambda: stats(w).disk_entries == 1)
    assert same_as_cold(w, cold, history + [7]).complete.cached_tokens == len(history)


@pytest.mark.parametrize("link", ["lock", "folder"])
def test_a_link_in_place_of_the_lock_or_the_folder_is_never_followed(
    start_worker, model_dir, cold, tmp_path, caplog, link
):
    _, path = _written(start_worker, model_dir, tmp_path / "cache")
    folder = path.parent
    elsewhere = tmp_path / "elsewhere"  # files a worker run as root must leave alone
    elsewhere.mkdir()
    for name in ("lock", "model.json"):
        (elsewhere / name).write_text("precious")
    if link == "lock":
        (folder / "lock").unlink()
        (folder / "lock").symlink_to(elsewhere / "lock")
    else:
        shutil.rmtree(folder)
        folder.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
        history = A + same_as_cold(w, cold, A).tokens
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == len(history)  # memory serves on
    assert sorted(os.listdir(elsewhere)) == ["lock", "model.json"]
    assert all((elsewhere / name).read_text() == "precious" for name in ("lock", "model.json"))
    warnings = logged(caplog, level=logging.WARNING)
    assert len(warnings) == 1 and "is a symbolic link" in warnings[0]
    assert "memory tier alone" in warnings[0]


def test_files_the_worker_writes_replace_links_and_never_write_through_them(
    start_worker, model_dir, cold, tmp_path
):
    w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
    w.stop()
    folder = next(_model_folders(tmp_path / "cache"))
    victims = [tmp_path / "victim-1", tmp_path / "victim-2"]
    for victim in victims:
        victim.write_text("precious")
    (folder / "model.json").unlink()
    (folder / "model.json").symlink_to(victims[0])
    w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
    history = A + generate(cold.stub, A, max_tokens=8).tokens
    entry = folder / file_name(history)
    entry.with_suffix(".tmp").symlink_to(victims[1])  # the name its write goes through
    same_as_cold(w, cold, A)
    assert wait_until(lambda: entry.exists(), 15)
    assert [v.read_bytes() for v in victims] == [b"precious"] * 2
    assert not (folder / "model.json").is_symlink() and not entry.is_symlink()
    w.stop()
    again = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
    assert same_as_cold(again, cold, history + [7]).complete.cached_tokens == len(history)


def test_another_models_entries_are_never_used(
    start_worker, model_dir, other_model_dir, tmp_path
):
    # A fine-tune written over the same path: same config, other weights.
    model = shutil.copytree(model_dir, tmp_path / "model")
    history, _ = _written(start_worker, model, tmp_path / "cache")
    shutil.rmtree(model)
    shutil.copytree(other_model_dir, model)
    w = start_worker(model, prompt_cache_dir=tmp_path / "cache")
    fresh = start_worker(model, prompt_cache_bytes=0)
    got = generate(w.stub, history + [7], max_tokens=8)
    assert got.complete.cached_tokens == 0
    assert got.tokens == generate(fresh.stub, history + [7], max_tokens=8).tokens
    assert len(files(tmp_path / "cache")) == 1  # its own folder is still empty


def test_an_entry_copied_from_another_models_folder_is_not_used(
    start_worker, model_dir, other_model_dir, cold, tmp_path, caplog
):
    # The same shapes, other weights.
    history, foreign = _written(start_worker, other_model_dir, tmp_path / "cache")
    start_worker(model_dir, prompt_cache_dir=tmp_path / "cache").stop()  # makes this one's folder
    (ours,) = [f for f in _model_folders(tmp_path / "cache") if f != foreign.parent]
    copy = Path(shutil.copy2(foreign, ours))
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == 0
    lines = logged(caplog, copy.name)
    assert len(lines) == 1 and "another model or KV format made it" in lines[0]
    assert not copy.exists() and foreign.exists()


def _as_first_format(path: Path) -> None:
    """Rewrite the entry in `path` as the first format wrote it: no model in
    its header, and a checksum that matches."""
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data, 8)
    head = json.loads(data[16 : 16 + length])
    head.pop("model", None)
    raw = json.dumps(head).encode()
    body = b"SMGKV01\n" + struct.pack("<Q", len(raw)) + raw + data[16 + length : -12]
    path.write_bytes(body + struct.pack("<IQ", zlib.crc32(body), len(body) + 12))


def test_an_entry_of_the_first_format_is_taken_for_another_models(
    start_worker, model_dir, cold, tmp_path, caplog
):
    history, path = _written(start_worker, model_dir, tmp_path)
    _as_first_format(path)  # it named no model: whose it is cannot be told
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path)
        got = same_as_cold(w, cold, history + [7])
    assert got.complete.cached_tokens == 0
    lines = logged(caplog, path.name)
    assert len(lines) == 1 and "ignored and deleted" in lines[0]
    assert not path.exists()


def test_an_unusable_directory_logs_one_warning_and_the_worker_serves(
    start_worker, model_dir, cold, tmp_path, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=blocker / "cache")
        first = same_as_cold(w, cold, A)
        got = same_as_cold(w, cold, A + first.tokens + [7])
    assert got.complete.cached_tokens == len(A) + len(first.tokens)  # memory still serves
    warnings = [r for r in caplog.records if "memory tier alone" in r.getMessage()]
    assert len(warnings) == 1 and str(blocker) in warnings[0].getMessage()


def test_a_nearly_full_disk_is_not_written_to_at_all(model_dir, tmp_path, monkeypatch):
    # The disk's speed is measured by writing to it: not where that would fill it.
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100 << 20))

    def probe(path: Path) -> float:
        raise AssertionError("the disk was written to")

    monkeypatch.setattr(Folder, "_probe", staticmethod(probe))
    folder = Folder(tmp_path, [model_dir], ["v"], None, lambda: None)
    error = folder.opened().error
    folder.close(release_lock=True)
    assert error is not None and "100.0 MiB free" in error  # the tier's one warning says why


def test_a_cache_folder_deleted_while_in_use_is_made_again_with_one_warning(
    start_worker, model_dir, cold, tmp_path, caplog
):
    # Memory holds about one entry: each new one pushes the last out, to disk.
    w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache", prompt_cache_bytes=300_000)
    history = A + same_as_cold(w, cold, A).tokens
    for key in (2, 3):
        same_as_cold(w, cold, prompt(400, key))
    assert wait_until(lambda: len(files(tmp_path)) >= 2, 10)
    shutil.rmtree(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        got = same_as_cold(w, cold, history + [7])  # its file went with the folder
        again = history + [7] + got.tokens
        for key in (4, 5):
            same_as_cold(w, cold, prompt(400, key))  # spill to the folder made again
        assert wait_until(lambda: len(files(tmp_path)) >= 1, 10)
        served = same_as_cold(w, cold, again + [9]).complete.cached_tokens
    assert got.complete.cached_tokens == 0 and served == len(again)
    warnings = logged(caplog, level=logging.WARNING)
    assert len(warnings) == 1 and "was deleted or replaced; making it again" in warnings[0]


def test_a_link_put_in_place_of_the_folder_while_in_use_is_never_written_through(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch
):
    """Whoever can write the cache directory cannot make the worker write
    elsewhere: a link in place of the model's folder stops the disk tier, with
    one warning naming it, and once the link goes the folder is made again."""
    monkeypatch.setattr(disk_tier, "RETRY_SECONDS", 0.2)
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
    same_as_cold(w, cold, prompt(400, 1))
    assert wait_until(lambda: len(files(tmp_path)) == 1, 10)
    (folder,) = [f for f in _model_folders(tmp_path / "cache") if (f / "lock").exists()]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(folder)
    folder.symlink_to(elsewhere)
    with caplog.at_level(logging.INFO):
        for key in (2, 3):
            same_as_cold(w, cold, prompt(400, key))
        assert wait_until(lambda: logged(caplog, "cannot make"), 10)
        time.sleep(0.5)  # several retries
        assert list(elsewhere.iterdir()) == []
        folder.unlink()
        same_as_cold(w, cold, prompt(400, 4))
        assert wait_until(lambda: len(files(tmp_path / "cache")) >= 1, 10)
    assert list(elsewhere.iterdir()) == []
    warnings = logged(caplog, level=logging.WARNING)
    assert len(warnings) == 2, warnings
    assert "was deleted or replaced" in warnings[0]
    assert "is a symbolic link, not a folder" in warnings[1] and "tried again" in warnings[1]
    assert logged(caplog, f"made {folder} again")


def test_the_free_space_asked_while_the_folder_was_gone_is_not_kept(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch
):
    # Free space is asked once a minute here: the first ask finds no folder.
    monkeypatch.setattr(disk_tier, "FREE_SECONDS", 60.0)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache", prompt_cache_bytes=300_000)
    shutil.rmtree(tmp_path / "cache")
    with caplog.at_level(logging.WARNING):
        for key in (2, 3, 4, 5):
            same_as_cold(w, cold, prompt(400, key))  # each pushes the last out, to disk
        assert wait_until(lambda: len(files(tmp_path)) >= 2, 10)
    warnings = logged(caplog, level=logging.WARNING)
    assert len(warnings) == 1 and "was deleted or replaced; making it again" in warnings[0]


def test_entries_kept_while_the_disk_was_full_are_written_once_it_has_room(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch
):
    """Entries memory keeps while the device lacks room reach the disk once it
    has room again, with no request to set them off (a crash would lose them)."""
    free = {"bytes": 0}
    monkeypatch.setattr(Folder, "free_bytes", lambda self: free["bytes"])
    monkeypatch.setattr(disk_tier, "RETRY_SECONDS", 0.2)
    monkeypatch.setattr(disk_tier, "FREE_SECONDS", 0.0)
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        for key in (1, 2):
            same_as_cold(w, cold, prompt(400, key))
        assert wait_until(lambda: logged(caplog, "not writing entries until there is more"), 10)
        time.sleep(0.5)
        assert files(tmp_path) == []
        free["bytes"] = 1 << 40
        assert wait_until(lambda: len(files(tmp_path)) == 2, 10)
        # (the engine thread says so once it hears a write finished: after its file is there)
        assert wait_until(lambda: logged(caplog, "writing to"), 10)
    assert len(logged(caplog, "not writing entries until there is more")) == 1
    assert "again" in logged(caplog, "writing to")[0]


def test_an_entry_whose_write_found_the_folder_gone_is_written_to_the_folder_made_again(
    start_worker, model_dir, cold, tmp_path, monkeypatch
):
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path / "cache")
    same_as_cold(w, cold, prompt(400, 1))
    assert wait_until(lambda: len(files(tmp_path)) == 1, 10)
    shutil.rmtree(tmp_path / "cache")
    same_as_cold(w, cold, prompt(400, 2))  # still in memory: written where the folder is again
    assert wait_until(lambda: len(files(tmp_path)) == 1, 10)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])  # no inodes left; a failing disk
def test_writes_that_fail_say_so_once_and_writing_resumes(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch, code
):
    write, failed = kv_files.write, []

    def failing(*args):
        if failed is not None:
            failed.append(args[0])
            raise OSError(code, os.strerror(code), str(args[0]))
        return write(*args)

    monkeypatch.setattr(kv_files, "write", failing)
    monkeypatch.setattr(disk_tier, "RETRY_SECONDS", 0.2, raising=False)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path, prompt_cache_bytes=300_000)
    with caplog.at_level(logging.WARNING):
        for key in range(1, 7):
            same_as_cold(w, cold, prompt(400, key))  # each pushes the last to disk
            time.sleep(0.003)
        assert len(failed) >= 3
        failed = None
        for key in range(7, 9):
            same_as_cold(w, cold, prompt(400, key))
        assert wait_until(lambda: len(files(tmp_path)) >= 1, 10)
    warnings = logged(caplog, level=logging.WARNING)
    assert len(warnings) == 1 and os.strerror(code) in warnings[0]


def test_an_idle_engine_waiting_on_slow_writes_sleeps(start_worker, model_dir, tmp_path,
                                                      monkeypatch):
    """Entries due for writing while the disk is still busy with earlier ones
    (MAX_QUEUED_WRITES) wait for a write to finish: the idle engine sleeps until
    then rather than turning its loop over and over (a core, and the GIL the
    writers need)."""
    stuck, write = threading.Event(), kv_files.write
    monkeypatch.setattr(kv_files, "write", lambda *args: stuck.wait(60) and write(*args))
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    turns, gather = [], BurstGatherer.gather

    def counted(self, inbox) -> None:  # once for each time the idle engine wakes
        turns.append(1)
        gather(self, inbox)

    monkeypatch.setattr(BurstGatherer, "gather", counted)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path)
    try:
        for key in range(1, disk_tier.MAX_QUEUED_WRITES + 3):  # more than can be written at once
            generate(w.stub, prompt(400, key), max_tokens=4)
        time.sleep(0.5)  # every entry due, the writes all stuck
        before = len(turns)
        time.sleep(1.0)
        assert len(turns) - before < 20
    finally:
        stuck.set()


def _writes_waiting_behind_a_stream(start_worker, model_dir, tmp_path, monkeypatch, **settings):
    """A worker whose writes cost more than a hit would save (a slow export),
    a long stream running on it, and the entries of three prompts asked
    meanwhile: the first written (its cost not known yet), two waiting. The
    worker, the stream's call, and an event set when the stream ends."""
    export = kv_files.export

    def slow_export(*args, **kwargs):  # as a large entry on a slow host would be
        time.sleep(0.2)
        return export(*args, **kwargs)

    monkeypatch.setattr(kv_files, "export", slow_export)
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    step = Batch.step

    def slow_step(*args, **kwargs):  # the stream outlasts what follows on a fast host too
        time.sleep(0.003)
        return step(*args, **kwargs)

    monkeypatch.setattr(Batch, "step", slow_step)
    w = start_worker(model_dir, prompt_cache_dir=tmp_path, **settings)
    long = w.stub.Generate(request(prompt(16, 9), max_tokens=2000, ignore_eos=True), timeout=60)
    streamed, ended = [], threading.Event()

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            for response in long:
                streamed.append(response)
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    assert wait_until(lambda: streamed, 10)
    generate(w.stub, prompt(400, 1), max_tokens=4)
    assert wait_until(lambda: len(files(tmp_path)) == 1, 10)
    for key in (2, 3):
        generate(w.stub, prompt(400, key), max_tokens=4)
    time.sleep(0.5)  # both due, the stream still running
    assert not ended.is_set(), "the long stream ended before the check: make it longer"
    return w, long, ended


def test_writes_costing_more_than_a_hit_saves_wait_while_requests_run(
    start_worker, model_dir, tmp_path, monkeypatch, caplog
):
    """Copying an entry out for its write costs the engine thread, between
    steps; where that outweighs the prefill a hit would save, a running stream
    would pay it for nothing: such writes wait until no request runs."""
    caplog.set_level(logging.INFO, "smg_mlx")
    _, long, _ = _writes_waiting_behind_a_stream(start_worker, model_dir, tmp_path, monkeypatch)
    waited = len(files(tmp_path))
    long.cancel()
    assert waited == 1
    assert wait_until(lambda: len(files(tmp_path)) >= 3, 10)  # once no request runs
    assert len(logged(caplog, "wait for an idle moment")) == 1


def test_entries_a_stop_leaves_no_time_to_write_are_said(
    start_worker, model_dir, tmp_path, monkeypatch, caplog
):
    """A stream that runs through the whole grace leaves the stop no time to
    write what waited: the entries it could not write are said all the same."""
    w, _, _ = _writes_waiting_behind_a_stream(
        start_worker, model_dir, tmp_path, monkeypatch, shutdown_grace_seconds=0.1
    )
    with caplog.at_level(logging.WARNING, "smg_mlx"):
        assert w.stop(hang_up=False) == 0  # (a hang-up would end the stream within the grace)
    said = logged(caplog, "not written to disk")
    assert len(said) == 1 and "took all of --shutdown-grace-seconds" in said[0], said


def test_entries_a_second_stop_signal_leaves_unwritten_are_said_for_that_reason(
    start_worker, model_dir, tmp_path, monkeypatch, caplog
):
    """A second stop signal ends the writes at once, with grace to spare: the
    entries left are said to be left by it, not by the requests in flight
    (an operator would raise --shutdown-grace-seconds for nothing)."""
    w, _, _ = _writes_waiting_behind_a_stream(
        start_worker, model_dir, tmp_path, monkeypatch, shutdown_grace_seconds=60
    )
    with caplog.at_level(logging.WARNING, "smg_mlx"):
        w.loop.call_soon_threadsafe(w.worker.request_stop)
        stopping = asyncio.run_coroutine_threadsafe(w.worker.shutdown(), w.loop)
        time.sleep(ONE_STOP_SECONDS + 0.2)  # (a second signal, not the first delivered twice)
        w.loop.call_soon_threadsafe(w.worker.request_stop)
        assert stopping.result(30) == 0
    said = logged(caplog, "not written to disk")
    assert len(said) == 1 and "a second stop signal ended the writes" in said[0], said


def test_a_disk_bound_too_small_for_an_entry_says_so_once_and_nothing_else(
    start_worker, model_dir, cold, tmp_path, caplog
):
    with caplog.at_level(logging.WARNING):
        w = start_worker(model_dir, prompt_cache_dir=tmp_path, prompt_cache_disk_bytes=1024)
        for key in (1, 2):
            same_as_cold(w, cold, prompt(400, key))
        w.stop()  # a graceful stop, with time to write
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("smg_mlx")]
    assert len(warnings) == 1 and "does not fit --prompt-cache-disk-bytes" in warnings[0]
    assert not files(tmp_path)


def test_the_lock_names_the_worker_that_holds_it(spawn, model_dir, tmp_path):
    """The pid an operator would signal: the worker's, not its engine's process's."""
    first = spawn("--model", str(model_dir), "--prompt-cache-dir", str(tmp_path))
    first.wait_serving()
    second = spawn("--model", str(model_dir), "--prompt-cache-dir", str(tmp_path))
    second.wait_serving()
    assert f"in use by another worker serving this model (pid {first.proc.pid})" in (
        second.log.read_text()
    )


def test_a_worker_whose_lock_file_was_deleted_writes_only_while_it_holds_the_lock_again(
    start_worker, model_dir, cold, tmp_path, caplog, monkeypatch
):
    """A cleanup script deletes a running worker's lock file, and a second
    worker starts on the same directory: the second takes the folder through a
    new lock file, and the first writes nothing more there (one warning naming
    the other worker) until it can hold the lock again."""
    monkeypatch.setattr(disk_folder, "LOCK_SECONDS", 0.0)
    monkeypatch.setattr(disk_tier, "WRITE_AFTER", 0.05)
    monkeypatch.setattr(disk_tier, "RETRY_SECONDS", 0.2)
    first = start_worker(model_dir, prompt_cache_dir=tmp_path)
    same_as_cold(first, cold, prompt(400, 1))
    assert wait_until(lambda: len(files(tmp_path)) == 1, 10)
    (folder,) = [f for f in _model_folders(tmp_path) if (f / "lock").exists()]
    (folder / "lock").unlink()
    second = start_worker(model_dir, prompt_cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        same_as_cold(first, cold, prompt(400, 2))
        assert wait_until(lambda: logged(caplog, "cannot write to"), 10)
        time.sleep(0.5)  # several retries, each finding the lock still the second's
    assert len(files(tmp_path)) == 1
    (warning,) = logged(caplog, level=logging.WARNING)
    assert "lock file was deleted or replaced, and" in warning
    assert "in use by another worker serving this model" in warning
    second.stop()  # lets the lock go
    with caplog.at_level(logging.INFO):
        same_as_cold(first, cold, prompt(400, 3))
        assert wait_until(lambda: len(files(tmp_path)) >= 2, 10)
    assert logged(caplog, "holds the folder's lock again")
    assert (folder / "lock").read_text() == str(os.getpid())


def test_a_second_worker_on_the_same_directory_says_why_it_goes_without(
    start_worker, model_dir, cold, tmp_path, caplog
):
    first = start_worker(model_dir, prompt_cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        second = start_worker(model_dir, prompt_cache_dir=tmp_path)
        same_as_cold(second, cold, A)
    assert "in use by another worker" in caplog.text
    history = A + same_as_cold(first, cold, A).tokens
    first.stop()
    assert len(files(tmp_path)) == 1  # the first one's
    second.stop()
    assert len(files(tmp_path)) == 1  # the second wrote nothing
    third = start_worker(model_dir, prompt_cache_dir=tmp_path)
    assert same_as_cold(third, cold, history + [7]).complete.cached_tokens == len(history)


def test_entries_that_cannot_be_cut_back_are_reused_from_disk_only_whole(
    start_worker, tmp_path
):
    model = build_model(tmp_path / "sliding", ["--sliding-window", "32"])
    fresh = start_worker(model, prompt_cache_bytes=0)
    ids = prompt(120, 8)  # well past the window: its cache has wrapped
    w = start_worker(model, prompt_cache_dir=tmp_path / "cache")
    history = ids + generate(w.stub, ids, max_tokens=6).tokens
    w.stop()
    w = start_worker(model, prompt_cache_dir=tmp_path / "cache")

    def same(prompt_ids: list[int]) -> int:
        got = generate(w.stub, prompt_ids, max_tokens=6)
        assert got.tokens == generate(fresh.stub, prompt_ids, max_tokens=6).tokens
        return got.complete.cached_tokens

    assert same(ids[:100] + prompt(30, 9)) == 0  # would need a cut
    assert same(history + [7]) == len(history)  # extends it whole


# ---- the file format on its own ----


def _array(shape, dtype=mx.float32) -> mx.array:
    return mx.random.normal(shape).astype(dtype)


def _caches() -> list:
    kv = KVCache()
    kv.update_and_fetch(_array((1, 2, 5, 4), mx.bfloat16), _array((1, 2, 5, 4), mx.bfloat16))
    rotating = RotatingKVCache(max_size=4)
    for _ in range(6):
        rotating.update_and_fetch(_array((1, 2, 1, 4)), _array((1, 2, 1, 4)))
    arrays = ArraysCache(2)
    arrays[0], arrays[1] = _array((1, 3)), _array((1, 2, 2))
    inner = KVCache()
    inner.update_and_fetch(_array((1, 1, 5, 2)), _array((1, 1, 5, 2)))
    return [kv, rotating, arrays, CacheList(inner, RotatingKVCache(max_size=8))]


def _states(cache: list) -> list:
    flat = []

    def walk(value):
        if isinstance(value, mx.array):
            flat.append(value.tolist())
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        else:
            flat.append(value)

    for layer in cache:
        walk(layer.state)
    return flat


def test_every_kind_of_layer_cache_comes_back_as_it_was(tmp_path):
    cache = _caches()
    header, arrays = kv_files.export(cache, tokens=5, trimmable=False)
    mx.eval(arrays)
    path = tmp_path / "entry.kv"
    kv_files.write(path, "m", header, list(range(5)), kv_files.buffers(arrays))
    read_header, tokens, data = kv_files.read(path, "m")
    assert tokens == tuple(range(5))
    rebuild = kv_files.Rebuild(read_header, data)
    while not rebuild.done:
        rebuild.advance(0)
    back = rebuild.cache()
    assert [type(c) for c in back] == [type(c) for c in cache]
    assert _states(back) == _states(cache)
    assert [c.nbytes for c in back] == [c.nbytes for c in cache]


def test_a_file_the_system_will_not_create_fails_with_its_reason(tmp_path, monkeypatch):
    """A create refused (a folder made read-only or immutable, inodes run out)
    says the system's reason, which the write's warning passes on: not that
    the file it could not make is missing."""

    def refused(path, *args):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(path))

    monkeypatch.setattr(safe_files.os, "open", refused)
    with pytest.raises(PermissionError, match=os.strerror(errno.EPERM)):
        safe_files.create(tmp_path / "entry.kv.tmp")


def test_a_file_cut_anywhere_is_refused(tmp_path):
    cache = _caches()[:1]
    header, arrays = kv_files.export(cache, tokens=5, trimmable=True)
    mx.eval(arrays)
    path = tmp_path / "entry.kv"
    size = kv_files.write(path, "m", header, list(range(5)), kv_files.buffers(arrays))
    whole = path.read_bytes()
    for cut in (4, 20, size // 2, size - 1):
        path.write_bytes(whole[:cut])
        with pytest.raises(kv_files.BadFile):
            kv_files.read(path, "m")
        with pytest.raises(kv_files.BadFile):
            kv_files.read_key(path, "m")


@pytest.mark.parametrize(
    "field, value", [("tokens", 10**13), ("tokens", "5"), ("trimmable", None), ("arrays", {})]
)
def test_a_header_whose_fields_are_not_what_is_written_is_refused(tmp_path, field, value):
    header, arrays = kv_files.export(_caches()[:1], tokens=5, trimmable=True)
    mx.eval(arrays)
    path = tmp_path / "entry.kv"
    kv_files.write(path, "m", replace(header, **{field: value}), range(5), kv_files.buffers(arrays))
    for read in (kv_files.read_key, kv_files.read):  # refused, not read as far as it says
        with pytest.raises(kv_files.BadFile):
            read(path, "m")


def test_weights_rewritten_in_a_few_places_are_another_model(tmp_path, monkeypatch):
    # Large files are sampled, not read whole: bytes between the samples changed
    # (a few tensors of an adapter fused in) still make another fingerprint.
    for name, value in (("WHOLE_BELOW", 1024), ("HEAD_BYTES", 256), ("SAMPLES", 4),
                        ("SAMPLE_BYTES", 64)):  # fmt: skip
        monkeypatch.setattr(fingerprint, name, value)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 64)
    before = fingerprint.fingerprint([tmp_path], ["v"])
    written = weights.stat()
    time.sleep(0.05)  # written later, as a fine-tune is
    with open(weights, "r+b") as f:
        f.seek(3000)  # between the samples
        f.write(b"\xff" * 16)
    os.utime(weights, ns=(written.st_atime_ns, written.st_mtime_ns))  # as `cp -p` would
    assert len(weights.read_bytes()) == 256 * 64
    assert fingerprint.fingerprint([tmp_path], ["v"]) != before


def test_files_that_cannot_change_the_model_leave_its_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    before = fingerprint.fingerprint([tmp_path], ["v"])
    (tmp_path / ".DS_Store").write_bytes(b"finder")  # a folder looked at on a Mac
    (tmp_path / "README.md").write_text("# a model card")
    assert fingerprint.fingerprint([tmp_path], ["v"]) == before
    (tmp_path / "tokenizer.json").write_text("{}")
    assert fingerprint.fingerprint([tmp_path], ["v"]) != before


def test_other_models_folders_no_worker_uses_go_oldest_first_past_the_bound(
    model_dir, tmp_path, caplog
):
    def folder_of(key: str, age: int, *others: str) -> Path:
        """A folder as another model's worker leaves it, last used `age` s after 1970."""
        folder = tmp_path / key[:24]
        folder.mkdir()
        (folder / "model.json").write_text(json.dumps({"fingerprint": key}))
        for name in ("x.kv", *others):
            (folder / name).write_bytes(bytes(600_000))
            os.utime(folder / name, (age, age))
        return folder

    old, newer, in_use = (folder_of(f"{i}" * 64, 1000 + i) for i in range(3))
    # Older still, but not ours to delete: a name or a file no worker makes.
    foreign = [folder_of("important", 10), folder_of("a" * 64, 10, "thesis.pdf")]
    lock = Folder._take_lock(in_use)  # another worker serves that model
    with caplog.at_level(logging.INFO):
        folder = Folder(tmp_path, [model_dir], ["v"], 1_500_000, lambda: None)
        assert folder.opened().error is None
    folder.close(release_lock=True)
    os.close(lock)
    # 1.8 MB of other models' entries in a directory of 1.5 MB: the oldest went.
    assert [f.exists() for f in (old, newer, in_use, *foreign)] == [False] + [True] * 4
    assert "the entries of another model or KV format, last used" in caplog.text


def test_only_the_entries_another_format_made_are_counted_as_kept_apart(model_dir, tmp_path):
    # The folder this model's entries of another --kv-bits are in, as its worker
    # leaves it: its own entry, a file the user keeps there, and an entry another
    # model made, copied in (its worker would refuse it: not one of its entries).
    other = "b" * 64
    folder = tmp_path / other[:24]
    folder.mkdir()
    about = {"model": [str(model_dir)], "fingerprint": other}
    (folder / "model.json").write_text(json.dumps(about))
    header, arrays = kv_files.export(_caches(), tokens=5, trimmable=False)
    mx.eval(arrays)
    size = kv_files.write(folder / file_name(range(5)), other, header, range(5),
                          kv_files.buffers(arrays))  # fmt: skip
    kv_files.write(folder / file_name(range(6)), "c" * 64, replace(header, tokens=6), range(6),
                   kv_files.buffers(arrays))  # fmt: skip
    (folder / "notes.txt").write_text("mine")
    folder = Folder(tmp_path, [model_dir], ["v"], None, lambda: None)
    opened = folder.opened()
    folder.close(release_lock=True)
    assert opened.error is None and opened.apart == (1, size)


@pytest.mark.parametrize("asked", ["once", "twice"])
def test_the_writes_at_a_stop_fit_in_the_shutdown_grace(
    start_worker, model_dir, tmp_path, monkeypatch, asked
):
    # A disk that hangs: every write waits until the test ends. A stop still
    # ends within its grace (2 s); with 30 s, a second request ends the writes.
    stuck, write = threading.Event(), kv_files.write
    monkeypatch.setattr(kv_files, "write", lambda *args: stuck.wait(60) and write(*args))
    grace = 30.0 if asked == "twice" else 2.0
    w = start_worker(model_dir, prompt_cache_dir=tmp_path, shutdown_grace_seconds=grace)
    for key in (1, 2, 3):
        generate(w.stub, prompt(400, key), max_tokens=4)
    try:
        began = time.monotonic()
        w.loop.call_soon_threadsafe(w.worker.request_stop)
        stopping = asyncio.run_coroutine_threadsafe(w.worker.shutdown(), w.loop)
        if asked == "twice":
            time.sleep(ONE_STOP_SECONDS + 0.2)  # into the writes (a second signal)
            w.loop.call_soon_threadsafe(w.worker.request_stop)
        assert stopping.result(20) == 0
        assert time.monotonic() - began < 5.0
    finally:
        stuck.set()
        w.exit_code = 0
        w.loop.call_soon_threadsafe(w.loop.stop)
