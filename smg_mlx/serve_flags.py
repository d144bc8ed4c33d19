"""The `serve` command's flags, grouped by what they set: the model, where it
listens, the engine's steps, the prompt cache, how the model runs, pacing,
request limits and operations. Defaults come from `config`; what each flag's
text may be, from `flag_types`. They are added in this order, which --help shows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from smg_mlx.api.streaming import MAX_CHUNK_SECONDS
from smg_mlx.config import (
    BATCHING,
    DISK_CACHE_LEAST,
    DISK_CACHE_MOST,
    DISK_CACHE_SHARE,
    DRAFT_MODEL_TOKENS,
    KV_BITS,
    KV_GROUP_SIZES,
    LOOKUP_DRAFT_TOKENS,
    MOST_DRAFT_TOKENS,
    SPECULATIVE,
    EngineConfig,
    RequestLimits,
    ServerConfig,
)
from smg_mlx.flag_types import (
    adapter_dir,
    any_port,
    budget,
    burst_window,
    byte_size,
    count,
    directory,
    disk_cache_size,
    draft_tokens,
    fixed_port,
    host,
    kv_bits,
    message_size,
    model_name,
    non_negative,
    positive,
    positive_float,
    served_name,
)


def add(serve: argparse.ArgumentParser) -> None:
    """Every flag of `serve`, group by group."""
    for group in (
        _model,
        _listening,
        _steps,
        _prompt_cache,
        _running,
        _pacing,
        _limits,
        _operations,
    ):
        group(serve)


def _model(serve: argparse.ArgumentParser) -> None:
    """The model: which one, from where, with which adapter and sampling defaults."""
    serve.add_argument(
        "model_arg",
        nargs="?",
        type=model_name,
        metavar="MODEL",
        help="the model to serve, as --model names it (vllm's way of naming it)",
    )
    serve.add_argument(
        "--model",
        "--model-path",
        dest="model",
        type=model_name,
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
        type=adapter_dir,
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


def _listening(serve: argparse.ArgumentParser) -> None:
    """Where the worker listens and the name it serves under."""
    serve.add_argument(
        "--host",
        type=host,
        default=ServerConfig.host,
        help="address to listen on, 0.0.0.0 for all, :: for all of IPv6 too (%(default)s)",
    )
    serve.add_argument(
        "--port",
        type=any_port,
        default=ServerConfig.port,
        help="gRPC port, 0 picks a free one (%(default)s)",
    )
    serve.add_argument(
        "--served-model-name",
        type=served_name,
        help="model name reported to the router (default: the name part of a Hugging Face "
        "repo id, else the model directory's name)",
    )


def _steps(serve: argparse.ArgumentParser) -> None:
    """How many sequences a step runs and how long it may take."""
    serve.add_argument(
        "--completion-batch-size",
        type=positive,
        default=EngineConfig.completion_batch_size,
        help="most sequences decoded together in one step (%(default)s)",
    )
    serve.add_argument(
        "--prefill-batch-size",
        type=positive,
        default=EngineConfig.prefill_batch_size,
        help="most prompts prefilled together in one step (%(default)s)",
    )
    serve.add_argument(
        "--prefill-step-size",
        type=positive,
        default=EngineConfig.prefill_step_size,
        help="most prompt tokens one prompt prefills per pass over the model; long prompts "
        "take several (default: 4096 on CUDA, 2048 otherwise)",
    )
    serve.add_argument(
        "--step-budget-ms",
        type=positive_float,
        default=EngineConfig.step_budget_seconds * 1000,
        help="how long an engine step may take while it prefills: prompts are prefilled in "
        "chunks that fit, so running streams pause about this long between tokens at most; "
        "larger makes long prompts finish sooner, smaller makes streams smoother (%(default)s)",
    )


def _prompt_cache(serve: argparse.ArgumentParser) -> None:
    """The prompt cache: its memory, its folder and its disk."""
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
        type=directory,
        metavar="PATH",
        help="where the prefix cache keeps entries on disk: those that leave memory, and "
        "those worth keeping across a restart, read back where that is faster than "
        "prefilling (default: smg-mlx/prompt-cache under $XDG_CACHE_HOME, or ~/.cache)",
    )
    serve.add_argument(
        "--prompt-cache-disk-bytes",
        type=disk_cache_size,
        metavar="SIZE",
        help="the most disk the prefix cache may use in --prompt-cache-dir for this model "
        "(at start-up, other models' folders there that no worker uses go until the "
        "directory fits it); "
        f"0 turns the disk tier off, else at least {DISK_CACHE_LEAST >> 20}MiB (default: "
        f"{DISK_CACHE_SHARE * 100:.0f}%% of the free space, at most {DISK_CACHE_MOST >> 30}GiB)",
    )


def _running(serve: argparse.ArgumentParser) -> None:
    """How the model runs: its memory budget, its split over ranks, its batching."""
    serve.add_argument(
        "--memory-budget",
        type=budget,
        metavar="SIZE|PERCENT",
        help="memory the worker may use, model included: a size such as 24GiB, or a share "
        "of the device's memory such as 80%%; requests wait for room, long prompts prefill "
        "in smaller chunks (default: 90%% of a GPU's memory; on the CPU, 75%% of the host's "
        "RAM or of the container's memory limit, whichever is smaller)",
    )
    serve.add_argument(
        "--kv-bits",
        type=kv_bits,
        metavar="{" + ",".join(map(str, KV_BITS)) + "}",
        help="store KV caches quantized to this many bits (mlx-lm's --kv-bits): about half "
        "(8) or a quarter (4) of 16-bit KV's memory, so more and longer sequences fit, but "
        "outputs change (4 bits more than 8); only for models whose caches are all plain "
        "attention, with heads a multiple of --kv-group-size (default: off, KV as the model "
        "computes it)",
    )
    serve.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        help="with --kv-bits: values quantized together, each group with its own scale and "
        f"bias; smaller keeps more precision and costs more memory ({EngineConfig.kv_group_size})",
    )
    serve.add_argument(
        "--quantized-kv-start",
        type=int,  # (any other than 0 is refused with the reason, a negative one too)
        metavar="N",
        help="mlx-lm's: keep a sequence's KV in 16 bits until it passes N tokens. Here only "
        "0: a batch holds all its rows' caches in one format, so with --kv-bits every row is "
        "quantized from its first token (0)",
    )
    serve.add_argument(
        "--pipeline",
        action="store_true",
        help="when a distributed launcher (mlx.launch) starts several ranks: split the "
        "model's layers among them instead of each layer's weights (tensor parallel)",
    )
    serve.add_argument(
        "--batching",
        default=EngineConfig.batching,
        choices=BATCHING,
        help="how requests are batched: auto runs prompts of different lengths together and "
        "alone at start-up and serves in the first mode where that changes no output "
        "(batched; equal-lengths: prompts prefilled together only at equal lengths; "
        "one-at-a-time), remembering the verdict for this model on this machine; check "
        "checks again; a mode's name serves in it without the check (a mode a remembered "
        "check found wrong for the model is not served) (%(default)s)",
    )
    serve.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        help="speculative decoding: each stream proposes the tokens it expects next (what "
        "followed its last tokens earlier in its prompt or output, or a --draft-model's), "
        "and one pass checks every stream's proposals, keeping those the model itself "
        "would have chosen (greedy output unchanged, sampled output from the same "
        "distribution); auto checks them where measured pass times say it pays, always "
        f"wherever there are some, off never ({EngineConfig.speculative}; auto with "
        "--draft-model)",
    )
    serve.add_argument(
        "--draft-model",
        metavar="MODEL",
        type=model_name,
        help="a small model whose tokens the streams propose: an mlx-lm model directory or "
        "a Hugging Face repo id, with the model's vocabulary (checked at start-up); its "
        "weights and KV cache count in the memory budget (default: none, prompt lookup)",
    )
    serve.add_argument(
        "--num-draft-tokens",
        type=draft_tokens,
        metavar="N",
        help="with speculative decoding: proposed tokens a stream may have checked in one "
        f"pass, at most, 1 to {MOST_DRAFT_TOKENS} ({LOOKUP_DRAFT_TOKENS} with prompt lookup, "
        f"{DRAFT_MODEL_TOKENS} with a draft model)",
    )


def _pacing(serve: argparse.ArgumentParser) -> None:
    """How tokens go out and how a burst of requests is let in."""
    serve.add_argument(
        "--stream-interval",
        type=positive,
        default=ServerConfig.stream_interval,
        help="tokens per stream message at light load; chunks grow under load, never "
        f"holding a token more than ~{MAX_CHUNK_SECONDS * 1000:.0f} ms; the first token and the "
        "end go at once; 1 sends every token alone (%(default)s)",
    )
    serve.add_argument(
        "--burst-window-ms",
        type=burst_window,
        default=EngineConfig.burst_window_seconds * 1000,
        help="an idle worker waits this long after each new request for another, so "
        "that a burst starts as one prefill group; where requests just ended, their "
        "replacements are let in together, up to 5 windows after the last end (a running "
        "batch steps on meanwhile); at most a tenth of --watchdog-seconds, which would "
        "count those waits as an engine stuck; 0 starts each at once (%(default)s)",
    )


def _limits(serve: argparse.ArgumentParser) -> None:
    """What one request may ask for, and how many may wait."""
    serve.add_argument(
        "--max-pending",
        type=count,
        default=ServerConfig.max_pending,
        help="requests that may wait beyond a full batch; more get RESOURCE_EXHAUSTED "
        "(%(default)s)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=message_size,
        default=RequestLimits.max_request_bytes,
        metavar="SIZE",
        help="largest request message; larger ones get RESOURCE_EXHAUSTED. Each is copied "
        "into Python on the event loop: larger limits let a flood of large requests delay "
        "health checks longer (default: "
        f"{RequestLimits.max_request_bytes >> 20}MiB, about 680,000 token ids)",
    )
    serve.add_argument(
        "--max-response-bytes",
        type=message_size,
        default=RequestLimits.max_response_bytes,
        metavar="SIZE",
        help="largest response message: no more than the clients accept (the router and "
        "gRPC clients take 4MiB unless set otherwise); a non-streamed request whose response "
        "could be larger gets INVALID_ARGUMENT before it runs "
        f"(default: {RequestLimits.max_response_bytes >> 20}MiB)",
    )
    for flag, field, default in (
        ("--max-stop-token-ids", "stop_token_ids", RequestLimits.max_stop_token_ids),
        ("--max-logit-bias", "logit_bias", RequestLimits.max_logit_bias),
    ):
        serve.add_argument(
            flag,
            type=count,
            default=default,
            help=f"most entries in a request's {field} (%(default)s)",
        )


def _operations(serve: argparse.ArgumentParser) -> None:
    """Shutting down, TLS, metrics and logs."""
    serve.add_argument(
        "--shutdown-grace-seconds",
        type=non_negative,
        default=ServerConfig.shutdown_grace_seconds,
        help="on SIGTERM, how long running requests may go on before they are aborted "
        "(those still waiting for a place are turned away at once; %(default)s)",
    )
    serve.add_argument(
        "--watchdog-seconds",
        type=non_negative,
        default=ServerConfig.watchdog_seconds,
        help="an engine stuck this long in one step (or three times its slowest step, "
        "when longer), or not taking up a request, fails the worker: NOT_SERVING, its "
        "requests end, exit code 1 for the supervisor to restart it (0: never; %(default)s)",
    )
    serve.add_argument(
        "--tls-cert", type=Path, help="PEM certificate (chain) to serve TLS with; needs --tls-key"
    )
    serve.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    serve.add_argument(
        "--metrics-port",
        type=fixed_port,
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
