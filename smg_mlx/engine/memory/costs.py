"""What a model costs on this device, as the start-up probe measures it
(`engine.memory.probe`): in bytes, what the budget plans with
(`engine.memory.planner`); in seconds, what the step clock starts from
(`engine.schedule.step_clock`). Plain values, no MLX.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryModel:
    """What one model costs, measured at warm-up (bytes)."""

    weights: int  # the model's parameters
    kv_per_token: float  # one sequence's KV cache, per token
    prefill_per_token: float  # prefill working set per chunk token...
    prefill_per_context: float  # ...plus this for each token it attends to
    prefill_row_per_key: float = 0.0  # and a prompt's copies of the keys it attends to, per key
    row_bytes: float = 0.0  # a running row's, whatever its length (--kv-bits' 16-bit tail)
    # A draft model's prefill working set as a share of this one's (its catch-up
    # passes, engine.speculative.draft_model); 0: no draft.
    draft_width: float = 0.0


@dataclass(frozen=True)
class PrefillSpeed:
    """What prefilling costs on this device, measured at start-up (seconds)."""

    per_token: float  # per prompt token
    per_context: float  # more per prompt token, per token of context it attends to
