"""Settings of one worker process, filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# KV caches of finished sequences kept for reuse. A fixed size rather than a
# share of memory: the model's own footprint is unknown here, and 2 GiB holds
# thousands of tokens of a 7B model's KV cache.
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class EngineConfig:
    """What the engine thread needs to load and run a model."""

    model_path: Path
    completion_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES  # 0: no prefix cache
    stream_interval: int = 2  # tokens per stream message at light load (1: each alone)
    # An idle engine waits this long after each new request for more, to start
    # a burst as one group (0: never waits); see `engine.Engine._gather_burst`.
    burst_window_seconds: float = 0.005


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051
    served_model_name: str | None = None
    max_pending: int = 256
    shutdown_grace_seconds: float = 30.0
    # PEM files; both set means the port speaks TLS only.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    metrics_port: int | None = None  # None: no /metrics endpoint
