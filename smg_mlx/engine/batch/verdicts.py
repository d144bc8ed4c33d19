"""The batch check's verdicts, remembered across restarts (`engine.remembered`),
so that the check (`engine.batch.batch_check`), most of a cold start on a slow
device, runs once per model and machine. The fingerprint covers the batch
sizes the check ran with (and --kv-bits) besides the model, libraries and device.
"""

from __future__ import annotations

from dataclasses import dataclass

from smg_mlx.config import EngineConfig
from smg_mlx.engine.remembered import Remembered, number, text

FOLDER = "batch-check"


@dataclass(frozen=True)
class Verdict:
    mode: str  # a batch_check.Mode's value
    reason: str  # the Choice's
    seconds: float  # what the check took
    at: str  # when it ran (ISO 8601)


class Verdicts:
    """The remembered verdict of one model checked one way on one machine."""

    def __init__(self, kept: Remembered) -> None:
        self._kept = kept
        self.path = kept.path

    @classmethod
    def on_this_machine(
        cls, config: EngineConfig, kind: str, settings: list[str]
    ) -> Verdicts | None:
        """The verdict of check `kind` with `settings` (see `Remembered.on_this_machine`)."""
        kept = Remembered.on_this_machine(config, FOLDER, "batch check", kind, settings)
        return cls(kept) if kept is not None else None

    def read(self, modes: set[str]) -> Verdict | None:
        """The verdict remembered, if there is one whose mode is among `modes`."""
        found = self._kept.read()
        if found is None:
            return None
        try:
            verdict = Verdict(**{k: found[k] for k in Verdict.__dataclass_fields__})
            for name in ("mode", "reason", "at"):
                text(getattr(verdict, name), name)
            number(verdict.seconds, "seconds")
        except KeyError as missing:
            self._kept.ignore(f"no {missing}")
            return None
        except ValueError as exc:
            self._kept.ignore(str(exc))
            return None
        if verdict.mode not in modes:
            self._kept.ignore(f"no such mode: {verdict.mode!r}")
            return None
        return verdict

    def write(self, mode: str, reason: str, seconds: float) -> None:
        """Remember this verdict, from now."""
        found = {"mode": mode, "reason": reason, "seconds": round(seconds, 2)}
        self._kept.write(found, f"verdict {mode}")
