"""The values that travel between the front door and the engine: plain, immutable data.

No MLX and no asyncio here: a request goes in as a `Request` (its
`GenerationSpec`), and comes back as `Event`s inside `StepReport`s.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

# What makes a sequence's fresh KV caches, one per layer (--kv-bits: quantized ones).
LayerCaches = Callable[[], list]


@dataclass(frozen=True)
class SamplingSettings:
    """How the next token is chosen. Hashable: equal settings share one sampler."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class LogitsSettings:
    """Penalties and biases applied to the logits before sampling; hashable."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        return self != LogitsSettings()


@dataclass(frozen=True)
class GenerationSpec:
    """Everything the engine needs to run one request, already validated."""

    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: frozenset[int]
    sampling: SamplingSettings
    logits: LogitsSettings
    logprobs: int | None  # None: none asked; 0: the chosen token's only


@dataclass(frozen=True, slots=True)
class Request:
    """One request handed to the engine. `key` names it in every later event and abort."""

    key: int
    spec: GenerationSpec
    request_id: str = ""  # the client's id, for the engine's logs only


class Unservable(Exception):
    """The model cannot be served by this worker, however often it is restarted
    (the message says why): a refusal at start-up, not a crash."""


class Failure(enum.Enum):
    """Why a request ended with an error."""

    REQUEST = "request"  # it could not be set up (its sampling settings)
    TOO_BIG = "too_big"  # it can never fit in this worker's memory
    OUT_OF_MEMORY = "out_of_memory"  # memory ran out while it ran
    STEP = "step"  # a step it was in failed
    STOPPING = "stopping"  # the worker stopped before it had a token (another may serve it)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the top alternatives at one step."""

    logprob: float
    top_ids: tuple[int, ...]
    top_values: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Event:
    """What the engine did for one request: a new token, its end, or both."""

    key: int
    token: int | None = None  # None for aborts and requests that could not start
    finish_reason: str | None = None  # "stop", "length", "abort"
    error: str | None = None  # the request could not run; it has ended
    failure: Failure = Failure.REQUEST  # why, with an error
    logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    first: bool = False  # the request's first token

    @property
    def ends(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(frozen=True, slots=True)
class Memory:
    """Where the memory budget stands (bytes, or tokens where named)."""

    budget: int
    weights: int
    kv: int  # KV caches of the batch now
    kv_per_token: float  # what a token's keys and values take as stored (--kv-bits)
    prefill: int  # the last prefill step's working set (estimated)
    prefix_cache: int
    active: int  # all MLX allocations now
    peak: int  # the most MLX has had allocated since the engine started serving
    longest_sequence: int  # tokens (prompt plus output) one request may have
    waiting_for_memory: int  # requests
    out_of_memory_steps: int  # steps that ran out of memory since start (contained)
    failed_steps: int = 0  # steps that failed otherwise since start (their requests ended)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The prefix cache's tiers: what they hold now, and what they did since start."""

    memory_bytes: int = 0
    memory_entries: int = 0
    disk_bytes: int = 0
    disk_entries: int = 0
    memory_tokens: int = 0  # prompt tokens served from memory
    disk_tokens: int = 0  # prompt tokens served from entries read back from disk
    memory_evicted: int = 0  # entries dropped from memory for room
    disk_evicted: int = 0  # files deleted for room on disk
    written: int = 0  # entries written to disk
    written_bytes: int = 0
    loaded: int = 0  # entries read back from disk
    loaded_bytes: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    corrupt: int = 0  # files that failed their checks, ignored and deleted


@dataclass(frozen=True)
class SpeculationStats:
    """What speculative decoding has done since start (engine.speculative)."""

    proposed: int = 0  # tokens proposed and checked
    accepted: int = 0  # of those, tokens kept
    passes: int = 0  # passes that checked proposals
    tokens: int = 0  # tokens those passes returned
    # What proposes: prompt_lookup or draft_model ("": none, speculation is off,
    # or the engine has not said yet).
    drafter: str = ""


@dataclass(frozen=True, slots=True)
class StepReport:
    """One turn of the engine loop: the events it produced and the batch after it."""

    events: tuple[Event, ...]
    step_seconds: float | None  # None when no model step ran (aborts only)
    batch_size: int  # sequences the step ran on, those that finished in it included
    running: int  # sequences being prefilled or decoded after the step
    prefilling: int  # of those, sequences whose prompt is not all processed yet
    waiting: int  # requests not started yet
    admitted: tuple[int, ...]  # keys of the requests that joined the batch this turn
    memory: Memory
    idle: bool  # nothing left to run: the engine sleeps until new work comes
    cache: CacheStats = CacheStats()
    speculation: SpeculationStats = SpeculationStats()


@dataclass(frozen=True, slots=True)
class Turn:
    """What changes the batch in one turn of the engine loop, decided by rank 0
    (the only rank, unless the model is split over several) and applied by all."""

    size: int  # requests in the batch before the turn (a check that ranks agree)
    remove: tuple[int, ...] = ()  # keys that leave the batch (aborted)
    drop_cached: tuple[int, ...] = ()  # prompt-cache entries dropped for memory
    admit: tuple[Request, ...] = ()  # requests that join the batch, in order
    long: tuple[int, ...] = ()  # keys of those that join the long prompts' lane
    chunk: int | None = None  # the short lane's prefill chunk this step; None: no step
    long_chunks: tuple[int, ...] = ()  # the long lane's chunks this step, a call each
    expected_seconds: float = 0.0  # how long its step may take (the watchdog's measure)
    stop: bool = False
    move: tuple[int, ...] = ()  # keys of decoding requests that move to the long prompts' lane
    # prompt-cache entries dropped once the requests admitted have copied them
    release: tuple[int, ...] = ()
    spare_bytes: float = math.inf  # memory the step's plan leaves free (a draft's catch-up)
    # Rank 0 waits for work after it: the other ranks sleep this many seconds
    # (lockstep.pause) rather than wait for its next turn in a collective.
    pause: float = 0.0
