"""Command line: `smg-mlx serve ...` (also `python -m smg_mlx serve ...`)."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import errno
import logging
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from smg_mlx import __version__, flag_types, logs, mlx_backend, model_source, serve_flags, tls
from smg_mlx.config import (
    EngineConfig,
    RequestLimits,
    ServerConfig,
    default_prompt_cache_dir,
)
from smg_mlx.demo_model import default_demo_dir
from smg_mlx.engine.ranks.launched import launched_rank
from smg_mlx.engine.schedule.bursts import WINDOWS_AT_MOST
from smg_mlx.stop_signals import stop_quietly


class _Parser(argparse.ArgumentParser):
    """A parser that takes no prefix of a flag for the flag (`--metrics` is not
    `--metrics-port`), and refuses an unknown flag itself, naming its command and
    the flag nearest to it: argparse leaves a subcommand's unknown ones to the
    top-level parser, which does not know them. A refusal is one line, the
    error and where the flags are listed: argparse's usage first would bury it
    under a screenful of flags."""

    # Under --log-format json an error is one JSON log line too: a collector
    # reads every line a worker writes as JSON, a flag refused on start too.
    json_errors = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)
        # A word of '-' and a digit ("-5GiB", "-5%", "-.5") is a flag's value, for
        # its type to refuse with its own words: argparse takes only bare numbers
        # ("-5") so, and says of others "expected one argument". No flag starts so.
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message: str) -> NoReturn:
        text = f"{self.prog}: error: {message} (see {self.prog} --help)"
        if not _Parser.json_errors:
            self.exit(2, text + "\n")
        record = logging.LogRecord("smg_mlx", logging.ERROR, __file__, 0, text, None, None)
        sys.stderr.write(logs.JsonFormatter().format(record) + "\n")
        raise SystemExit(2)

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
    serve_flags.add(serve)
    health = commands.add_parser(
        "health",
        help="exit 0 if the worker reports SERVING, else 1 with the reason on stderr "
        "(an exec probe); 2 for the probe's own bad flags",
    )
    health.add_argument(
        "--host",
        type=flag_types.host,
        default=ServerConfig.host,
        help="worker address (%(default)s)",
    )
    health.add_argument(
        "--port",
        type=flag_types.fixed_port,
        default=ServerConfig.port,
        help="gRPC port (%(default)s)",
    )
    health.add_argument(
        "--timeout",
        type=flag_types.timeout,
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
    is wrong. `args.model` is then the model named either way, and
    `args.speculative` the setting in effect."""
    named = [what for what in (args.model_arg, args.model) if what is not None]
    given = [str(what) for what in named] + ["--demo"] * args.demo
    if len(given) != 1:
        two = f" ({' and '.join(given)} were given)" if given else ""
        parser.error(
            "name one model to serve: MODEL or --model (a directory or a Hugging Face repo "
            f"id), or --demo{two}"
        )
    args.model = named[0] if named else None
    if args.metrics_port is not None and args.metrics_port == args.port:
        parser.error(f"--metrics-port {args.metrics_port} is --port's too: give it another")
    if args.revision is not None and args.demo:
        parser.error("--revision names a version of a Hugging Face repo id, not of --demo")
    if args.kv_bits is not None and args.demo:
        group = args.kv_group_size or EngineConfig.kv_group_size
        parser.error(f"--kv-bits: the demo model's heads (16 wide) are narrower than a "
                     f"quantization group; write a model with heads {group} wide, `python "
                     f"-m smg_mlx.demo_model DIR --head-dim {group}`, and serve it (--model)")
    if args.draft_model is not None and args.speculative == "off":
        parser.error("--draft-model proposes tokens for speculative decoding, which "
                     "--speculative off turns off: leave one of them out")  # fmt: skip
    args.speculative = args.speculative or ("auto" if args.draft_model else "off")
    if args.num_draft_tokens is not None and args.speculative == "off":
        parser.error(
            "--num-draft-tokens: speculative decoding is off (its default, or --speculative "
            "off): add --speculative auto (or a --draft-model), or leave it out"
        )
    if args.kv_group_size is not None and args.kv_bits is None:
        parser.error(
            "--kv-group-size: the KV caches are not quantized without --kv-bits: add "
            "--kv-bits 8 (or 4), or leave it out"
        )
    if args.quantized_kv_start is not None and args.kv_bits is None:
        parser.error(
            f"--quantized-kv-start {args.quantized_kv_start}: the KV caches are not quantized "
            "without --kv-bits: leave --quantized-kv-start out"
        )
    if args.quantized_kv_start:
        parser.error(
            f"--quantized-kv-start {args.quantized_kv_start}: a batch holds all its rows' KV "
            "caches in one format, so with --kv-bits every row is quantized from its first "
            "token; leave --quantized-kv-start out (or give 0)"
        )
    if args.prompt_cache_bytes == 0 and args.prompt_cache_disk_bytes:
        parser.error(
            "--prompt-cache-disk-bytes: --prompt-cache-bytes 0 turns the prompt cache off, "
            "its disk tier included (which keeps what memory lets go): leave one of them out"
        )
    if args.prompt_cache_dir is not None:
        unusable = _unusable_directory(args.prompt_cache_dir)
        if unusable is not None:
            # Named, so it is meant: the default alone may fall back to memory (a
            # read-only home), and a typo'd volume would lose the disk tier quietly.
            parser.error(
                f"--prompt-cache-dir {args.prompt_cache_dir}: {unusable}; give a directory "
                "this user can write, or leave it out for the default"
            )
    waits = args.burst_window_ms / 1000 * WINDOWS_AT_MOST
    if args.watchdog_seconds and 2 * waits > args.watchdog_seconds:
        # A request the engine holds for its burst counts, to the watchdog, as not
        # taken up: past the limit the worker would fail on a request.
        parser.error(
            f"--burst-window-ms {args.burst_window_ms:g}: a request may wait {WINDOWS_AT_MOST} "
            f"windows ({waits:g} s) for the rest of its burst, and the watchdog (--watchdog-"
            f"seconds {args.watchdog_seconds:g}) fails the worker on a request waiting that "
            f"long: give a window up to {args.watchdog_seconds * 500 / WINDOWS_AT_MOST:g} ms, "
            "or a --watchdog-seconds at least twice that wait (0: none)"
        )
    if args.adapter_path is not None and launched_rank() is not None:
        parser.error("--adapter-path: adapters are not served over several ranks")
    if args.pipeline and launched_rank() is None:
        parser.error(
            "--pipeline splits a model over the ranks a launcher starts (mlx.launch, see "
            "docs/scaling.md); one process has nothing to split it over: leave it out"
        )


def _unusable_directory(path: Path) -> str | None:
    """Why `path` cannot hold files (made if missing, as the worker would), or None."""
    if path.is_file():  # (mkdir would say only "File exists")
        return "it is a file, not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Full (of bytes or of inodes, which the worker's own entries may
            # use up): no mistake to refuse, and a refusal (exit 2) is not
            # restarted; the worker serves from memory and says why.
            return None
        return f"cannot make it or write in it ({exc.strerror or exc})"


def main(argv: list[str] | None = None) -> int:
    stop_quietly()  # (again, for a caller other than __main__)
    words = sys.argv[1:] if argv is None else argv
    _Parser.json_errors = "--log-format=json" in words or any(
        a == "--log-format" and b == "json" for a, b in zip(words, words[1:], strict=False)
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "health":
        # gRPC's own log lines (a failed TLS handshake's, say) would repeat the one-line reason.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
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
    if missing is not None:  # an install to fix, which no restart cures
        log.error("%s", missing)
        return 2
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
            speculative=args.speculative,
            num_draft_tokens=args.num_draft_tokens,
            draft_model=args.draft_model,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size or EngineConfig.kv_group_size,
        ),
        demo=args.demo,
        revision=args.revision,
        model_sampling_defaults=args.generation_config == "auto",
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_pending=args.max_pending,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        watchdog_seconds=args.watchdog_seconds,
        stream_interval=args.stream_interval,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        metrics_port=args.metrics_port,
        engine_process=rank is None,
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
    """Join the other ranks a launcher started (engine.ranks.placement); an exit code
    when that fails."""
    from smg_mlx.engine.ranks import placement  # MLX's first import in this process

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
