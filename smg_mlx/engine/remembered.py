"""What start-up found out about a model on this machine, remembered across restarts.

Start-up measures things that depend only on the model's files, the
libraries and the device (whether batching changes outputs, what a token
costs in memory and time), and on a slow device they are most of a start. So
each is kept in a small JSON file in a folder of its own inside the prompt
cache's folder (`--prompt-cache-dir`, which a deployment keeps on a lasting
volume; else the user's cache folder), named by a fingerprint as the prompt
cache's files are (`engine.prefix_cache.fingerprint`): the model's files and
an adapter's, the versions of mlx and mlx-lm, the device, and what each
finding lists of its own (its format, the settings it depends on). Another
model, library or device finds nothing and measures again. A file is
written whole under another name and renamed into place, never through a
link (`engine.prefix_cache.safe_files`); one that cannot be read or says
something else is ignored with one log line, and what it held is measured
again and replaces it.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm

from smg_mlx.config import EngineConfig, cache_home
from smg_mlx.engine.prefix_cache import safe_files
from smg_mlx.engine.prefix_cache.fingerprint import fingerprint
from smg_mlx.logs import error_line

log = logging.getLogger(__name__)

_UNWRITABLE: set[Path] = set()  # folders a write to has failed in, already warned of

MOST_BYTES = 64 << 10  # what is remembered is a few hundred bytes: a larger file is not it


def number(value: Any, name: str) -> float:
    """A remembered figure, checked: a finite number, 0 or more (a file edited
    or damaged by hand must not reach the planner as text or a negative size)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} is {value!r}, not a number")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} is {value!r}, not a finite number of 0 or more")
    return value


def text(value: Any, name: str) -> str:
    """A remembered piece of text, checked (as `number` checks a figure)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} is {value!r}, not text")
    return value


class Remembered:
    """One finding (`what`, as logs name it) about one model on one machine,
    kept in the folder `folder_name` of the prompt cache's folder."""

    def __init__(
        self, config: EngineConfig, folder_name: str, what: str, versions: list[str]
    ) -> None:
        """Raises OSError where the model's files cannot be read to tell it."""
        directories = [config.model_path]
        if config.adapter_path is not None:
            directories.append(config.adapter_path)
        self.what = what
        self.key = fingerprint(directories, versions)
        folder = (config.prompt_cache_dir or cache_home()) / folder_name
        self.path = folder / f"{self.key[:32]}.json"
        self._about = {"model": [str(d) for d in directories], "versions": versions}

    @classmethod
    def on_this_machine(
        cls, config: EngineConfig, folder_name: str, what: str, kind: str, settings: list[str]
    ) -> Remembered | None:
        """The finding `kind` (its format's name) of `config`'s model made with
        `settings` by these libraries on this device; None, said once, where the
        model's files cannot be read to tell it."""
        device = mx.device_info()
        versions = [
            kind, f"mlx {mx.__version__}", f"mlx-lm {mlx_lm.__version__}", str(mx.default_device()),
            str(device.get("device_name")), str(device.get("architecture")), *settings,
        ]  # fmt: skip
        try:
            return cls(config, folder_name, what, versions)
        except OSError as exc:
            log.warning("%s: not remembered across restarts (%s)", what, error_line(exc))
            return None

    def read(self) -> dict[str, Any] | None:
        """What was remembered, with `at` (when), if anything was."""
        try:
            with safe_files.open_file(self.path) as f:
                data = f.read(MOST_BYTES + 1)
            if len(data) > MOST_BYTES:
                raise ValueError(f"over {MOST_BYTES} bytes")
            found = json.loads(data)
            if not isinstance(found, dict):
                raise ValueError("not a JSON object")
            if found.get("fingerprint") != self.key:
                raise ValueError("it is another model's")
            return found
        except (FileNotFoundError, NotADirectoryError):  # nothing remembered there
            return None
        except (OSError, ValueError) as exc:
            self.ignore(error_line(exc))
            return None

    def ignore(self, why: str) -> None:
        """What was read is not to be trusted (`why`): it is measured again."""
        log.warning("%s: ignoring what %s remembered (%s); measuring again",
                    self.what, self.path, why)  # fmt: skip

    def write(self, found: dict[str, Any], summary: str) -> None:
        """Remember `found` (JSON values), from now (`summary`: what it is, for the
        log); a folder that cannot hold it is said."""
        at = datetime.now().astimezone().isoformat(timespec="seconds")
        text = json.dumps({"fingerprint": self.key, **found, "at": at, **self._about}, indent=1)
        try:
            safe_files.make_folder(self.path.parent)
            safe_files.write_whole(self.path, text.encode())
        except OSError as exc:  # safe_files.Unsafe is one
            # One warning a folder: what else cannot be remembered there is no news.
            root = self.path.parent.parent
            say = log.info if root in _UNWRITABLE else log.warning
            _UNWRITABLE.add(root)
            say("%s: cannot remember it in %s (%s); it runs again at the next start",
                self.what, self.path, error_line(exc))  # fmt: skip
        else:
            log.info("%s: %s remembered in %s", self.what, summary, self.path)
