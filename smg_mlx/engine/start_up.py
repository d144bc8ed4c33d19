"""The engine's parts made and checked on the thread that will own MLX, before
its loop turns: the batch (the model loaded, measured, warmed up), the mode it
serves in, the memory budget and its planner, the scheduler, and the prompt
cache's tiers.

It imports MLX only inside `start`, on that thread: `engine.core` imports it
on the asyncio side.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import astuple
from typing import TYPE_CHECKING, NamedTuple

from smg_mlx.config import EngineConfig
from smg_mlx.engine.memory.costs import MemoryModel
from smg_mlx.engine.memory.planner import MemoryPlanner
from smg_mlx.engine.schedule.scheduler import Scheduler
from smg_mlx.engine.types import Unservable
from smg_mlx.logs import format_bytes

if TYPE_CHECKING:
    from smg_mlx.engine.batch.batch import Batch
    from smg_mlx.engine.ranks.lockstep import Channel

log = logging.getLogger(__name__)


class Started(NamedTuple):
    """What the engine loop runs: the batch, the policy, and with several ranks
    the channel between them (None: one rank)."""

    batch: Batch
    scheduler: Scheduler
    channel: Channel | None


def import_mlx() -> None:
    """Import what `start` needs (MLX, mlx-lm, and transformers with it: seconds),
    on the thread that will own MLX, before the model to load is known."""
    from smg_mlx.engine.batch import batch, loading  # noqa: F401


def start(config: EngineConfig, wake: Callable[[], None]) -> Started:
    """Load, check and warm up the model, and set up what decides each step
    (`wake`: called from the disk tier's threads when they finish work for
    the engine thread). A batch loaded and then refused (the budget, the
    ranks) is released before the error goes on."""
    from smg_mlx.engine.batch import warm_up
    from smg_mlx.engine.batch.batch import Batch
    from smg_mlx.engine.batch.batch_check import Mode
    from smg_mlx.engine.memory import probe as memory_probe
    from smg_mlx.engine.prefix_cache.cache import open_disk_tier
    from smg_mlx.engine.ranks import lockstep

    batch = None
    try:
        group = lockstep.group()
        batch = Batch(config, group)
        channel = lockstep.Channel(group, batch.stream) if group is not None else None
        _choose_mode(batch, channel)
        # Its folder opens (and is indexed) while the warm-up runs.
        disk = open_disk_tier(config, wake) if group is None else None
        warm_up.run(batch, thorough=batch.shape_builds)
        if channel is not None:  # every rank builds its shapes now: only rank 0 idles
            batch.build_shapes(math.inf)
        budget, source = memory_probe.budget(
            config.memory_budget_bytes, config.memory_budget_share
        )
        planner = _planner(batch.memory, budget, channel, batch.prefill_rows, batch.max_chunk)
        _check_budget(planner, source, drafted=batch.speculation.drafter == "draft_model")
        batch.bound_buffer_cache(planner)
        if channel is not None:
            lockstep.same_random_state(channel)
        scheduler = Scheduler(
            planner,
            batch.speed,
            batch_size=batch.batch_size,
            prefill_rows=batch.prefill_rows,
            step_seconds=config.step_budget_seconds,
            builds=batch.attention.builds if batch.attention is not None else None,
            attended=batch.attention.attended if batch.attention is not None else None,
            prefixes=batch.prefixes,
            equal_lengths=batch.mode is Mode.EQUAL_LENGTHS,
        )
        if disk is not None:
            batch.prefixes.attach(disk, scheduler.steps.prefill_seconds)
        elif batch.prefixes is None:
            log.info("the prompt cache is off (--prompt-cache-bytes 0)")
        elif group is not None and config.prompt_cache_dir is not None:
            log.info("the prompt cache's disk tier is off: the model is split over ranks")
        elif config.prompt_cache_disk_bytes == 0:
            log.info("the prompt cache's disk tier is off (--prompt-cache-disk-bytes 0)")
        if batch.prefixes is not None:
            batch.prefixes.room = planner.prefix_allowance([])
            batch.prefixes.reset_counts()
            _log_prompt_cache(batch.prefixes.room, config.prompt_cache_bytes)
    except BaseException:
        if batch is not None:
            batch.close()
        raise
    return Started(batch, scheduler, channel)


def _choose_mode(batch: Batch, channel: Channel | None) -> None:
    """Serve in the mode the batch chose (`engine.batch.batch_mode`); with several
    ranks, rank 0's (every rank ran the check: the model's collectives
    need them all)."""
    choice = batch.choice
    if channel is not None:
        choice = channel.share(choice if channel.rank == 0 else None)
        batch.serve_as(choice.mode)
    if choice.reason:
        log.warning(
            "serving %s, which is slower than batched: %s (%s)",
            choice.mode.value, choice.reason, choice.basis,
        )  # fmt: skip
    elif choice.checked:
        log.info("serving batched: batching changes no output (%s)", choice.basis)
    else:
        log.warning("serving batched as --batching asks (%s)", choice.basis)


def _planner(
    model: MemoryModel, budget: int, channel: Channel | None, prefill_rows: int, max_chunk: int
) -> MemoryPlanner:
    """The budget planner; with several ranks, for the most constrained of them."""
    if channel is not None:
        models, budgets = zip(*channel.gather((model, budget)), strict=True)
        each = [astuple(m) for m in models]
        model = MemoryModel(*(max(values) for values in zip(*each, strict=True)))
        budget = min(budgets)
    return MemoryPlanner(
        model,
        budget,
        max_chunk=max_chunk,
        prefill_rows=prefill_rows,
    )


def _log_prompt_cache(room: int, cap: int | None) -> None:
    """What bounds the prompt cache in memory: --prompt-cache-bytes, or what
    the memory budget leaves it (`room`) where that is less."""
    if cap is not None and cap <= room:
        log.info("prompt cache in memory: up to %s (--prompt-cache-bytes)", format_bytes(cap))
        return
    given = "" if cap is None else f"; --prompt-cache-bytes {format_bytes(cap)}"
    log.info(
        "prompt cache in memory: up to %s, what the memory budget leaves it with nothing "
        "running (it gives way to requests%s)", format_bytes(room), given,
    )  # fmt: skip


def _check_budget(planner: MemoryPlanner, source: str, drafted: bool) -> None:
    """Refuse a budget that holds no request; log what it holds (`drafted`: a
    draft model's weights are counted with the model's)."""
    weights = "model and its draft" if drafted else "model"
    if planner.longest_sequence < 2:
        # A flag's value, which no restart cures: refused as a bad flag is (exit 2).
        raise Unservable(
            f"the memory budget ({format_bytes(planner.budget)}) does not hold the "
            f"{weights} ({format_bytes(planner.model.weights)}) and one short request: raise "
            "--memory-budget"
        )
    # What one request may have is the worker's to say: it knows the context too.
    log.info(
        "memory budget %s (%s): the %s take%s %s", format_bytes(planner.budget), source,
        weights, "" if drafted else "s", format_bytes(planner.model.weights),
    )  # fmt: skip
