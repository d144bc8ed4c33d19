"""The batch check's verdicts, remembered across restarts, so that the check
(`engine.batch.batch_check`), most of a cold start on a slow device, runs once per
model and machine.

A verdict is kept in a small JSON file, in the folder `batch-check` inside
the prompt cache's folder (`--prompt-cache-dir`, which a deployment keeps on
a lasting volume; else the user's cache folder), named by a fingerprint as
the prompt cache's files are (`engine.prefix_cache.fingerprint`): the model's files and
an adapter's, the versions of mlx, mlx-lm and the check, the device, and the
batch sizes the check ran with. Another model, a new library or a new
device is checked again. The file is written whole under another name and
renamed into place, never through a link (`engine.safe_files`). One that
cannot be read or says something else is ignored with one log line, and
the check runs again and replaces it. No MLX here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from smg_mlx.config import EngineConfig, cache_home
from smg_mlx.engine.prefix_cache import safe_files
from smg_mlx.engine.prefix_cache.fingerprint import fingerprint
from smg_mlx.logs import error_line

log = logging.getLogger(__name__)

FOLDER = "batch-check"
MOST_BYTES = 64 << 10  # a verdict is a few hundred bytes: a larger file is not one


@dataclass(frozen=True)
class Verdict:
    mode: str  # a batch_check.Mode's value
    reason: str  # the Choice's
    seconds: float  # what the check took
    at: str  # when it ran (ISO 8601)


def folder(config: EngineConfig) -> Path:
    """Where `config`'s verdicts are kept."""
    return (config.prompt_cache_dir or cache_home()) / FOLDER


class Verdicts:
    """The remembered verdict of one model checked one way on one machine."""

    def __init__(self, config: EngineConfig, versions: list[str]) -> None:
        directories = [config.model_path]
        if config.adapter_path is not None:
            directories.append(config.adapter_path)
        self.key = fingerprint(directories, versions)
        self.path = folder(config) / f"{self.key[:32]}.json"
        self._about = {"model": [str(d) for d in directories], "versions": versions}

    def read(self, modes: set[str]) -> Verdict | None:
        """The verdict remembered, if there is one whose mode is among `modes`."""
        try:
            with safe_files.open_file(self.path) as f:
                data = f.read(MOST_BYTES + 1)
            if len(data) > MOST_BYTES:
                raise ValueError(f"over {MOST_BYTES} bytes")
            found = json.loads(data)
            if found.get("fingerprint") != self.key:
                raise ValueError("it is another model's")
            verdict = Verdict(**{k: found[k] for k in Verdict.__dataclass_fields__})
            if verdict.mode not in modes:
                raise ValueError(f"no such mode: {verdict.mode!r}")
            return verdict
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning(
                "batch check: ignoring the remembered verdict %s (%s); checking again",
                self.path, error_line(exc),
            )  # fmt: skip
            return None

    def write(self, mode: str, reason: str, seconds: float) -> None:
        """Remember this verdict, from now; a folder that cannot hold it is said once."""
        now = datetime.now().astimezone().isoformat(timespec="seconds")
        verdict = Verdict(mode, reason, round(seconds, 2), now)
        text = json.dumps({"fingerprint": self.key, **asdict(verdict), **self._about}, indent=1)
        try:
            safe_files.make_folder(self.path.parent)
            safe_files.write_whole(self.path, text.encode())
        except OSError as exc:  # safe_files.Unsafe is one
            log.warning(
                "batch check: cannot remember its verdict in %s (%s); it runs again at the "
                "next start", self.path, error_line(exc),
            )  # fmt: skip
        else:
            log.info("batch check: verdict %s remembered in %s", mode, self.path)
