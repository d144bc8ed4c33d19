"""Command line: `smg-mlx serve ...` (also `python -m smg_mlx serve ...`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from smg_mlx.config import DEFAULT_PROMPT_CACHE_BYTES, EngineConfig, ServerConfig
from smg_mlx.demo_model import default_demo_dir, ensure_demo_model
from smg_mlx.request_log import JsonFormatter


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smg-mlx", description="MLX inference worker for the SMG model gateway."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over the MlxEngine gRPC service",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = serve.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model", type=Path, help="an mlx-lm model directory (e.g. an mlx-community download)"
    )
    model.add_argument(
        "--demo",
        action="store_true",
        help="serve a tiny random-weight demo model (its text is noise), built once offline",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    serve.add_argument(
        "--served-model-name",
        help="model name reported to the router (default: the model directory's name)",
    )
    serve.add_argument(
        "--completion-batch-size",
        type=_positive,
        default=32,
        help="most sequences decoded together in one step",
    )
    serve.add_argument(
        "--prefill-batch-size",
        type=_positive,
        default=8,
        help="most prompts prefilled together in one step",
    )
    serve.add_argument(
        "--prefill-step-size",
        type=_positive,
        default=2048,
        help="prompt tokens per prefill step; long prompts take several steps",
    )
    serve.add_argument(
        "--prompt-cache-bytes",
        type=_non_negative,
        default=DEFAULT_PROMPT_CACHE_BYTES,
        help="memory for KV caches of finished requests, reused by later requests that "
        "share a prompt prefix (least recently used dropped first); 0 disables. A fixed "
        "2 GiB by default: it holds thousands of tokens of a 7B model's cache and stays "
        "small next to the model; raise it on large-memory machines for long agent sessions",
    )
    serve.add_argument(
        "--stream-interval",
        type=_positive,
        default=2,
        help="tokens per stream message at light load (a first token and the end go "
        "at once); under load chunks grow so that all streams together send about 300 "
        "messages/s, never holding a token more than ~100 ms, to save per-message "
        "work; 1 sends every token alone",
    )
    serve.add_argument(
        "--burst-window-ms",
        type=_non_negative_float,
        default=5.0,
        help="when idle, wait this long after each new request for another, so that a "
        "burst starts as one prefill group (until the group is full, as many have come as "
        "requests just ended, or 5 windows have passed); a running batch never waits: new "
        "requests join it at the next step; 0 starts each at once",
    )
    serve.add_argument(
        "--max-pending",
        type=_non_negative,
        default=256,
        help="requests that may wait beyond a full batch; more get RESOURCE_EXHAUSTED",
    )
    serve.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may run before they are aborted",
    )
    serve.add_argument(
        "--tls-cert",
        type=Path,
        help="PEM certificate (chain) to serve TLS with; needs --tls-key",
    )
    serve.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one JSON object per line (request lines carry their fields as keys)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if args.log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    log = logging.getLogger("smg_mlx")
    if args.model is not None and not (args.model / "config.json").is_file():
        log.error("%s is not a model directory (no config.json); pass an mlx-lm model", args.model)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        log.error("TLS needs both --tls-cert and --tls-key")
        return 2
    for pem in (args.tls_cert, args.tls_key):
        if pem is not None and not pem.is_file():
            log.error("%s is not a readable file", pem)
            return 2
    model_path = args.model
    if args.demo:
        log.warning(
            "serving the built-in demo model: random weights, so its text is noise. "
            "Serve a real model with: smg-mlx serve --model /path/to/mlx-model"
        )
        model_path = ensure_demo_model(default_demo_dir())
    config = ServerConfig(
        engine=EngineConfig(
            model_path=model_path,
            completion_batch_size=args.completion_batch_size,
            prefill_batch_size=args.prefill_batch_size,
            prefill_step_size=args.prefill_step_size,
            prompt_cache_bytes=args.prompt_cache_bytes,
            stream_interval=args.stream_interval,
            burst_window_seconds=args.burst_window_ms / 1000,
        ),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_pending=args.max_pending,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        metrics_port=args.metrics_port,
    )
    from smg_mlx.server import run  # after logging is set up; pulls in grpc

    return asyncio.run(run(config))
