"""The memory probe's findings, remembered across restarts (`engine.remembered`).

What a token costs in memory and time depends on the model's files, the
libraries, the device, the KV format and the prefill chunk the probe is cut
to, all of which the fingerprint covers: a restart of the same worker finds
them, and only another model, setting, library or device probes again. Not
with a model split over ranks: every rank takes part in the probe's passes,
so one rank that remembered and one that did not would wait for each other.
Deleting the folder (`memory-probe` in the prompt cache's) measures again.
"""

from __future__ import annotations

from dataclasses import asdict

from smg_mlx.config import EngineConfig
from smg_mlx.engine.memory.costs import MemoryModel, PrefillSpeed
from smg_mlx.engine.memory.probe import log_found
from smg_mlx.engine.remembered import Remembered, number, text
from smg_mlx.logs import error_line

FOLDER = "memory-probe"
# Changed whenever what the probe measures, or how, changes: older findings are not used.
FORMAT = "memory probe 5"


def remembered(config: EngineConfig, max_chunk: int, padded: bool) -> Remembered | None:
    """Where this worker's probe findings are kept (`padded`: prefill attention
    runs padded, as `engine.batch.attention_shapes` says; None: the model's
    files cannot be read to tell)."""
    settings = [
        f"prefill chunk {max_chunk}", f"attention {'padded' if padded else 'as is'}",
        f"kv {config.kv_format or 'as the model'}",
    ]  # fmt: skip
    return Remembered.on_this_machine(config, FOLDER, "memory probe", FORMAT, settings)


def recall(kept: Remembered) -> tuple[MemoryModel, PrefillSpeed] | None:
    """The findings kept, logged as the probe logs them (None: none)."""
    found = kept.read()
    if found is None:
        return None
    try:
        memory = MemoryModel(**_figures(found, "memory"))
        speed = PrefillSpeed(**_figures(found, "speed"))
        at, seconds = text(found["at"], "at"), number(found["seconds"], "seconds")
    except (KeyError, TypeError, ValueError) as exc:
        kept.ignore(error_line(exc))
        return None
    log_found(memory, speed, f"as measured on {at} in {seconds:.1f}s; remembered")
    return memory, speed


def _figures(found: dict, part: str) -> dict[str, float]:
    """The figures of `part` (a JSON object of numbers), each checked."""
    figures = found[part]
    if not isinstance(figures, dict):
        raise ValueError(f"{part} is not a JSON object")
    return {name: number(value, f"{part}.{name}") for name, value in figures.items()}


def keep(kept: Remembered, memory: MemoryModel, speed: PrefillSpeed, seconds: float) -> None:
    """Remember what the probe just found, in `seconds`."""
    found = {"memory": asdict(memory), "speed": asdict(speed), "seconds": round(seconds, 2)}
    kept.write(found, "its findings")
