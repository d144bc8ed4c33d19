"""Agent workload: sessions resending their whole history every turn.

Every session starts with the same system prompt and a first message of its
own; each later turn resends everything so far (the model's answers included)
plus new tokens (a user message, a tool's output), as coding agents, tool
loops and long chats do. Turns go round the sessions (every session's turn 1,
then every turn 2, ...), `concurrency` sessions at a time. After the last
turn the worker is restarted and every session sends one turn more: what a
rolling update costs.

Our worker runs the same token streams under three prefix-cache settings:
`2GiB` (a fixed 2 GiB memory cache and no disk tier: the settings before the
disk tier), `default` (the defaults: memory the budget leaves free, a disk
tier in a fresh directory), and `off`. Greedy decoding: the settings must not
change a token.

`followups` is a probe of the same mechanism: a context of N tokens, then the
same context plus its answer and 200 new tokens; what the second request
reuses and its TTFT, for several N; then the same again with other tokens, so
that the second time finds the attention shapes built (on CUDA, a new shape
costs a graph build).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc

from bench.grpc_client import stream_one, token_request
from bench.long_prompts import default_worker, metric
from bench.runner import progress
from bench.stats import RequestRecord, percentile
from bench.workers import WorkerProcess
from bench.workload import PROMPT_ID_RANGE
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

CACHED_TARGET = 0.95  # of the resent history, from turn 2 on
TTFT_TARGET = 0.3  # the default run's TTFT p50 over the cache-off run's, from turn 3 on
FOLLOWUP_TOKENS = 200
FOLLOWUP_ANSWER = 8  # tokens each request of a follow-up pair generates


@dataclass(frozen=True)
class Agent:
    """The workload's shape (the CPU default; the issue's GPU run is 16 x 7,
    4096 shared, 4096 first, 4096 a turn)."""

    sessions: int = 4
    turns: int = 4
    system_tokens: int = 256
    first_tokens: int = 256  # the first message after the system prompt
    turn_tokens: int = 128  # new tokens each later turn
    answer_tokens: int = 32
    concurrency: int = 1  # sessions with a turn in flight at once
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def longest(self) -> int:
        """The most tokens a turn's request and answer come to (the turn after
        the restart: the whole history, its new tokens and its answer)."""
        turns = self.turns * (self.turn_tokens + self.answer_tokens)
        return self.system_tokens + self.first_tokens + turns + self.answer_tokens


# The prefix-cache settings compared, by name (`settings`).
SETTINGS = ("2GiB", "default", "off")


def settings(cache_dir: Path, cache_bytes: str | None) -> dict[str, list[str]]:
    """Our worker's flags for each prefix-cache setting compared."""
    default = ["--prompt-cache-dir", str(cache_dir)]
    if cache_bytes:
        default += ["--prompt-cache-bytes", cache_bytes]
    return {
        "2GiB": ["--prompt-cache-bytes", "2GiB", "--prompt-cache-disk-bytes", "0"],
        "default": default,
        "off": ["--prompt-cache-bytes", "0"],
    }


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(n)]


@dataclass
class Turn:
    prompt_tokens: int
    resent_tokens: int  # of the prompt, what an earlier turn already sent
    record: RequestRecord


class Sessions:
    """Every session's history, advanced a round of turns at a time."""

    def __init__(self, shape: Agent) -> None:
        self.shape = shape
        system = _tokens(random.Random(f"{shape.seed}-system"), shape.system_tokens)
        self.rngs = [random.Random(f"{shape.seed}-{s}") for s in range(shape.sessions)]
        self.histories = [list(system) for _ in range(shape.sessions)]
        self.outputs: dict[tuple[int, int], list[int]] = {}

    async def round(self, address: str, turn: int) -> list[Turn]:
        """Turn `turn` of every session, `concurrency` at a time."""
        shape = self.shape
        gate = asyncio.Semaphore(shape.concurrency)
        new = shape.first_tokens if turn == 1 else shape.turn_tokens
        async with grpc.aio.insecure_channel(address) as channel:
            await channel.channel_ready()
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)

            async def one(session: int) -> Turn:
                history = self.histories[session]
                ids = history + _tokens(self.rngs[session], new)
                request = token_request(ids, shape.answer_tokens, f"agent-{session}-{turn}")
                async with gate:
                    record = await stream_one(stub, request, shape.answer_tokens, keep_ids=True)
                if record.error is not None:
                    raise RuntimeError(f"session {session} turn {turn}: {record.error}")
                self.histories[session] = ids + record.output_ids
                self.outputs[session, turn] = record.output_ids
                resent = len(history) if turn > 1 else 0
                return Turn(len(ids), resent, record)

            return list(await asyncio.gather(*(one(s) for s in range(shape.sessions))))


def _row(turns: list[Turn], wall: float) -> dict:
    ttft = [t.record.ttft * 1e3 for t in turns]
    resent = sum(t.resent_tokens for t in turns)
    cached = sum(t.record.cached_tokens for t in turns)
    return {
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "resent_tokens": resent,
        "cached_tokens": cached,
        "cached_share": cached / resent if resent else None,
        "tok_s": sum(t.record.tokens for t in turns) / wall if wall else 0.0,
        "wall_s": wall,
    }


def _served(metrics_port: int) -> dict:
    """Prompt tokens each tier of the worker's prefix cache served so far."""
    name = "smg_mlx_prefix_cache_served_tokens_total"
    return {tier: metric(metrics_port, f'{name}{{tier="{tier}"}}') for tier in ("memory", "disk")}


def _run(model_dir: Path, work_dir: Path, shape: Agent, name: str, flags: list[str],
         start_timeout: float) -> tuple[dict, dict]:  # fmt: skip
    """One setting: a warm-up, the turns, a restart and one turn more (`flags`
    name the setting's own --prompt-cache-dir, which the restart keeps)."""
    sessions = Sessions(shape)
    rows: dict[str, dict] = {}
    tag = f"agent-{name}"
    with default_worker(model_dir, work_dir, flags, tag, start_timeout) as (worker, metrics):
        # Other tokens first: batch and prompt shapes built, nothing reusable.
        warm = Sessions(replace(shape, sessions=1, concurrency=1, seed=shape.seed + 1))
        for turn in (1, 2):
            asyncio.run(warm.round(worker.address, turn))
        for turn in range(1, shape.turns + 1):
            began = time.perf_counter()
            turns = asyncio.run(sessions.round(worker.address, turn))
            rows[str(turn)] = _row(turns, time.perf_counter() - began)
        rows["served_tokens"] = _served(metrics)  # the warm-up's included
    began = time.perf_counter()
    restarted = f"{tag}-restarted"
    with default_worker(model_dir, work_dir, flags, restarted, start_timeout) as (worker, metrics):
        rows["restart_s"] = {"serving_after_s": time.perf_counter() - began}
        began = time.perf_counter()
        turns = asyncio.run(sessions.round(worker.address, shape.turns + 1))
        rows["after restart"] = _row(turns, time.perf_counter() - began)
        rows["served_tokens_after_restart"] = _served(metrics)
    progress(f"agent {name}: done")
    return rows, {f"{s}-{t}": ids for (s, t), ids in sessions.outputs.items()}


def run_agent(model_dir: Path, work_dir: Path, shape: Agent, cache_bytes: str | None,
              start_timeout: float, extra: list[str] = (),
              names: tuple[str, ...] = ("2GiB", "default", "off")) -> dict:  # fmt: skip
    """The settings `names`, the targets, and whether outputs match the cache-off run."""
    progress(f"agent: {shape.sessions} sessions x {shape.turns} turns "
             f"(+1 after a restart), {shape.concurrency} at a time")  # fmt: skip
    cache_dir = work_dir / "agent-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)  # nothing from an earlier run helps
    runs, outputs = {}, {}
    for name, flags in settings(cache_dir, cache_bytes).items():
        if name not in names:
            continue
        runs[name], outputs[name] = _run(model_dir, work_dir, shape, name, [*flags, *extra],
                                         start_timeout)  # fmt: skip
    result = {"shape": shape.to_dict(), "cache_bytes": cache_bytes, "runs": runs, "targets": []}
    if "default" in runs:
        shares = [runs["default"][t]["cached_share"]
                  for t in [*map(str, range(2, shape.turns + 1)), "after restart"]]  # fmt: skip
        result["targets"].append(
            {"what": "cached share of resent history, turns >= 2 and after restart (default)",
             "value": min(shares), "target": f">= {CACHED_TARGET}",
             "met": min(shares) >= CACHED_TARGET}  # fmt: skip
        )
    if "default" in runs and "off" in runs:
        later = [str(t) for t in range(3, shape.turns + 1)] + ["after restart"]
        ratios = {t: runs["default"][t]["ttft_p50_ms"] / runs["off"][t]["ttft_p50_ms"]
                  for t in later}  # fmt: skip
        result["ttft_default/off"] = ratios
        result["targets"].append(
            {"what": "TTFT p50 default/off, turns >= 3 and after restart",
             "value": max(ratios.values()), "target": f"<= {TTFT_TARGET}",
             "met": max(ratios.values()) <= TTFT_TARGET}  # fmt: skip
        )
    if "off" in runs:
        result["outputs_identical_to_off"] = {n: outputs[n] == outputs["off"] for n in outputs}
    return result


def format_agent(result: dict) -> str:
    """Per turn and setting: TTFT p50/p99, cached/resent tokens, tok/s."""
    names = list(result["runs"])
    turns = [k for k in result["runs"][names[0]] if k == "after restart" or k.isdigit()]
    header = f"{'turn':<14}" + "".join(f"{n + ' TTFT p50/p99 ms':>26}{'cached':>9}" for n in names)
    lines = [header, "-" * len(header)]
    for turn in turns:
        line = f"{turn:<14}"
        for name in names:
            r = result["runs"][name][turn]
            share = "" if r["cached_share"] is None else f"{100 * r['cached_share']:.0f}%"
            line += f"{r['ttft_p50_ms']:>16.0f} / {r['ttft_p99_ms']:<7.0f}{share:>9}"
        lines.append(line)
    for name in names:
        runs = result["runs"][name]
        tok_s = [runs[t]["tok_s"] for t in turns]
        lines.append(f"{name}: {min(tok_s):.0f}-{max(tok_s):.0f} tok/s a round; restarted worker "
                     f"serving in {runs['restart_s']['serving_after_s']:.1f}s; tokens served "
                     f"by tier {runs['served_tokens']}, after the restart "
                     f"{runs['served_tokens_after_restart']}")  # fmt: skip
    for t in result["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(f"target {t['what']}: {t['value']:.2f} ({t['target']}) {verdict}")
    if "outputs_identical_to_off" in result:
        lines.append(f"outputs identical to the cache-off run: "
                     f"{result['outputs_identical_to_off']}")  # fmt: skip
    return "\n".join(lines)


def run_followups(model_dir: Path, work_dir: Path, contexts: list[int], flags: list[str],
                  start_timeout: float) -> list[dict]:  # fmt: skip
    """For each context length: the context, then it and its answer and 200
    tokens more; what the second request reused, and both TTFTs."""
    results = []

    async def pair(worker: WorkerProcess, length: int, tag: str = "followup") -> dict:
        rng = random.Random(f"{tag}-{length}")
        ids = _tokens(rng, length)
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
            answer = FOLLOWUP_ANSWER
            first = await stream_one(stub, token_request(ids, answer, f"ctx-{length}"), answer,
                                     True)  # fmt: skip
            more = ids + first.output_ids + _tokens(rng, FOLLOWUP_TOKENS)
            second = await stream_one(stub, token_request(more, answer, f"ctx-{length}+"), answer)
        for record in (first, second):
            if record.error is not None:
                raise RuntimeError(f"context {length}: {record.error}")
        return {"context": length, "ttft_ms": first.ttft * 1e3,
                "followup_ttft_ms": second.ttft * 1e3, "followup_cached": second.cached_tokens,
                "reusable": length + len(first.output_ids)}  # fmt: skip

    with default_worker(model_dir, work_dir, flags, "followups", start_timeout) as (worker, _):
        asyncio.run(pair(worker, min(contexts), "warm-up"))  # shapes built; nothing reusable
        for length in contexts:
            first = asyncio.run(pair(worker, length))
            # Other tokens of the same lengths: the attention shapes are built now.
            again = asyncio.run(pair(worker, length, "again"))
            first["again_followup_ttft_ms"] = again["followup_ttft_ms"]
            results.append(first)
            progress(f"followup {length}: cached {first['followup_cached']}, TTFT "
                     f"{first['followup_ttft_ms']:.0f} ms, again "
                     f"{first['again_followup_ttft_ms']:.0f} ms")  # fmt: skip
    return results
