"""Which batching mode the worker serves in, decided on the engine thread
before the warm-up, as `--batching` says:

- auto (the default): the mode this model's batch check (`engine.batch.batch_check`)
  found on this machine, remembered from an earlier start (`engine.verdicts`),
  or else the one it finds now, then remembered;
- check: the one the check finds now, whatever is remembered; remembered;
- batched, equal-lengths or one-at-a-time: that mode, with no check. A
  verdict remembered for the model still counts: a mode the check found to
  change this model's outputs is not served (the verdict's is, with a
  warning), since an operator who names a mode wants it faster, not wrong.
  Without one, batched and equal-lengths are served unchecked, with a
  warning; one-at-a-time is exact by construction. One short prompt still
  runs alone, so that a model mlx-lm cannot run at all is refused before
  SERVING, as the check would refuse it.

With the model split over ranks every rank takes part in the check's passes,
and each could remember another verdict: none is read or kept there, and the
check runs at every start (a named mode skips it on every rank alike).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from smg_mlx.config import EngineConfig
from smg_mlx.engine.batch.batch_check import VERSION, Choice, Mode, because, choose, runs_alone
from smg_mlx.engine.batch.verdicts import Verdict, Verdicts
from smg_mlx.engine.types import LayerCaches

log = logging.getLogger(__name__)

MODES = {mode.value for mode in Mode}
ORDER = list(Mode)  # from the most batched
UNCHECKED = (
    "not checked: --batching names it; --batching auto checks once per model and machine "
    "whether batching changes this model's outputs"
)


def decide(config: EngineConfig, model: nn.Module, stream: mx.Stream, prefill_rows: int,
           batch_size: int, split: bool, caches: LayerCaches | None = None) -> Choice:  # fmt: skip
    """The mode to serve in (see the module's doc); `split`: the model is split
    over ranks; `caches`: a row's fresh caches as served (--kv-bits; None: the
    model's own). Raises types.Unservable for a model that cannot run at all."""
    checks = config.batching in ("auto", "check")
    if split and checks:
        log.info("batch check: not remembered when the model is split over ranks (all take part)")
    verdicts = None if split else _verdicts(config, prefill_rows, batch_size)
    verdict = verdicts.read(MODES) if verdicts is not None and config.batching != "check" else None
    if not checks:
        return _named(Mode(config.batching), model, stream, verdict, caches)
    if verdict is not None:
        log.info(
            "batch check: remembered verdict %s from %s (it took %.1fs; --batching check "
            "checks again)", verdict.mode, verdict.at, verdict.seconds,
        )  # fmt: skip
        return _remembered(verdict)
    choice = choose(model, stream, prefill_rows, batch_size, caches)
    if verdicts is not None:
        verdicts.write(choice.mode.value, choice.reason, choice.seconds)
    return choice


def _verdicts(config: EngineConfig, prefill_rows: int, batch_size: int) -> Verdicts | None:
    """This model's remembered verdicts, checked with these batch sizes on this
    device (None: its files cannot be read to tell them)."""
    settings = [f"prefill rows {prefill_rows}", f"batch size {batch_size}"]
    if config.kv_format is not None:  # the quantized attention is checked on its own
        settings.append(config.kv_format)
    return Verdicts.on_this_machine(config, VERSION, settings)


def _remembered(verdict: Verdict) -> Choice:
    mode = Mode(verdict.mode)
    return Choice(mode, verdict.reason, verdict.seconds, f"as checked on {verdict.at}")


def _named(asked: Mode, model: nn.Module, stream: mx.Stream, verdict: Verdict | None,
           caches: LayerCaches | None) -> Choice:  # fmt: skip
    """The mode --batching names, unless the verdict remembered found it wrong."""
    log.info("batch check: skipped, --batching names %s", asked.value)
    if verdict is None:
        runs_alone(model, stream, caches)
        exact = asked is Mode.ONE_AT_A_TIME
        basis = "no check needed: one at a time is exact" if exact else UNCHECKED
        return Choice(asked, _asked_for(asked), 0.0, basis, exact)
    found = _remembered(verdict)
    if ORDER.index(found.mode) > ORDER.index(asked):
        reason = f"{found.reason}; not {asked.value} as --batching asks, which would change outputs"
        return Choice(found.mode, reason, found.seconds, found.basis)
    basis = found.basis if found.mode is asked else f"{found.basis}, which found {found.mode.value}"
    return Choice(asked, _asked_for(asked), 0.0, basis)


def _asked_for(mode: Mode) -> str:
    """The reason for a mode --batching names (none for batched: no slower)."""
    return "" if mode is Mode.BATCHED else because(mode, ["--batching asks for it"])
