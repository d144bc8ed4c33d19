"""Command line: `smg-mlx serve ...` (also `python -m smg_mlx serve ...`)."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from smg_mlx import __version__, logs, mlx_backend, model_source, tls
from smg_mlx.api.streaming import MAX_CHUNK_SECONDS
from smg_mlx.config import (
    BATCHING,
    DISK_CACHE_MOST,
    DISK_CACHE_SHARE,
    EngineConfig,
    RequestLimits,
    ServerConfig,
    default_prompt_cache_dir,
)
from smg_mlx.demo_model import default_demo_dir
from smg_mlx.engine.ranks import launched_rank
from smg_mlx.model_config import BadModelConfig, read_json

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?b?", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
# Smaller message limits would refuse ordinary requests and responses.
MIN_MESSAGE_BYTES = 64 << 10
MAX_PORT = 65535
MAX_SIZE = 1 << 60


def byte_size(text: str) -> int:
    """Bytes from "4GiB", "512MB", "2G" or "1073741824": KiB/MiB/GiB and bare
    K/M/G are powers of 1024, KB/MB/GB powers of 1000."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 4GiB, 512MB or a number of bytes, got {text!r}"
        )
    number, prefix, binary = match.groups()
    prefix = (prefix or "").lower()
    decimal = prefix and not binary and text.strip().lower().endswith("b")
    base = 1000 if decimal else 1024
    exact = float(number) * base ** _POWERS[prefix]
    if exact > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r} is more than any machine has")
    size = int(exact)
    if size == 0 and exact != 0:  # read as 0, it would turn a cache off
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    if size != exact and not prefix:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}")
    return size


def _directory(text: str) -> Path:
    if not text.strip():  # Path("") is the current directory
        raise argparse.ArgumentTypeError("expected a directory, got an empty path")
    return Path(text).expanduser().absolute()  # logged as it is used


def memory_budget(text: str) -> tuple[int | None, float | None]:
    """(bytes, None) for a size ("24GiB"), (None, share) for a share of the
    device's memory ("80%")."""
    if text.strip().endswith("%"):
        share = _number(float, 0, "a percentage such as 80%")(text.strip()[:-1]) / 100
        if not 0 < share <= 1:
            raise argparse.ArgumentTypeError(f"expected a percentage up to 100%, got {text!r}")
        return None, share
    return byte_size(text), None


def _number(kind: type, low: float, what: str) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value >= low and math.isfinite(value)):  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _port(low: int) -> Callable[[str], int]:
    what = f"a port number from {low} to {MAX_PORT}"
    at_least = _number(int, low, what)

    def parse(text: str) -> int:
        port = at_least(text)
        if port > MAX_PORT:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return port

    return parse


def _budget(text: str) -> tuple[int | None, float | None]:
    size, share = memory_budget(text)
    if size == 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0, or a percentage, got {text!r}")
    return size, share


def _model(text: str) -> Path:
    # Absolute, so that a path written as one ("./models/x") stays one and is
    # never taken for a Hugging Face repo id (model_source).
    path = Path(text)
    return path.expanduser().absolute() if model_source.looks_like_a_path(text) else path


def _adapter(text: str) -> Path:
    # What mlx_lm.lora writes, and mlx-lm's loader reads.
    path = Path(text).expanduser()
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (path / name).is_file():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a LoRA adapter's directory (no {name} in it)"
            )
    try:
        read_json(path / "adapter_config.json")
    except BadModelConfig as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def _message_size(text: str) -> int:
    size = byte_size(text)
    if size < MIN_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected a size of at least {MIN_MESSAGE_BYTES >> 10}KiB, got {text!r}"
        )
    return size


_positive = _number(int, 1, "a whole number of at least 1")
_count = _number(int, 0, "a whole number, 0 or more")
_any_port = _port(0)  # 0: the system picks one
_fixed_port = _port(1)
_non_negative = _number(float, 0, "a number, 0 or more")
_positive_float = _number(float, 1, "a number, 1 or more")


class _Parser(argparse.ArgumentParser):
    """A parser that takes no prefix of a flag for the flag (`--metrics` is not
    `--metrics-port`), and refuses an unknown flag itself, with its command's usage
    and the flag nearest to it: argparse leaves a subcommand's unknown ones to the
    top-level parser, whose usage does not list them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error("; ".join(map(self._unrecognized, unknown)))
        return parsed, unknown

    def _unrecognized(self, word: str) -> str:
        flag = word.split("=", 1)[0]
        flags = [f for action in self._actions for f in action.option_strings]
        # A prefix (what argparse would have taken), else a misspelling.
        nearest = [f for f in flags if f.startswith(flag) and len(flag) > 2]
        nearest += difflib.get_close_matches(flag, flags, n=1) if flag.startswith("-") else []
        hint = f" (did you mean {nearest[0]}?)" if nearest else ""
        return f"unrecognized argument {flag if nearest else word}{hint}"


def _add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version",
        action="version",
        version=f"smg-mlx {__version__}",
        help="print the version and exit",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="smg-mlx", description="MLX inference worker for the SMG model gateway.")
    _add_version(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over the MlxEngine gRPC service")
    _add_version(serve)  # where the flag table lists it too
    serve.set_defaults(serve_parser=serve)  # for check_serve_args' errors
    engine, server, limits = EngineConfig, ServerConfig, RequestLimits  # the defaults
    serve.add_argument(
        "model_arg",
        nargs="?",
        type=_model,
        metavar="MODEL",
        help="the model to serve, as --model names it (vllm's way of naming it)",
    )
    serve.add_argument(
        "--model",
        "--model-path",
        dest="model",
        type=_model,
        help="an mlx-lm model directory, or a Hugging Face repo id such as "
        "mlx-community/Qwen3-0.6B-4bit (from the local Hugging Face cache, downloaded if "
        "absent); what starts with /, ./, ../ or ~ is always a directory",
    )
    serve.add_argument(
        "--demo",
        action="store_true",
        help="serve a tiny random-weight demo model (its text is noise), built once offline",
    )
    serve.add_argument(
        "--revision",
        help="the branch, tag or commit of a Hugging Face repo id to serve (default: main)",
    )
    serve.add_argument(
        "--adapter-path",
        type=_adapter,
        metavar="DIR",
        help="a LoRA adapter to apply to the model (a directory with adapter_config.json "
        "and adapters.safetensors, as mlx_lm.lora writes)",
    )
    serve.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: sampling values a request leaves unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty) come from the model's generation_config.json; none: the "
        "worker's own (temperature 1, no filters) (%(default)s)",
    )
    serve.add_argument(
        "--host", default=server.host, help="address to listen on, 0.0.0.0 for all (%(default)s)"
    )
    serve.add_argument(
        "--port",
        type=_any_port,
        default=server.port,
        help="gRPC port, 0 picks a free one (%(default)s)",
    )
    serve.add_argument(
        "--served-model-name",
        help="model name reported to the router (default: the model directory's name)",
    )
    serve.add_argument(
        "--completion-batch-size",
        type=_positive,
        default=engine.completion_batch_size,
        help="most sequences decoded together in one step (%(default)s)",
    )
    serve.add_argument(
        "--prefill-batch-size",
        type=_positive,
        default=engine.prefill_batch_size,
        help="most prompts prefilled together in one step (%(default)s)",
    )
    serve.add_argument(
        "--prefill-step-size",
        type=_positive,
        default=engine.prefill_step_size,
        help="most prompt tokens one prompt prefills per pass over the model; long prompts "
        "take several (default: 4096 on CUDA, 2048 otherwise)",
    )
    serve.add_argument(
        "--step-budget-ms",
        type=_positive_float,
        default=engine.step_budget_seconds * 1000,
        help="how long an engine step may take while it prefills: prompts are prefilled in "
        "chunks that fit, so running streams pause about this long between tokens at most; "
        "larger makes long prompts finish sooner, smaller makes streams smoother (%(default)s)",
    )
    serve.add_argument(
        "--prompt-cache-bytes",
        type=byte_size,
        metavar="SIZE",
        help="the most memory the prefix cache may hold (KV caches of finished requests, "
        "reused by later requests that share a prompt prefix); it holds what the memory "
        "budget leaves beside running requests and gives way when they need the room; "
        "0 turns the prefix cache off, disk tier included; units such as 4GiB or 512MB "
        "(default: no bound but the memory budget)",
    )
    serve.add_argument(
        "--prompt-cache-dir",
        type=_directory,
        metavar="PATH",
        help="where the prefix cache keeps entries on disk: those that leave memory, and "
        "those worth keeping across a restart, read back where that is faster than "
        "prefilling (default: smg-mlx/prompt-cache under $XDG_CACHE_HOME, or ~/.cache)",
    )
    serve.add_argument(
        "--prompt-cache-disk-bytes",
        type=byte_size,
        metavar="SIZE",
        help="the most disk the prefix cache may use in --prompt-cache-dir for this model "
        "(at start-up, other models' folders there that no worker uses go until the "
        "directory fits it); "
        f"0 turns the disk tier off (default: {DISK_CACHE_SHARE * 100:.0f}%% of the free space, at "
        f"most {DISK_CACHE_MOST >> 30}GiB)",
    )
    serve.add_argument(
        "--memory-budget",
        type=_budget,
        metavar="SIZE|PERCENT",
        help="memory the worker may use, model included: a size such as 24GiB, or a share "
        "of the device's memory such as 80%%; requests wait for room, long prompts prefill "
        "in smaller chunks (default: 90%% of a GPU's memory; on the CPU, 75%% of the host's "
        "RAM or of the container's memory limit, whichever is smaller)",
    )
    serve.add_argument(
        "--pipeline",
        action="store_true",
        help="when a distributed launcher (mlx.launch) starts several ranks: split the "
        "model's layers among them instead of each layer's weights (tensor parallel)",
    )
    serve.add_argument(
        "--batching",
        default=engine.batching,
        choices=BATCHING,
        help="how requests are batched: auto runs prompts of different lengths together and "
        "alone at start-up and serves in the first mode where that changes no output "
        "(batched; equal-lengths: prompts prefilled together only at equal lengths; "
        "one-at-a-time), remembering the verdict for this model on this machine; check "
        "checks again; a mode's name serves in it without the check (a mode a remembered "
        "check found wrong for the model is not served) (%(default)s)",
    )
    serve.add_argument(
        "--stream-interval",
        type=_positive,
        default=server.stream_interval,
        help="tokens per stream message at light load; chunks grow under load, never "
        f"holding a token more than ~{MAX_CHUNK_SECONDS * 1000:.0f} ms; the first token and the "
        "end go at once; 1 sends every token alone (%(default)s)",
    )
    serve.add_argument(
        "--burst-window-ms",
        type=_non_negative,
        default=engine.burst_window_seconds * 1000,
        help="an idle worker waits this long after each new request for another, so "
        "that a burst starts as one prefill group; a running batch never waits; 0 starts "
        "each at once (%(default)s)",
    )
    serve.add_argument(
        "--max-pending",
        type=_count,
        default=server.max_pending,
        help="requests that may wait beyond a full batch; more get RESOURCE_EXHAUSTED "
        "(%(default)s)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_message_size,
        default=limits.max_request_bytes,
        metavar="SIZE",
        help="largest request message; larger ones get RESOURCE_EXHAUSTED. Each is copied "
        "into Python on the event loop: larger limits let a flood of large requests delay "
        "health checks longer (default: "
        f"{limits.max_request_bytes >> 20}MiB, about 680,000 token ids)",
    )
    serve.add_argument(
        "--max-response-bytes",
        type=_message_size,
        default=limits.max_response_bytes,
        metavar="SIZE",
        help="largest response message: no more than the clients accept (the router and "
        "gRPC clients take 4MiB unless set otherwise); a non-streamed request whose response "
        "could be larger gets INVALID_ARGUMENT before it runs "
        f"(default: {limits.max_response_bytes >> 20}MiB)",
    )
    for flag, field, default in (
        ("--max-stop-token-ids", "stop_token_ids", limits.max_stop_token_ids),
        ("--max-logit-bias", "logit_bias", limits.max_logit_bias),
    ):
        serve.add_argument(
            flag,
            type=_count,
            default=default,
            help=f"most entries in a request's {field} (%(default)s)",
        )
    serve.add_argument(
        "--shutdown-grace-seconds",
        type=_non_negative,
        default=server.shutdown_grace_seconds,
        help="on SIGTERM, how long in-flight requests may run before they are aborted "
        "(%(default)s)",
    )
    serve.add_argument(
        "--tls-cert", type=Path, help="PEM certificate (chain) to serve TLS with; needs --tls-key"
    )
    serve.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--metrics-port",
        type=_fixed_port,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (%(default)s)",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        type=str.lower,
        choices=["text", "json"],
        help="json: one JSON object per line, request lines with their fields as keys "
        "(%(default)s)",
    )
    health = commands.add_parser(
        "health",
        help="exit 0 if the worker reports SERVING, else 1 with the reason on stderr "
        "(an exec probe)",
    )
    health.add_argument("--host", default=server.host, help="worker address (%(default)s)")
    health.add_argument(
        "--port", type=_fixed_port, default=server.port, help="gRPC port (%(default)s)"
    )
    health.add_argument(
        "--timeout",
        type=_non_negative,
        default=5.0,
        help="seconds to wait for the answer (%(default)s)",
    )
    health.add_argument(
        "--tls-ca",
        type=Path,
        help="PEM certificate to trust, for a worker serving TLS (default: plaintext)",
    )
    return parser


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check flag by flag; exits 2 (parser.error) saying what
    is wrong. `args.model` is then the model named either way."""
    named = [what for what in (args.model_arg, args.model) if what is not None]
    if len(named) + args.demo != 1:
        parser.error(
            "name one model to serve: MODEL or --model (a directory or a Hugging Face repo "
            "id), or --demo"
        )
    args.model = named[0] if named else None
    if args.metrics_port is not None and args.metrics_port == args.port:
        parser.error(f"--metrics-port {args.metrics_port} is --port's too: give it another")
    if args.revision is not None and args.demo:
        parser.error("--revision names a version of a Hugging Face repo id, not of --demo")
    if args.adapter_path is not None and launched_rank() is not None:
        parser.error("--adapter-path: adapters are not served over several ranks")
    if args.pipeline and launched_rank() is None:
        parser.error(
            "--pipeline splits a model over the ranks a launcher starts (mlx.launch, see "
            "docs/scaling.md); one process has nothing to split it over: leave it out"
        )


def _stop_before_serving(signum: int, frame: object) -> None:
    raise SystemExit(0)  # nothing to drain yet


def main(argv: list[str] | None = None) -> int:
    # Until the event loop takes over (server.run), SIGTERM and SIGINT end the
    # process quietly with 0, as they do later.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_before_serving)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "health":
        from smg_mlx import health_check  # grpc only, no model or logging set-up

        return health_check.main(args.host, args.port, args.timeout, args.tls_ca)
    check_serve_args(args.serve_parser, args)
    # transformers' notice that PyTorch is absent (MLX needs none), and its
    # warnings about configs it does not know, are noise in a worker's log; both
    # are read when transformers is imported, here or in a child.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    rank = launched_rank()
    logs.configure(args.log_level, args.log_format, rank)
    log = logging.getLogger("smg_mlx")
    log.info("smg-mlx %s starting", __version__)
    bad_tls = tls.problem(args.tls_cert, args.tls_key)
    if bad_tls is not None:
        log.error("%s", bad_tls)
        return 2
    missing = mlx_backend.missing_backend()
    if missing is not None:
        log.error("%s", missing)
        return 1
    if rank is not None:  # first, before anything that could load another NCCL
        joined = _join(rank)
        if joined is not None:
            exit_process(joined)
    if args.demo:
        log.warning(
            "serving the built-in demo model: random weights, so its text is noise. "
            "Serve a real model with: smg-mlx serve --model /path/to/mlx-model"
        )
    budget_bytes, budget_share = args.memory_budget or (None, None)
    config = ServerConfig(
        engine=EngineConfig(
            model_path=default_demo_dir() if args.demo else args.model,
            completion_batch_size=args.completion_batch_size,
            prefill_batch_size=args.prefill_batch_size,
            prefill_step_size=args.prefill_step_size,
            step_budget_seconds=args.step_budget_ms / 1000,
            prompt_cache_bytes=args.prompt_cache_bytes,
            prompt_cache_dir=args.prompt_cache_dir or default_prompt_cache_dir(),
            prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
            burst_window_seconds=args.burst_window_ms / 1000,
            memory_budget_bytes=budget_bytes,
            memory_budget_share=budget_share,
            pipeline=args.pipeline,
            batching=args.batching,
            adapter_path=args.adapter_path,
        ),
        demo=args.demo,
        revision=args.revision,
        model_sampling_defaults=args.generation_config == "auto",
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_pending=args.max_pending,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        stream_interval=args.stream_interval,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        metrics_port=args.metrics_port,
        limits=RequestLimits(
            max_request_bytes=args.max_request_bytes,
            max_response_bytes=args.max_response_bytes,
            max_stop_token_ids=args.max_stop_token_ids,
            max_logit_bias=args.max_logit_bias,
        ),
    )
    if rank:  # another rank serves the clients; this one follows it
        exit_process(_follow(config, rank))
    from smg_mlx.server import run  # after logging is set up; pulls in grpc

    # Not asyncio.run: its clean-up joins the default executor's threads, and a stop
    # during start-up can leave one stuck in a download; exit_process does not wait.
    exit_process(asyncio.new_event_loop().run_until_complete(run(config)))


def _join(rank: int) -> int | None:
    """Join the other ranks a launcher started (engine.placement); an exit code
    when that fails."""
    from smg_mlx.engine import placement  # MLX's first import in this process

    try:
        placement.join(rank)
    except SystemExit as stop:  # a signal while the ranks connect
        return stop.code if isinstance(stop.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - what MLX or NCCL said is the message
        logging.getLogger("smg_mlx").error("rank %d cannot join the other ranks: %s", rank, exc)
        return 1
    return None


def _follow(config: ServerConfig, rank: int) -> int:
    """Serve as rank `rank` (not 0) of several; returns the exit code."""
    from smg_mlx import follower

    log = logging.getLogger("smg_mlx")
    try:
        source = model_source.locate(config.engine.model_path, config.demo, config.revision)
    except model_source.ModelUnavailable as exc:
        log.error("%s", exc)
        return exc.exit_code
    except SystemExit as stop:  # a signal mid-download: do not wait for its threads
        return stop.code if isinstance(stop.code, int) else 1
    return follower.run(replace(config.engine, model_path=source.path), rank)


def exit_process(code: int) -> NoReturn:
    """End the process with `code`, skipping interpreter finalization.

    MLX keeps per-thread state whose teardown runs after a thread has been
    joined and needs the interpreter; racing the main thread's finalization it
    aborts the process (exit -6 instead of the documented code)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
