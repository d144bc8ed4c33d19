"""Settings of one worker process, and the one home of their defaults.

The command line's flags (`serve_flags.py`) take their defaults from these classes, and the
flag table in docs/configuration.md is checked against `--help` by the tests.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# --batching: "auto" (the mode the start-up check finds exact, remembered per
# model and machine), "check" (check again), or a mode by name, unchecked; the
# modes from the most batched, as engine.batch.batch_check's are (engine.batch.batch_mode).
BATCHING = ("auto", "check", "batched", "equal-lengths", "one-at-a-time")
# --speculative: proposals checked where it pays, wherever there are some, or never.
SPECULATIVE = ("auto", "always", "off")
# --num-draft-tokens at most: a checking pass of 1 + this many tokens a row still
# attends as a decoding pass does (engine.batch.attention_shapes.FEW_QUERIES).
MOST_DRAFT_TOKENS = 15
# --num-draft-tokens' default by drafter. Prompt lookup's proposals cost nothing
# to make, and at a few streams the widest checking pass costs about what a
# narrower one does (pacing narrows it where it does not); each of a draft
# model's proposals costs a pass of the draft.
LOOKUP_DRAFT_TOKENS, DRAFT_MODEL_TOKENS = MOST_DRAFT_TOKENS, 8
# KV caches stored as the model computes them, as headers and metrics name it.
UNQUANTIZED = "unquantized"
# --kv-bits and --kv-group-size: what mx.quantize takes (engine.batch.kv_format);
# the bits in the order --kv-bits' usage and refusal give them.
KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)

# Without --prompt-cache-disk-bytes the disk tier takes this share of the free
# space found at start-up (its own files counted as free), at most DISK_CACHE_MOST.
DISK_CACHE_SHARE = 0.25
DISK_CACHE_MOST = 100 << 30
# A smaller --prompt-cache-disk-bytes (but 0) is refused: a model's KV cache takes
# tens of KiB or more a token, so its disk tier would hold next to no prompt.
DISK_CACHE_LEAST = 1 << 20


def cache_home() -> Path:
    """The worker's folder under the user's cache directory ($XDG_CACHE_HOME,
    else ~/.cache), as the Hugging Face cache is: the demo model and the
    prefix cache's disk tier live there. A relative $XDG_CACHE_HOME is
    ignored, as the XDG base directory spec says."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and not os.path.isabs(xdg):
        _relative_ignored(xdg)
        xdg = ""
    return Path(xdg or Path.home() / ".cache") / "smg-mlx"


@cache  # said once a process
def _relative_ignored(xdg: str) -> None:
    log.warning(
        "XDG_CACHE_HOME=%s is a relative path, which the XDG base directory spec says to "
        "ignore: using %s; set it to an absolute path to use another",
        xdg,
        Path.home() / ".cache",
    )


def default_prompt_cache_dir() -> Path:
    """The disk tier's directory."""
    return cache_home() / "prompt-cache"


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to load and run a model."""

    model_path: Path
    completion_batch_size: int = 32  # most sequences decoded together
    prefill_batch_size: int = 8  # most prompts prefilled together
    # Prompt tokens a prompt prefills in one pass, at most (None: the backend's, engine.batch).
    prefill_step_size: int | None = None
    # How long an engine step may take while it prefills (see `engine.schedule.step_plan`):
    # a running stream's pause between tokens, against how fast long prompts go.
    step_budget_seconds: float = 0.15
    # The prefix cache (`engine.prefix_cache`). Its memory tier holds what the
    # memory budget leaves beside the batch, and at most this if set; 0: no
    # prefix cache at all.
    prompt_cache_bytes: int | None = None
    # Its disk tier's directory (None: no disk tier) and size bound (None: a
    # share of the free space; 0: no disk tier).
    prompt_cache_dir: Path | None = None
    prompt_cache_disk_bytes: int | None = None
    # An idle engine waits this long after each new request for more, to start
    # a burst as one group (0: never waits); see `engine.schedule.bursts`.
    burst_window_seconds: float = 0.005
    # The memory budget (see `engine.memory`): bytes, or else a share of the
    # device's memory; neither set: the default share (engine.memory.probe).
    memory_budget_bytes: int | None = None
    memory_budget_share: float | None = None
    # With several ranks (a distributed launcher started this process): split
    # the model's layers among them instead of each layer's weights.
    pipeline: bool = False
    # How requests are batched (one of BATCHING; engine.batch.batch_check).
    batching: str = "auto"
    # A LoRA adapter's directory (adapter_config.json, adapters.safetensors),
    # applied to the model as mlx-lm loads it.
    adapter_path: Path | None = None
    # Speculative decoding (one of SPECULATIVE; engine.speculative): auto checks
    # proposals where measured pass times say it pays. Off by default until the
    # GPU shows auto never costs a workload it cannot help; auto with a draft model.
    speculative: str = "off"
    # Proposed tokens one row may have checked in one pass, at most (None: the
    # drafter's default, LOOKUP_DRAFT_TOKENS or DRAFT_MODEL_TOKENS).
    num_draft_tokens: int | None = None
    # A small model of the same vocabulary whose greedy tokens are the proposals
    # (None: prompt lookup proposes).
    draft_model: Path | None = None
    # KV caches stored quantized to this many bits, in groups of kv_group_size
    # along each head (None: as the model computes them); engine.batch.kv_format.
    kv_bits: int | None = None
    kv_group_size: int = 64

    @property
    def kv_format(self) -> str | None:
        """How the KV caches are stored when quantized (None: not), as the logs
        and the disk tier's fingerprint name it."""
        if self.kv_bits is None:
            return None
        return f"{self.kv_bits}-bit KV, group {self.kv_group_size}"


@dataclass(frozen=True)
class RequestLimits:
    """How large one request and its response may be (docs/configuration.md, "Limits"). Each
    is a trade-off: more room for unusual clients, more memory and CPU that one
    client can take from the others."""

    # A request message; gRPC refuses larger ones with RESOURCE_EXHAUSTED before
    # Python sees them. gRPC copies each message into Python on the event loop,
    # so this bounds how long a flood of large requests can hold up health
    # checks. Room for a prompt of about 680,000 token ids (3 bytes each below
    # a 2M vocabulary); the worker says at start-up when its model's context
    # needs more.
    max_request_bytes: int = 2 << 20
    # One response message: what the router and gRPC clients accept by default.
    max_response_bytes: int = 4 << 20
    # Entries of stop_token_ids and of logit_bias: they bound the memory each
    # request's settings take, and the engine's cache of recent logit biases.
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024


@dataclass(frozen=True)
class ServerConfig:
    # engine.model_path is what --model names (a directory or a Hugging Face repo
    # id), or with demo the demo model's directory: the worker finds the model it
    # names once it listens (model_source.locate).
    engine: EngineConfig
    demo: bool = False
    revision: str | None = None  # of a Hugging Face repo: a branch, tag or commit
    # Sampling values a request leaves unset come from the model's
    # generation_config.json (api.sampling_defaults); False: the worker's own.
    model_sampling_defaults: bool = True
    host: str = "127.0.0.1"
    port: int = 50051
    served_model_name: str | None = None
    max_pending: int = 256  # requests waiting beyond a full batch
    shutdown_grace_seconds: float = 30.0
    # An engine stuck in a step (or not taking up a request) this long, or three
    # times its slowest step when longer, fails the worker (0: never).
    watchdog_seconds: float = 60.0
    stream_interval: int = 2  # tokens per stream message at light load (1: each alone)
    # PEM files; both set means the port speaks TLS only.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    metrics_port: int | None = None  # None: no /metrics endpoint
    # The engine in a child process of its own (api.engine_process), sharing no
    # GIL with gRPC; False: on a thread of this process (a rank of a model split
    # over several, whose group this process has joined; tests that patch it).
    engine_process: bool = False
    limits: RequestLimits = RequestLimits()
