"""Multi-turn chat workload, with and without the prefix cache.

N conversations run at once; each sends T turns one after another. Every
conversation starts with the same system prompt; each turn appends a user
message of fresh tokens, and the next turn resends everything so far plus the
model's answer, as chat clients and agents do. The worker runs twice as a
subprocess, with the prompt cache and with `--prompt-cache-bytes 0`, on the
same token streams (greedy decoding, so both runs see the same answers).

    .venv/bin/python tools/multiturn_bench.py --json-out multiturn.json

Reports time to first token of turn 1 (cold: nothing cached yet) and of
turns 2+, generated tokens per second over the whole workload, and the prompt
tokens the worker reported as cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    latency: float
    output: list[int] = field(repr=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Above 10: the demo tokenizer's special tokens come first.
    return [rng.randrange(10, vocab) for _ in range(n)]


async def wait_healthy(stub: mlx_engine_pb2_grpc.MlxEngineStub, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if (await stub.HealthCheck(pb.HealthCheckRequest(), timeout=2)).healthy:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("the worker did not become healthy")


async def one_turn(stub, ids: list[int], max_tokens: int) -> tuple[float, float, list[int], int]:
    request = pb.GenerateRequest(
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        stream=True,
    )
    request.tokenized.input_ids.extend(ids)
    started = time.perf_counter()
    ttft, output, cached = None, [], 0
    async for response in stub.Generate(request, timeout=600):
        if response.HasField("chunk"):
            if ttft is None and response.chunk.token_ids:
                ttft = time.perf_counter() - started
            output.extend(response.chunk.token_ids)
        else:
            cached = response.complete.cached_tokens
    return ttft, time.perf_counter() - started, output, cached


async def conversation(stub, args, seed: int, index: int, system: list[int], vocab: int):
    rng = random.Random(f"{seed}-{index}")
    history, turns = list(system), []
    for turn in range(1, args.turns + 1):
        ids = history + tokens(rng, args.turn_tokens, vocab)
        ttft, latency, output, cached = await one_turn(stub, ids, args.max_tokens)
        turns.append(Turn(index, turn, len(ids), cached, ttft, latency, output))
        history = ids + output
    return turns


def summarize(turns: list[Turn], wall: float) -> dict:
    def ttft(selected: list[Turn]) -> dict:
        values = [t.ttft * 1000 for t in selected]
        if not values:  # --turns 1
            return {"p50_ms": None, "p99_ms": None, "n": 0}
        return {
            "p50_ms": round(statistics.median(values), 1),
            "p99_ms": round(percentile(values, 99), 1),
            "n": len(values),
        }

    generated = sum(len(t.output) for t in turns)
    return {
        "ttft_turn1": ttft([t for t in turns if t.turn == 1]),
        "ttft_later_turns": ttft([t for t in turns if t.turn >= 2]),
        "generated_tokens": generated,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(generated / wall, 1),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "cached_tokens": sum(t.cached_tokens for t in turns),
    }


async def workload(stub, args, seed: int, vocab: int) -> tuple[list[Turn], float]:
    """Every conversation at once; their turns, and the wall time of the whole."""
    system = tokens(random.Random(seed), args.system_tokens, vocab)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(conversation(stub, args, seed, i, system, vocab) for i in range(args.conversations))
    )
    return [t for r in results for t in r], time.perf_counter() - started


async def run_once(args, model: Path, cache_bytes: int | None) -> tuple[dict, list[Turn]]:
    port = free_port()
    command = [sys.executable, "-m", "smg_mlx", "serve", "--model", str(model)]
    command += ["--port", str(port), "--log-level", "warning"]
    if cache_bytes is not None:
        command += ["--prompt-cache-bytes", str(cache_bytes)]
    worker = subprocess.Popen(command)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
            await wait_healthy(stub, 120)
            await one_turn(stub, [1] * 8, 4)  # first-request costs, sharing no prefix below
            vocab = (await stub.GetModelInfo(pb.GetModelInfoRequest())).vocab_size
            if args.warmup:  # other tokens: every shape once, nothing to reuse below
                await workload(stub, args, args.seed + 1, vocab)
            turns, wall = await workload(stub, args, args.seed, vocab)
    finally:
        worker.terminate()
        worker.wait(60)
    return summarize(turns, wall), turns


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 3)


def build_model(args) -> Path:
    if args.model:
        return args.model
    out = Path(tempfile.mkdtemp(prefix="multiturn-")) / "model"
    subprocess.run(
        [sys.executable, "-m", "smg_mlx.demo_model", str(out), "--hidden-size",
         str(args.hidden_size), "--layers", str(args.layers), "--context-length", "8192",
         "--dtype", args.dtype],
        check=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: build a demo one)")
    parser.add_argument("--hidden-size", type=int, default=256, help="of the built model")
    parser.add_argument("--layers", type=int, default=4, help="of the built model")
    parser.add_argument("--dtype", default="float32", help="of the built model")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=64, help="user tokens per turn")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer tokens per turn")
    parser.add_argument(
        "--prompt-cache-bytes", type=int, help="for the cached run (default: the worker's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warmup",
        action="store_true",
        help="run the workload once on other tokens first (GPUs compile kernels per shape)",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    model = build_model(args)
    runs, outputs = {}, {}
    for name, cache_bytes in (("cache", args.prompt_cache_bytes), ("no_cache", 0)):
        runs[name], turns = asyncio.run(run_once(args, model, cache_bytes))
        outputs[name] = {(t.conversation, t.turn): t.output for t in turns}
    cache, cold = runs["cache"], runs["no_cache"]
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": str(model),
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "later_turn_ttft_over_cold_turn1": ratio(
            cache["ttft_later_turns"]["p50_ms"], cache["ttft_turn1"]["p50_ms"]
        ),
        "later_turn_ttft_cache_over_no_cache": ratio(
            cache["ttft_later_turns"]["p50_ms"], cold["ttft_later_turns"]["p50_ms"]
        ),
        "throughput_cache_over_no_cache": ratio(cache["tokens_per_s"], cold["tokens_per_s"]),
        # Greedy decoding: the cache must not change a single token.
        "outputs_identical": outputs["cache"] == outputs["no_cache"],
    }
    print(f"{'':10} {'turn 1 TTFT p50/p99 ms':>24} {'turns>=2 TTFT p50/p99 ms':>26} "
          f"{'tok/s':>8} {'cached/prompt tokens':>22}")  # fmt: skip
    for name, r in runs.items():
        t1, t2 = r["ttft_turn1"], r["ttft_later_turns"]
        share = f"{r['cached_tokens']}/{r['prompt_tokens']}"
        print(
            f"{name:10} {t1['p50_ms']:>13} / {t1['p99_ms']:<8} {t2['p50_ms']!s:>15} / "
            f"{t2['p99_ms']!s:<8} {r['tokens_per_s']:>8} {share:>22}"
        )
    for key in list(report)[4:]:
        print(f"{key}: {report[key]}")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
