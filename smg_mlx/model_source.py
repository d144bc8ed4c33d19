"""What `--model` names: a local model directory, or a Hugging Face repo id; or
the demo model (`--demo`).

A repo id (at a revision, if one is named) is served from the local Hugging
Face cache when its snapshot is there, and downloaded into that cache
otherwise (unless HF_HUB_OFFLINE is set). What is written as a path (it
starts with `/`, `./`, `../` or `~`) is never taken for a repo id.
The worker finds its model after it starts listening (a download or the demo
build can take a while), so none of this imports MLX.
"""

from __future__ import annotations

import errno
import io
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from smg_mlx.demo_model import default_demo_dir, ensure_demo_model
from smg_mlx.logs import one_line
from smg_mlx.model_files import WEIGHTS, missing_shards

log = logging.getLogger(__name__)

# owner/name, as the Hub spells repo ids; a bare name is taken for a mistyped path.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
PATH_STARTS = ("/", "./", "../", "~")
# What mlx-lm loads and the tokenizer reads; not other formats' weights or the README.
MODEL_FILES = ["*.json", "model*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
EXAMPLE = "mlx-community/Qwen3-0.6B-4bit"
TO_PASS = f"an mlx-lm model directory or a Hugging Face repo id such as {EXAMPLE}"
PROGRESS_SECONDS = 10.0
# The demo model's name for the router: its directory's name carries the version.
DEMO_NAME = "smg-mlx-demo"


class ModelUnavailable(Exception):
    """No model to serve; the message says why, `exit_code` is the worker's."""

    exit_code = 1  # a restart may cure it


class ModelNotFound(ModelUnavailable, ValueError):
    """`--model` names nothing servable; the message says what to pass instead."""

    exit_code = 2  # the flag is to be fixed


# Errors of writing the cache, which no retry of the network cures.
CACHE_FAULTS = {errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EROFS, errno.ENOSPC}


class DownloadFailed(ModelUnavailable):
    """The Hub could not be reached or refused the download; the message says why."""


@dataclass(frozen=True)
class ModelSource:
    path: Path  # a directory with config.json
    served_name: str | None  # None: the directory's name


def looks_like_a_path(model: str) -> bool:
    """Whether `model` is written as a path: then it is never a repo id."""
    return model.startswith(PATH_STARTS) or model in (".", "..")


def locate(model: Path, demo: bool, revision: str | None = None) -> ModelSource:
    """The model to serve: the demo model (built on first use), or what `model`
    names (at `revision`, for a repo id). Raises ModelUnavailable, naming
    --model where it was given."""
    if not demo:
        try:
            return resolve(str(model), revision)
        except ModelUnavailable as exc:
            exc.args = (f"--model: {exc.args[0]}", *exc.args[1:])
            raise
    try:
        return ModelSource(ensure_demo_model(), DEMO_NAME)
    except RuntimeError as exc:  # the build's child process failed
        raise ModelUnavailable(str(exc)) from None
    except OSError as exc:  # its folder cannot be made
        raise ModelNotFound(
            f"--demo: cannot build the demo model in {default_demo_dir()}: "
            f"{exc.strerror or exc} ({exc.filename}): set XDG_CACHE_HOME to a directory "
            "this user can write"
        ) from None


def resolve(model: str, revision: str | None = None) -> ModelSource:
    """The model directory `model` names; a local path that exists always wins."""
    local = Path(model).expanduser()
    if local.exists() or looks_like_a_path(model):
        if not local.exists():
            raise ModelNotFound(f"{model} is not a model directory (no such path)")
        if local.is_file():  # config.json, say: its directory was meant
            parent = local.absolute().parent
            hint = f"its directory, {parent}" if (parent / "config.json").is_file() else TO_PASS
            raise ModelNotFound(f"{model} is a file, not a model directory: pass {hint}")
        if not (local / "config.json").is_file():
            raise ModelNotFound(
                f"{model} is not a model directory (no config.json); pass {TO_PASS}"
            )
        if revision is not None:
            raise ModelNotFound(
                f"{model} is a local directory: --revision names a version of a Hugging Face "
                "repo id only; leave it out"
            )
        # absolute: logs and GetServerInfo then name it whatever the cwd was
        return ModelSource(local.absolute(), None)
    if not REPO_ID.fullmatch(model):
        raise ModelNotFound(
            f"{model} is not a model directory (no such path), nor a Hugging Face repo id "
            f"(owner/name, such as {EXAMPLE})"
        )
    try:
        snapshot = _snapshot(model, revision)
    except ModelUnavailable as exc:
        # owner/name is also how a relative path without its "./" reads
        exc.args = (f"{exc.args[0]} (nor is there a local directory {model}: a path is "
                    f"written ./{model})",)  # fmt: skip
        raise
    if not (snapshot / "config.json").is_file():
        raise ModelNotFound(f"{model} has no config.json: it is not an mlx-lm model")
    log.info("%s is in %s", model, snapshot)
    return ModelSource(snapshot, model.split("/")[1])


def _missing_weights(snapshot: Path) -> str | None:
    """What a cached snapshot lacks of its weights (None: nothing): its weight
    files, or those of its shards' index it does not hold."""
    absent, listed = missing_shards(snapshot)
    if absent:
        return f"{len(absent)} of its {listed} weight files, {absent[0]} first"
    return None if any(snapshot.glob(WEIGHTS)) else f"its weights ({WEIGHTS})"


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot of `repo_id` at `revision` (None: its main branch),
    downloaded first when the cache lacks it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    get = {"repo_id": repo_id, "revision": revision, "allow_patterns": MODEL_FILES}
    cached = None
    try:
        cached = Path(snapshot_download(**get, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached, or only partly
    # A snapshot that another tool fetched a file or two of (the tokenizer's,
    # say) passes for a whole one where the cache holds no listing of it.
    missing = None if cached is None else _missing_weights(cached)
    if cached is not None and missing is None:
        return cached
    cache = constants.HF_HUB_CACHE
    at = "" if revision is None else f" --revision {revision}"
    named = repo_id if revision is None else f"{repo_id} at revision {revision}"
    if constants.HF_HUB_OFFLINE:
        where = (
            f"is not in the Hugging Face cache ({cache})"
            if missing is None
            else f"is only partly in the Hugging Face cache ({cache}: {missing} missing)"
        )
        raise ModelNotFound(
            f"{named} {where} and HF_HUB_OFFLINE is set: "
            f"download it with `hf download {repo_id}{at}` where the Hub can be reached (same "
            "HF_HOME), unset HF_HUB_OFFLINE, or pass a local model directory"
        )
    log.info("downloading %s from the Hugging Face Hub into %s", named, cache)
    # The Hub's HTTP client logs every request at INFO; the progress lines say enough.
    for client in ("httpx", "httpx2"):
        logging.getLogger(client).setLevel(logging.WARNING)
    started = time.monotonic()
    try:
        path = _on_daemon_thread(snapshot_download, **get, tqdm_class=_LoggedProgress)
    except RevisionNotFoundError:
        raise ModelNotFound(
            f"{repo_id} has no revision {revision!r} on the Hub: name a branch, tag or commit "
            "it has"
        ) from None
    except GatedRepoError:
        raise ModelNotFound(
            f"{repo_id} is gated: accept its terms on its Hub page and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"{repo_id} is not on the Hugging Face Hub, or it is private: check the id, "
            "or set HF_TOKEN to a token that may read it"
        ) from None
    except OSError as exc:  # the Hub's HTTP errors and connection failures are OSErrors
        if exc.errno in CACHE_FAULTS and exc.filename is not None:
            # This machine's cache, not the network (HF_HOME a file, read-only, full).
            fault = ModelNotFound if exc.errno != errno.ENOSPC else DownloadFailed
            raise fault(
                f"cannot download {named} into the Hugging Face cache ({cache}): "
                f"{exc.strerror} ({exc.filename}): point HF_HOME at a directory this user "
                "can write, with room for the model"
            ) from None
        raise DownloadFailed(
            f"cannot download {named} from {constants.ENDPOINT} ({one_line(exc)}): check the "
            f"network and any HTTPS_PROXY, or download it with `hf download {repo_id}{at}` where "
            "the Hub can be reached (same HF_HOME) and start the worker again"
        ) from None
    log.info("downloaded %s in %.0fs", named, time.monotonic() - started)
    return Path(path)


def _on_daemon_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, called on a daemon thread. The main thread waits
    in join(), which a signal interrupts: the process can then exit at once, where
    waiting in the download itself would first join its worker threads."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=call, name="model-download", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _LoggedProgress(tqdm):
    """The Hub's progress bars (files, bytes) as log lines: the first update, then
    one line every PROGRESS_SECONDS across all bars; the end is logged by `_snapshot`."""

    logged_at = -math.inf  # shared by the bars of the one download a process makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # the Hub's own bar class takes a name; tqdm does not
        kwargs["file"] = io.StringIO()  # never drawn: display() logs instead
        # Every update reaches display(), which spaces the lines itself: tqdm's own
        # spacing skips updates that come close together (the first files of a
        # download), and then nothing is logged until the next, maybe never.
        kwargs.update(mininterval=0, miniters=1)
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        now = time.monotonic()
        closing = self.disable  # close() disables a bar, then shows it a last time
        if closing or not (self.total and self.n) or now - self.logged_at < PROGRESS_SECONDS:
            return True
        _LoggedProgress.logged_at = now
        if self.unit == "B":
            done = f"{self.format_sizeof(self.n, 'B')} of {self.format_sizeof(self.total, 'B')}"
        else:  # the bar that counts files
            done = f"{self.n:.0f} of {self.total:.0f} files"
        log.info("download progress: %s (%.0f%%)", done, 100 * self.n / self.total)
        return True
