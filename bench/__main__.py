"""`python -m bench` (`make bench`): engine vs ours vs peer, one table, one JSON file."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench import cores, gate, machine, model, report, workers
from bench.agent import (
    FOLLOWUP_ANSWER,
    FOLLOWUP_TOKENS,
    Agent,
    format_agent,
    run_agent,
    run_followups,
)
from bench.agent import SETTINGS as AGENT_SETTINGS
from bench.kv_formats import (
    DECODE_TAIL_TOKENS,
    PARTS,
    KvFormats,
    format_kv_formats,
    run_kv_formats,
)
from bench.long_prompts import run_long_prompts
from bench.mixed import Mixed, format_mixed, run_mixed
from bench.runner import Options, progress, run_all
from bench.speculation import DEFAULT_KINDS, KINDS, Speculation, run_speculation
from bench.speculation import format_table as format_speculation
from bench.workload import SHORT, Workload, parse_levels
from smg_mlx import model_files
from smg_mlx.flag_types import byte_size
from smg_mlx.model_config import BadModelConfig, named_context_length

SYSTEMS = ("engine", "ours", "peer", "2ranks")


# The agent workload's shape, flag by flag: (flag, Agent's field, what it is).
AGENT_FLAGS = (
    ("--sessions", "sessions", "agent sessions"),
    ("--turns", "turns", "turns per session, before the restart"),
    ("--system-tokens", "system_tokens", "the system prompt all sessions share"),
    ("--first-tokens", "first_tokens", "each session's first message"),
    ("--turn-tokens", "turn_tokens", "new tokens in each later turn"),
    ("--answer-tokens", "answer_tokens", "tokens generated each turn"),
    ("--agent-concurrency", "concurrency", "sessions with a turn in flight at once"),
)


def _seconds(text: str) -> float:
    """A wait of more than 0 seconds (0 would send chats as fast as the loop runs)."""
    value = float(text)
    if not value > 0:  # (nan too)
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Raw mlx-lm engine vs this worker vs the peer worker: streaming, "
        "greedy, ignore_eos, fixed lengths, closed loop at each concurrency level.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--short",
        action="store_true",
        help="fewer requests per level (max(16, 2 x concurrency)), one round, a smaller "
        "agent workload (with --gate, 4 long prompts in its mixed run): a quick check that "
        "everything runs",
    )
    p.add_argument(
        "--systems",
        default="engine,ours,peer",
        help="subset of engine,ours,peer,2ranks (2ranks: ours with the model split over two "
        "ranks on this host, mlx.launch over loopback)",
    )
    p.add_argument(
        "--concurrency", help="levels, comma-separated (default 1,4,16,64)"
    )
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--gen-spread", type=int, default=0, metavar="N",
                   help="answers of --gen-tokens +- N tokens, drawn per request (default 0: "
                   "all the same, so requests that start together end together)")  # fmt: skip
    p.add_argument(
        "--requests", type=int, help="timed requests per level at least (default 64, short 16)"
    )
    p.add_argument(
        "--completion-batch-size",
        type=int,
        default=64,
        help="for the engine and both workers; at least the top concurrency",
    )
    p.add_argument("--prefill-batch-size", type=int, default=8)
    p.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds per level, pooled (default 3, the gate's 5, "
        "short 1): every system runs a round before any runs the next, so a drifting machine "
        "slows them alike",
    )
    p.add_argument(
        "--warmup",
        type=int,
        help="untimed requests per slot before each level (default 1, the gate's 2; 2 on "
        "GPUs: more batch shapes)",
    )
    p.add_argument("--model", type=Path, help="an existing model directory (default: build one)")
    p.add_argument(
        "--shape",
        choices=sorted(model.SHAPES),
        default="tiny",
        help="the random-weight model to build when --model is not given",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path(".bench"),
        help="built models, the peer venv, worker logs",
    )
    p.add_argument(
        "--peer-python",
        type=Path,
        help="an interpreter that already has the peer (skips creating its venv)",
    )
    p.add_argument(
        "--no-agent",
        action="store_true",
        help="skip the agent workload (run after the table when ours is among the systems)",
    )
    p.add_argument(
        "--agent",
        action="store_true",
        help="instead of the table: the agent workload alone (see bench/agent.py): sessions "
        "resending their whole history each turn, under three prefix-cache settings",
    )
    agent = Agent()
    for flag, field, what in AGENT_FLAGS:
        p.add_argument(
            flag, type=int, dest=f"agent_{field}", metavar=flag[2:].upper().replace("-", "_"),
            default=getattr(agent, field), help=f"{what} (--agent)",
        )  # fmt: skip
    p.add_argument(
        "--agent-settings",
        default="2GiB,default,off",
        help="which prefix-cache settings the agent workload runs under (see bench/agent.py)",
    )
    p.add_argument(
        "--agent-cache-bytes",
        help="--prompt-cache-bytes for the agent workload's default setting, e.g. 8MiB "
        "(memory for about one session, so that the disk tier serves the rest)",
    )
    p.add_argument(
        "--gate",
        action="store_true",
        help="instead of the table: the throughput gate (bench/gate.py): engine and ours at "
        "--concurrency (interleaved --rounds, default 5; ours one worker throughout), then "
        "the --mixed run (default 16 long prompts); each ratio against its threshold; exit "
        "status 1 when one falls short",
    )
    p.add_argument(
        "--followups",
        metavar="CONTEXTS",
        help="instead of the table: for each context length (e.g. 4096,8192), a context "
        "then the same plus its answer and 200 tokens, on our worker with its defaults",
    )
    p.add_argument(
        "--long-prompts",
        metavar="COUNTS",
        help="instead of the table: send this many long prompts at once to our worker with "
        "its default flags, e.g. 4,8,40 (one fresh worker per count)",
    )
    p.add_argument(
        "--kv-formats",
        metavar="BITS",
        help="instead of the table: our worker with each KV format (16: the model's own; 8, "
        "4: --kv-bits) in turn, the tokens one memory budget holds, then prefill and decode "
        "of --kv-concurrency long prompts at once (see bench/kv_formats.py)",
    )
    p.add_argument("--kv-fill-tokens", type=int, default=8192,
                   help="each prompt that fills the memory (--kv-formats)")  # fmt: skip
    p.add_argument("--kv-context-tokens", type=int, default=32768,
                   help="each prompt decoded from (--kv-formats)")  # fmt: skip
    p.add_argument("--kv-concurrency", type=int, default=16,
                   help="prompts prefilled and decoded at once (--kv-formats)")  # fmt: skip
    p.add_argument("--kv-parts", default=",".join(PARTS),
                   help="which of capacity, prefill, decode --kv-formats measures")  # fmt: skip
    p.add_argument("--long-prompt-tokens", type=int, default=24_000)
    p.add_argument("--long-gen-tokens", type=int, default=16)
    p.add_argument(
        "--mixed",
        type=int,
        metavar="COUNT",
        help="instead of the table: the mixed workload on our worker with its default flags "
        "(COUNT long prompts alone, then again with a stream running and a chat arriving "
        "every --chat-interval seconds; see bench/mixed.py); with --gate, its long prompts "
        "(default 16, short 4; 0 leaves the mixed part out, and the gate says it was not run)",
    )
    p.add_argument(
        "--speculation",
        action="store_true",
        help="instead of the table: our worker with speculative decoding off and on, at "
        "each concurrency level, for proposals right, wrong and half each (see "
        "bench/speculation.py)",
    )
    p.add_argument("--speculation-setting", default="auto", choices=("auto", "always"),
                   help="--speculative of the worker that speculates (--speculation)")  # fmt: skip
    p.add_argument("--speculation-draft", metavar="self|SHAPE",
                   help="proposals from a draft model (--speculation): the model itself, or a "
                   "random model of a --shape (default: prompt lookup)")  # fmt: skip
    p.add_argument("--speculation-kinds", default=",".join(DEFAULT_KINDS),
                   help=f"the workloads to run (--speculation), of {','.join(KINDS)}")  # fmt: skip
    p.add_argument("--chat-tokens", type=int, default=64, help="a chat's prompt (--mixed)")
    p.add_argument("--chat-gen-tokens", type=int, default=32, help="a chat's answer (--mixed)")
    p.add_argument("--chat-interval", type=_seconds, default=1.0, help="seconds (--mixed)")
    p.add_argument(
        "--worker-args",
        default="",
        help="more flags for our worker, e.g. '--step-budget-ms 200'",
    )
    p.add_argument(
        "--system-cpus",
        type=int,
        default=cores.DEFAULT_COUNT,
        help="pin every system under test to this many CPUs, the same ones, the fastest "
        f"of a short timing, and the client to the rest (0: no pinning; machines with "
        f"fewer than {cores.MIN_CPUS} CPUs pin nothing): a VM's CPUs differ in speed",
    )
    p.add_argument(
        "--host-bound-ms",
        type=float,
        default=0.0,
        help="every decoding step of the raw engine and of our worker first spends this "
        "many ms in pure Python, holding the GIL, as a small model's steps do on a GPU: a "
        "CPU run then shows what the GIL costs the worker (e.g. 10; default: 0, off)",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds a worker may take to report SERVING",
    )
    p.add_argument(
        "--out", type=Path, help="JSON results (default bench-results/<machine>-<time>.json)"
    )
    return p


def host_bound(milliseconds: float) -> None:
    """--host-bound-ms for the processes started from now on (bench/host_bound)."""
    folder = str(Path(__file__).parent / "host_bound")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (folder, os.environ.get("PYTHONPATH"))))
    os.environ["BENCH_HOST_BOUND_MS"] = str(milliseconds)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values the flags' types let through but no run can use: refused before
    anything runs (argparse's usage line and exit status 2), not minutes later."""
    for flag in ("concurrency", "followups", "long_prompts", "kv_formats"):
        text = getattr(args, flag)
        if text is not None:
            try:
                parse_levels(text)
            except ValueError:
                parser.error(f"--{flag.replace('_', '-')}: positive integers, comma-separated "
                             f"(e.g. 1,4,16), not {text!r}")  # fmt: skip
    at_least = {"prompt_tokens": 1, "gen_tokens": 1, "gen_spread": 0, "rounds": 1,
                "requests": 1, "completion_batch_size": 1, "prefill_batch_size": 1,
                "agent_sessions": 1, "agent_turns": 1, "agent_system_tokens": 0,
                "agent_first_tokens": 1, "agent_turn_tokens": 0, "agent_answer_tokens": 1,
                "agent_concurrency": 1, "kv_concurrency": 1, "mixed": 0, "chat_tokens": 1,
                "chat_gen_tokens": 1, "long_prompt_tokens": 1, "long_gen_tokens": 1,
                "kv_fill_tokens": 1, "kv_context_tokens": 1}  # fmt: skip
    for dest, least in at_least.items():
        value = getattr(args, dest)
        if value is not None and value < least:
            flag = next((f for f, field, _ in AGENT_FLAGS if f"agent_{field}" == dest),
                        "--" + dest.replace("_", "-"))  # fmt: skip
            parser.error(f"{flag}: at least {least}, not {value}")
    # One run at a time (--gate's own mixed run is part of it).
    modes = [flag for flag, on in (
        ("--gate", args.gate), ("--mixed", args.mixed is not None and not args.gate),
        ("--long-prompts", args.long_prompts), ("--speculation", args.speculation),
        ("--agent", args.agent), ("--followups", args.followups),
        ("--kv-formats", args.kv_formats),
    ) if on]  # fmt: skip
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)}: one run at a time")
    if args.mixed == 0 and not args.gate:
        parser.error("--mixed 0: only with --gate, whose mixed run it leaves out")
    lists = {"speculation_kinds": KINDS, "kv_parts": PARTS, "agent_settings": AGENT_SETTINGS}
    for dest, known in lists.items():
        unknown = set(getattr(args, dest).split(",")) - set(known)
        if unknown:
            parser.error(f"--{dest.replace('_', '-')}: each of {', '.join(known)}; "
                         f"not {', '.join(sorted(unknown))}")  # fmt: skip
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems: some of {', '.join(SYSTEMS)}, not {args.systems!r}")
    if args.kv_formats and set(parse_levels(args.kv_formats)) - {16, 8, 4}:
        parser.error(f"--kv-formats: each of 16 (the model's own), 8, 4; not {args.kv_formats}")
    for dest in ("warmup", "system_cpus", "host_bound_ms", "start_timeout"):
        value = getattr(args, dest)
        least = 1e-9 if dest == "start_timeout" else 0  # (a worker needs some time)
        if value is not None and not value >= least:  # (nan too)
            above = "above" if least else "at least"
            parser.error(f"--{dest.replace('_', '-')}: {above} 0, not {value}")
    if args.agent_cache_bytes is not None:
        try:
            byte_size(args.agent_cache_bytes)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--agent-cache-bytes: {exc}")
    try:
        worker_args = shlex.split(args.worker_args)
    except ValueError as exc:
        parser.error(f"--worker-args {args.worker_args!r}: {exc}")
    own = sorted(set(worker_args) & {"--port", "--host", "--metrics-port", "--model", "--demo"})
    if own:
        parser.error(f"--worker-args: {', '.join(own)} the bench sets itself, not a worker flag "
                     "to add")  # fmt: skip
    if args.model is not None:
        if not args.model.is_dir():
            parser.error(f"--model {args.model}: not a folder (an mlx-lm model directory)")
        try:
            model_files.check(args.model)
        except (BadModelConfig, OSError) as exc:
            parser.error(f"--model {args.model}: {exc}")
    draft = args.speculation_draft
    if draft is not None and draft != "self" and draft not in model.SHAPES:
        parser.error(f"--speculation-draft: self or a shape ({', '.join(sorted(model.SHAPES))}), "
                     f"not {draft!r}")  # fmt: skip
    if args.out is not None:
        # Checked now: a run of an hour must not end unable to write its results.
        if args.out.is_dir():
            parser.error(f"--out {args.out}: a directory; name a file for the JSON results")
        _writable_folder(parser, f"--out {args.out}:", args.out.parent)
    _writable_folder(parser, "--work-dir", args.work_dir)  # last: it makes the folder


def _writable_folder(parser: argparse.ArgumentParser, flag: str, folder: Path) -> None:
    """`folder` made if need be, and a file written in it (as root, `os.access`
    says yes even where nothing can be written, such as /proc)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as exc:
        parser.error(f"{flag} {folder}: cannot write there ({exc.strerror or exc})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    systems = [s for s in args.systems.split(",") if s]
    default_levels = ",".join(map(str, gate.DEFAULT_LEVELS)) if args.gate else "1,4,16,64"
    levels = parse_levels(args.concurrency or default_levels)
    workload = Workload(
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        gen_spread=args.gen_spread,
        completion_batch_size=args.completion_batch_size,
        prefill_batch_size=args.prefill_batch_size,
        warmup_per_slot=args.warmup or (2 if args.gate else 1),
    )
    if args.short:
        workload = replace(workload, **SHORT)
    if args.gate and not args.short:
        workload = replace(workload, min_requests=gate.MIN_REQUESTS)
    if args.requests:
        workload = replace(workload, min_requests=args.requests)
    if max(levels) > workload.completion_batch_size:
        progress(f"note: concurrency {max(levels)} exceeds the completion batch size; "
                 "requests will queue")  # fmt: skip
    if args.host_bound_ms:  # every process the bench starts inherits it
        host_bound(args.host_bound_ms)
    # The workers' prompt caches start empty, under the work folder; mlx's kernels
    # (on CUDA a first start builds them: minutes under --kv-bits) are kept from
    # run to run beside them, unless MLX_PTX_CACHE_DIR says where.
    os.environ.setdefault("MLX_PTX_CACHE_DIR", str((args.work_dir / "kernels").resolve()))
    placement = cores.place(args.system_cpus)  # before any thread starts: they inherit it
    if placement is not None:
        progress(placement.describe())
    began = time.monotonic()
    model_dir = args.model
    if model_dir is None:
        progress(f"model: {args.shape} (built once under {args.work_dir / 'models'})")
        model_dir = model.ensure_model(args.shape, args.work_dir / "models")
    _check_context(args, model_dir)
    if args.gate:
        return _gate(args, model_dir, argv, levels, workload)
    if args.long_prompts:
        return _long_prompts(args, model_dir, argv)
    if args.mixed:
        return _mixed(args, model_dir, argv)
    if args.speculation:
        return _speculation(args, model_dir, argv, levels, workload)
    if args.agent:
        return _agent(args, model_dir, argv)
    if args.followups:
        return _followups(args, model_dir, argv)
    if args.kv_formats:
        return _kv_formats(args, model_dir, argv)
    opts = Options(
        systems=systems,
        levels=levels,
        workload=workload,
        model_dir=model_dir.resolve(),
        work_dir=args.work_dir.resolve(),
        peer_python=args.peer_python,
        start_timeout_s=args.start_timeout,
        rounds=args.rounds or (1 if args.short else 3),
        worker_args=tuple(shlex.split(args.worker_args)),
    )
    info = machine.describe()
    out = args.out or report.default_out(machine.slug(info))

    agent: dict = {}

    def save(results: list, systems: dict) -> None:
        """Written after each level, so a run cut short still leaves its numbers."""
        rows = report.ratios(results)
        payload = {
            "command": shlex.join(["python", "-m", "bench", *(argv or sys.argv[1:])]),
            "short": args.short,
            "machine": info,
            "model": model.describe(model_dir),
            "workload": workload.to_dict(),
            "concurrency": levels,
            "rounds": opts.rounds,
            "systems": systems,
            "results": [r.to_dict() for r in results],
            "ratios": rows,
            "targets": report.targets(rows),
            "agent": agent or None,
            "elapsed_s": time.monotonic() - began,
        }
        report.write_json(out, payload)

    results, systems_info = run_all(opts, save)
    rows = report.ratios(results)
    print(report.format_table(results))
    print()
    print(report.format_ratios(rows, report.targets(rows)))
    if "ours" in systems and not args.no_agent:
        try:
            agent.update(_run_agent(args, model_dir))
        except Exception as exc:  # noqa: BLE001 - the throughput numbers are saved already
            progress(f"agent: FAILED: {exc!r}")
            agent["error"] = repr(exc)
        save(results, systems_info)
        if "runs" in agent:
            print()
            print(format_agent(agent))
    progress(f"done in {time.monotonic() - began:.0f}s; results in {out}")
    # A system that failed is in the table as missing, requests that failed in its
    # errors column: the exit status says so too.
    errors = [f"{r.system} at {r.concurrency}: {r.errors} of {r.requests} requests failed"
              f" ({r.first_error})" for r in results if r.errors]  # fmt: skip
    for said in errors:
        progress(said)
    failed = any("error" in info for info in systems_info.values()) or "error" in agent
    return 1 if failed or errors else 0


def _check_context(args: argparse.Namespace, model_dir: Path) -> None:
    """Prompts and answers the run would send that the model's context cannot
    hold: refused now (exit 2), not counted as failures after minutes of work."""
    context = named_context_length(model_dir)
    if context is None:
        return
    wanted: list[tuple[int, str, str]] = []  # tokens, the flags that make them, advice
    mixed = args.mixed or (args.gate and args.mixed != 0)
    advice = " (or --mixed 0)" if args.gate else ""
    if args.long_prompts or mixed:
        wanted.append((args.long_prompt_tokens + args.long_gen_tokens,
                       "--long-prompt-tokens plus --long-gen-tokens", advice))  # fmt: skip
    if mixed:  # its chats, and its stream's answer
        wanted.append((args.chat_tokens + args.chat_gen_tokens,
                       "--chat-tokens plus --chat-gen-tokens", advice))  # fmt: skip
        stream = "--chat-tokens plus --long-prompt-tokens (the running stream)"
        wanted.append((args.chat_tokens + args.long_prompt_tokens, stream, advice))
    elif args.kv_formats:
        parts = args.kv_parts.split(",")
        if "capacity" in parts:
            wanted.append((args.kv_fill_tokens + 1, "--kv-fill-tokens", ""))
        if "decode" in parts or "prefill" in parts:
            tail = DECODE_TAIL_TOKENS + args.gen_tokens if "decode" in parts else 1
            wanted.append((args.kv_context_tokens + tail, "--kv-context-tokens", ""))
    elif args.followups:
        wanted.append((max(parse_levels(args.followups)) + 2 * FOLLOWUP_ANSWER + FOLLOWUP_TOKENS,
                       "--followups, the answer and the follow-up's tokens", ""))  # fmt: skip
    elif args.agent:
        wanted.append((_agent_shape(args).longest(), "an agent session's tokens and answers", ""))
    modes = args.agent or args.followups or args.long_prompts or args.mixed or args.kv_formats
    if args.gate or not modes:  # the table's workload (the gate's throughput part too)
        wanted.append((args.prompt_tokens + args.gen_tokens + args.gen_spread,
                       "--prompt-tokens plus --gen-tokens (and --gen-spread)", ""))  # fmt: skip
    for tokens, flags, advice in wanted:
        if tokens > context:
            print(f"python -m bench: error: {flags} come to {tokens} tokens, past the "
                  f"{context}-token context of {model_dir}: give fewer{advice}, or a model "
                  "with a longer context (--shape, --model)", file=sys.stderr)  # fmt: skip
            raise SystemExit(2)


def _long_prompts(args: argparse.Namespace, model_dir: Path, argv: list[str] | None) -> int:
    workload = Workload(prompt_tokens=args.long_prompt_tokens, gen_tokens=args.long_gen_tokens)
    results = run_long_prompts(
        model_dir.resolve(), args.work_dir.resolve(), parse_levels(args.long_prompts),
        workload, shlex.split(args.worker_args), args.start_timeout,
    )  # fmt: skip
    _write(args, argv, model_dir, workload=workload.to_dict(), long_prompts=results)
    return 0 if all(r["completed"] == r["requests"] for r in results) else 1


def _write(args: argparse.Namespace, argv: list[str] | None, model_dir: Path, **results) -> None:
    """A single-worker run's JSON (at --out, or named for the machine): the
    command, the machine, the model and `results`."""
    info = machine.describe()
    out = args.out or report.default_out(machine.slug(info))
    command = shlex.join(["python", "-m", "bench", *(argv or sys.argv[1:])])
    payload = {"command": command, "machine": info, "model": model.describe(model_dir)}
    report.write_json(out, {**payload, **results})
    progress(f"results in {out}")


def _mixed(args: argparse.Namespace, model_dir: Path, argv: list[str] | None) -> int:
    mixed = Mixed(
        longs=args.mixed,
        long_tokens=args.long_prompt_tokens,
        long_gen_tokens=args.long_gen_tokens,
        chat_tokens=args.chat_tokens,
        chat_gen_tokens=args.chat_gen_tokens,
        chat_interval_s=args.chat_interval,
    )
    result = run_mixed(
        model_dir.resolve(), args.work_dir.resolve(), mixed, shlex.split(args.worker_args),
        args.start_timeout,
    )  # fmt: skip
    print(format_mixed(result))
    _write(args, argv, model_dir, mixed=result)
    chats_failed = result["mixed"]["chats_failed"] + result["idle"]["chats_failed"]
    return 1 if result["long_errors"] or chats_failed else 0


def _gate(args: argparse.Namespace, model_dir: Path, argv: list[str] | None,
          levels: list[int], workload: Workload) -> int:  # fmt: skip
    opts = Options(
        systems=["engine", "ours"],
        levels=levels,
        workload=workload,
        model_dir=model_dir.resolve(),
        work_dir=args.work_dir.resolve(),
        start_timeout_s=args.start_timeout,
        rounds=args.rounds or (1 if args.short else gate.ROUNDS),
        # The bare engine has no speculative decoding, and the bench's greedy
        # random models repeat themselves (every proposal right): measured
        # with it, the gate would not see the serving path it guards
        # (`--speculation` measures speculation). --worker-args may turn it on.
        worker_args=(*gate.WORKER_ARGS, *shlex.split(args.worker_args)),
        one_worker=True,
    )
    results, systems = run_all(opts)
    print(report.format_table(results))
    checks = gate.throughput_checks(results, levels)
    mixed_result = None if args.mixed == 0 else _gate_mixed(args, model_dir)
    if mixed_result is None:
        print("\nmixed run: left out (--mixed 0); the gate covers throughput only")
    else:
        print()
        print(format_mixed(mixed_result))
        budget = gate.step_budget_seconds(shlex.split(args.worker_args))
        checks += gate.mixed_checks(mixed_result, budget)
    print()
    print(gate.format_checks(checks))
    _write(args, argv, model_dir, workload=workload.to_dict(), systems=systems,
           results=[r.to_dict() for r in results], mixed=mixed_result,
           checks=[{**asdict(c), "met": c.met} for c in checks])  # fmt: skip
    if args.short:
        # One round of few requests moves by more than the bounds: no verdict.
        print("--short: one round of few requests, a check that the gate runs; its verdict "
              "is the full gate's (without --short)")  # fmt: skip
        ran = {r.system for r in results}
        return 1 if any(r.errors for r in results) or ran != {"engine", "ours"} else 0
    return 0 if all(c.met for c in checks) else 1


def _gate_mixed(args: argparse.Namespace, model_dir: Path) -> dict:
    mixed = Mixed(
        longs=args.mixed or (4 if args.short else 16),
        long_tokens=args.long_prompt_tokens,
        long_gen_tokens=args.long_gen_tokens,
        chat_tokens=args.chat_tokens,
        chat_gen_tokens=args.chat_gen_tokens,
        chat_interval_s=args.chat_interval,
    )
    progress(f"mixed: {mixed.longs} x {mixed.long_tokens} tokens beside a stream and chats")
    return run_mixed(model_dir.resolve(), args.work_dir.resolve(), mixed,
                     shlex.split(args.worker_args), args.start_timeout)  # fmt: skip


def _speculation(args: argparse.Namespace, model_dir: Path, argv: list[str] | None,
                 levels: list[int], workload: Workload) -> int:  # fmt: skip
    draft = args.speculation_draft
    if draft not in (None, "self"):
        draft = model.ensure_model(draft, args.work_dir / "models")
    elif draft == "self":
        draft = model_dir
    spec = Speculation(tuple(levels), tuple(args.speculation_kinds.split(",")),
                       args.rounds or (1 if args.short else 3), args.speculation_setting,
                       draft)  # fmt: skip
    rows = run_speculation(model_dir.resolve(), args.work_dir.resolve(), spec, workload,
                           shlex.split(args.worker_args), args.start_timeout)  # fmt: skip
    print(format_speculation(rows))
    _write(args, argv, model_dir, workload=workload.to_dict(), speculation=rows)
    return 0


def _agent_shape(args: argparse.Namespace) -> Agent:
    """The agent workload as the flags shape it (smaller with --short)."""
    shape = Agent(**{field: getattr(args, f"agent_{field}") for _, field, _ in AGENT_FLAGS})
    return replace(shape, sessions=2, turns=3) if args.short else shape


def _run_agent(args: argparse.Namespace, model_dir: Path) -> dict:
    return run_agent(model_dir.resolve(), args.work_dir.resolve(), _agent_shape(args),
                     args.agent_cache_bytes, args.start_timeout, shlex.split(args.worker_args),
                     tuple(args.agent_settings.split(",")))  # fmt: skip


def _agent(args: argparse.Namespace, model_dir: Path, argv: list[str] | None) -> int:
    result = _run_agent(args, model_dir)
    print(format_agent(result))
    _write(args, argv, model_dir, agent=result)
    return 0


def _followups(args: argparse.Namespace, model_dir: Path, argv: list[str] | None) -> int:
    contexts = parse_levels(args.followups)
    results = run_followups(
        model_dir.resolve(), args.work_dir.resolve(), contexts, shlex.split(args.worker_args),
        args.start_timeout,
    )  # fmt: skip
    print(f"{'context':>8} {'TTFT ms':>8} {'follow-up cached':>17} {'follow-up TTFT ms':>18} "
          f"{'again':>6}")  # fmt: skip
    for r in results:
        print(f"{r['context']:>8} {r['ttft_ms']:>8.0f} {r['followup_cached']:>17} "
              f"{r['followup_ttft_ms']:>18.0f} {r['again_followup_ttft_ms']:>6.0f}")  # fmt: skip
    _write(args, argv, model_dir, followups=results)
    return 0


def _kv_formats(args: argparse.Namespace, model_dir: Path, argv: list[str] | None) -> int:
    parts = tuple(args.kv_parts.split(","))
    run = KvFormats(tuple(parse_levels(args.kv_formats)), args.kv_fill_tokens,
                    args.kv_context_tokens, args.kv_concurrency, args.gen_tokens,
                    parts)  # fmt: skip
    result = run_kv_formats(model_dir.resolve(), args.work_dir.resolve(), run,
                            shlex.split(args.worker_args), args.start_timeout)  # fmt: skip
    print(format_kv_formats(result))
    _write(args, argv, model_dir, kv_formats=result)
    return 0 if not any(r.get("errors") for r in result["formats"].values()) else 1


if __name__ == "__main__":
    workers.stop_on_sigterm()
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # Ctrl-C: what ran is stopped on the way out; no traceback
        print("python -m bench: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except workers.WorkerExited as exc:  # the worker's own words, not a traceback
        reason = exc.reason()
        print(f"python -m bench: {exc}" + (f"\n  {reason}" if reason != str(exc) else ""),
              file=sys.stderr)  # fmt: skip
        raise SystemExit(1) from None
