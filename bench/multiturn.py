"""Multi-turn chat workload: our worker with and without its prefix cache.

`conversations` conversations run at once, each sending `turns` turns one after
another. All start with the same system prompt; each turn appends a user
message of fresh tokens, and the next turn resends everything so far plus the
model's answer, as chat clients and agents do. So from turn 2 on, all but the
newest user message was seen before. The worker runs twice on the same token
streams (greedy, so both runs see the same answers): with its default prompt
cache, then with `--prompt-cache-bytes 0`.

The issue's targets: TTFT of turns >= 2 at most 0.25x the cold TTFT at the
same concurrency (judged against the same turns of the run without the cache:
same prompts, same arrival pattern, nothing reused; turn 1 of the cached run
is shown too), and throughput no worse than without the cache.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass

import grpc

from bench.grpc_client import stream_one, token_request
from bench.runner import Options, progress
from bench.stats import RequestRecord, percentile
from bench.workers import WorkerProcess, free_port, ours_command
from bench.workload import PROMPT_ID_RANGE
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

TTFT_TARGET = 0.25  # turns >= 2 over cold, at most
THROUGHPUT_TARGET = 1.0  # with cache over without, at least


@dataclass(frozen=True)
class MultiTurn:
    """The workload's shape: the issue's 8 conversations x 6 turns by default."""

    conversations: int = 8
    turns: int = 6
    system_tokens: int = 512
    turn_tokens: int = 64  # user tokens appended per turn
    answer_tokens: int = 32
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


# `--short`: fewer, shorter conversations over the same prompt sizes.
SHORT_MULTITURN = MultiTurn(conversations=4, turns=3)


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    record: RequestRecord


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(n)]


async def _conversation(
    stub: mlx_engine_pb2_grpc.MlxEngineStub, shape: MultiTurn, seed: int, index: int,
    system: list[int],
) -> list[Turn]:  # fmt: skip
    rng = random.Random(f"{seed}-{index}")
    history, turns = list(system), []
    for turn in range(1, shape.turns + 1):
        ids = history + _tokens(rng, shape.turn_tokens)
        request = token_request(ids, shape.answer_tokens, f"mt-{seed}-{index}-{turn}")
        record = await stream_one(stub, request, shape.answer_tokens, keep_ids=True)
        if record.error is not None:
            raise RuntimeError(f"conversation {index} turn {turn}: {record.error}")
        turns.append(Turn(turn, len(ids), record))
        history = ids + record.output_ids
    return turns


async def _workload(address: str, shape: MultiTurn, seed: int) -> tuple[list[Turn], float]:
    """Every conversation at once; their turns and the wall time of the whole."""
    system = _tokens(random.Random(seed), shape.system_tokens)
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
        began = time.perf_counter()
        runs = await asyncio.gather(
            *(_conversation(stub, shape, seed, i, system) for i in range(shape.conversations))
        )
        wall = time.perf_counter() - began
    return [t for run in runs for t in run], wall


def _ttft(turns: list[Turn]) -> dict:
    values = [t.record.ttft * 1e3 for t in turns]
    return {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99), "n": len(values)}


def _summary(turns: list[Turn], wall: float) -> dict:
    generated = sum(t.record.tokens for t in turns)
    return {
        "ttft_turn1": _ttft([t for t in turns if t.turn == 1]),
        "ttft_later": _ttft([t for t in turns if t.turn >= 2]),
        "generated_tokens": generated,
        "wall_s": wall,
        "tok_s": generated / wall,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.record.cached_tokens for t in turns),
    }


def _run(opts: Options, shape: MultiTurn, cache: bool) -> tuple[dict, list[list[int]]]:
    name = "cache" if cache else "no-cache"
    port = free_port()
    command = ours_command(opts.model_dir, port, opts.workload)
    if not cache:
        command += ["--prompt-cache-bytes", "0"]
    log = opts.work_dir / "logs" / f"multiturn-{name}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    with WorkerProcess(f"ours ({name})", command, port, log) as worker:
        worker.wait_serving(opts.start_timeout_s)
        # Other tokens first (seed + 1): every batch and prompt shape is compiled
        # and allocated, and nothing of it can be reused by the timed run.
        asyncio.run(_workload(worker.address, shape, shape.seed + 1))
        turns, wall = asyncio.run(_workload(worker.address, shape, shape.seed))
    progress(f"multi-turn {name}: {wall:.1f}s")
    return _summary(turns, wall), [t.record.output_ids for t in turns]


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def run_multiturn(opts: Options, shape: MultiTurn) -> dict:
    """Both runs, the ratios and the targets, as the JSON's `multiturn` entry."""
    progress(f"multi-turn: {shape.conversations} conversations x {shape.turns} turns, "
             "our worker with and without its prefix cache")  # fmt: skip
    cached, cached_ids = _run(opts, shape, cache=True)
    cold, cold_ids = _run(opts, shape, cache=False)
    ttft = _ratio(cached["ttft_later"]["p50_ms"], cold["ttft_later"]["p50_ms"])
    throughput = _ratio(cached["tok_s"], cold["tok_s"])
    return {
        "shape": shape.to_dict(),
        "runs": {"cache": cached, "no_cache": cold},
        "ratios": {
            "ttft_later_cache/no_cache p50": ttft,
            "ttft_later_cache/no_cache p99": _ratio(
                cached["ttft_later"]["p99_ms"], cold["ttft_later"]["p99_ms"]
            ),
            "ttft_later/turn1 (cache run) p50": _ratio(
                cached["ttft_later"]["p50_ms"], cached["ttft_turn1"]["p50_ms"]
            ),
            "tok_s cache/no_cache": throughput,
        },
        "targets": [
            {
                "ratio": "ttft_later_cache/no_cache p50",
                "value": ttft,
                "target": f"<= {TTFT_TARGET}",
                "met": ttft <= TTFT_TARGET,
            },
            {
                "ratio": "tok_s cache/no_cache",
                "value": throughput,
                "target": f">= {THROUGHPUT_TARGET}",
                "met": throughput >= THROUGHPUT_TARGET,
            },
        ],
        # Greedy decoding: the cache should not change a token. Batch composition
        # can still differ between the runs, so a mismatch is reported, not fatal.
        "outputs_identical": cached_ids == cold_ids,
    }


def format_multiturn(result: dict) -> str:
    """The multi-turn table: TTFT of turn 1 and of turns >= 2, tok/s, the ratios."""
    header = (
        f"{'multi-turn':<10} {'turn 1 TTFT p50/p99':>21} {'turns>=2 TTFT p50/p99':>23} "
        f"{'tok/s':>7} {'cached/prompt tokens':>21}"
    )
    lines = [header, "-" * len(header)]
    for name, r in result["runs"].items():
        t1, later = r["ttft_turn1"], r["ttft_later"]
        lines.append(
            f"{name:<10} {t1['p50_ms']:>10.1f} / {t1['p99_ms']:<8.1f} "
            f"{later['p50_ms']:>12.1f} / {later['p99_ms']:<8.1f} {r['tok_s']:>7.0f} "
            f"{r['cached_tokens']:>10} / {r['prompt_tokens']:<8}"
        )
    lines.append("(times in ms)")
    for name, value in result["ratios"].items():
        lines.append(f"{name}: {value:.2f}")
    for t in result["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(f"target {t['ratio']}: {t['value']:.2f} ({t['target']}) {verdict}")
    lines.append(f"outputs identical with and without the cache: {result['outputs_identical']}")
    return "\n".join(lines)
