"""Mixed load (`--mixed`): long prompts queued, chats arriving, one stream running.

One fresh worker with its default flags (`--worker-args` adds some) runs three phases:

1. idle: a few chats one after another, alone (their time to first token);
2. longs alone: `--mixed` long prompts at once, nothing else, twice: the
   first time untimed, to build the kernels and attention graphs of their shapes
   (mlx's CUDA backend builds one per new shape), which the mixed phase would
   otherwise find built and the timed one not;
3. mixed: a stream starts first; then as many other long prompts at once, and
   a chat every `--chat-interval` seconds until the long ones are done.

The report: the chats' TTFT p50 and max in both phases, the running stream's
longest pause between two messages and its p99 inter-token latency while the
long prompts ran, how long the long prompts took in both phases and the ratio,
the health statuses seen, and the most memory MLX had against its budget. Every
phase has prompts of its own, so the prefix cache cannot help one with another.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.grpc_client import stream_one, token_request
from bench.long_prompts import default_worker, memory_figures, watch_health
from bench.workload import PROMPT_ID_RANGE, Workload
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc
from smg_mlx.logs import format_bytes


@dataclass(frozen=True)
class Mixed:
    longs: int = 16
    long_tokens: int = 24_000
    long_gen_tokens: int = 16
    chat_tokens: int = 64
    chat_gen_tokens: int = 32
    chat_interval_s: float = 1.0
    idle_chats: int = 5


def _long_requests(mixed: Mixed, seed: int, tag: str) -> list[pb.GenerateRequest]:
    workload = Workload(prompt_tokens=mixed.long_tokens, seed=seed)
    return [
        token_request(workload.prompt(i), mixed.long_gen_tokens, f"{tag}-{i}")
        for i in range(mixed.longs)
    ]


async def _longs(stub: mlx_engine_pb2_grpc.MlxEngineStub, requests: list[pb.GenerateRequest],
                 gen: int) -> tuple[float, list[str]]:  # fmt: skip
    """The long prompts at once: seconds until the last is done, and their errors."""
    begin = time.perf_counter()
    records = await asyncio.gather(*(stream_one(stub, r, gen) for r in requests))
    return time.perf_counter() - begin, [r.error for r in records if r.error]


async def _chats(stub: mlx_engine_pb2_grpc.MlxEngineStub, mixed: Mixed, seed: int,
                 until: asyncio.Future | None) -> list[float | None]:  # fmt: skip
    """Chats one by one (`until` is None) or one every interval until `until` is done;
    their TTFTs in seconds (None: failed)."""
    tasks, index = [], 0
    prompts = Workload(prompt_tokens=mixed.chat_tokens, seed=seed)
    while (index < mixed.idle_chats) if until is None else not until.done():
        prompt = prompts.prompt(index)
        request = token_request(prompt, mixed.chat_gen_tokens, f"chat{seed}-{index}")
        task = asyncio.ensure_future(stream_one(stub, request, mixed.chat_gen_tokens))
        tasks.append(task)
        index += 1
        if until is None:
            await task
        else:
            await asyncio.wait([until], timeout=mixed.chat_interval_s)
    records = await asyncio.gather(*tasks)
    return [r.ttft if r.error is None else None for r in records]


async def _stream(stub: mlx_engine_pb2_grpc.MlxEngineStub, tokens: int, gen: int,
                  started: asyncio.Event, arrivals: list[tuple[float, int]]) -> None:  # fmt: skip
    """One long answer, its messages' (time, tokens) kept, until cancelled."""
    low, _ = PROMPT_ID_RANGE
    call = stub.Generate(token_request([low + i % 200 for i in range(tokens)], gen, "stream"))
    async for response in call:
        if response.HasField("chunk"):
            arrivals.append((time.perf_counter(), len(response.chunk.token_ids)))
            started.set()


def _gaps(arrivals: list[tuple[float, int]], begin: float, end: float) -> dict:
    """The stream's pauses between messages within [begin, end] (its wait for the
    first one in it, and after the last, included), and its inter-token latency."""
    inside = [(t, n) for t, n in arrivals if begin <= t <= end]
    times = [begin, *(t for t, _ in inside), end]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # A message of n tokens after a pause of g: n tokens of g / n each (bench.stats).
    itl = sorted(g / n for g, (_, n) in zip(gaps, inside, strict=False) for _ in range(n))
    return {
        "stream_messages": len(inside),
        "stream_longest_gap_s": max(gaps, default=None),
        "stream_itl_p99_s": itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else None,
    }


def _ttfts(values: list[float | None]) -> dict:
    done = sorted(v for v in values if v is not None)
    return {
        "chats": len(values),
        "chats_failed": len(values) - len(done),
        "chat_ttft_p50_s": statistics.median(done) if done else None,
        "chat_ttft_max_s": done[-1] if done else None,
    }


async def _run(address: str, mixed: Mixed) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
        health: set[str] = set()
        watcher = asyncio.ensure_future(watch_health(channel, health))
        idle = _ttfts(await _chats(stub, mixed, seed=1, until=None))
        await _longs(stub, _long_requests(mixed, 5, "warm-up"), mixed.long_gen_tokens)
        alone_s, alone_errors = await _longs(
            stub, _long_requests(mixed, 2, "alone"), mixed.long_gen_tokens
        )
        # Made before the stream starts: the client's own work on them would
        # otherwise delay the stream's messages it reads, counted as the worker's.
        queued = _long_requests(mixed, 3, "mixed")
        arrivals: list[tuple[float, int]] = []
        started = asyncio.Event()
        # As long as a long prompt: its cache reserves no more than theirs.
        stream = asyncio.ensure_future(
            _stream(stub, mixed.chat_tokens, mixed.long_tokens, started, arrivals)
        )
        await asyncio.wait([asyncio.ensure_future(started.wait()), stream],
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if not started.is_set():  # it ended (refused) before its first token
            failed = stream.exception()
            said = failed.details() if isinstance(failed, grpc.aio.AioRpcError) else failed
            raise RuntimeError(f"the running stream ended before its first token: {said}")
        begin = time.perf_counter()
        longs = asyncio.ensure_future(_longs(stub, queued, mixed.long_gen_tokens))
        chats = _ttfts(await _chats(stub, mixed, seed=4, until=longs))
        mixed_s, mixed_errors = longs.result()
        end = time.perf_counter()
        stream.cancel()
        watcher.cancel()
    return {
        "idle": idle,
        "longs_alone_s": alone_s,
        "longs_mixed_s": mixed_s,
        "longs_mixed_over_alone": mixed_s / alone_s,
        "long_errors": alone_errors + mixed_errors,
        "mixed": {**chats, **_gaps(arrivals, begin, end)},
        "stream_ended_early": stream.done() and not stream.cancelled(),
        "health_seen": sorted(health),
    }


def run_mixed(model_dir: Path, work_dir: Path, mixed: Mixed, extra: list[str],
              timeout_s: float) -> dict:  # fmt: skip
    """One fresh worker, its default flags and `extra`; the three phases' outcome."""
    with default_worker(model_dir, work_dir, extra, "mixed", timeout_s) as (worker, metrics):
        outcome = asyncio.run(_run(worker.address, mixed))
        outcome.update(memory_figures(metrics))
    outcome.update(workload=asdict(mixed), flags=extra, log=str(worker.log_path))
    return outcome


def format_mixed(r: dict) -> str:
    def ms(s: float | None) -> str:
        return "n/a" if s is None else f"{1000 * s:.0f} ms"

    m, idle = r["mixed"], r["idle"]
    return "\n".join(
        [
            f"chat TTFT p50 / max: idle {ms(idle['chat_ttft_p50_s'])} / "
            f"{ms(idle['chat_ttft_max_s'])}; mixed {ms(m['chat_ttft_p50_s'])} / "
            f"{ms(m['chat_ttft_max_s'])} ({m['chats']} chats, {m['chats_failed']} failed)",
            f"running stream: longest gap {ms(m['stream_longest_gap_s'])}, ITL p99 "
            f"{ms(m['stream_itl_p99_s'])} ({m['stream_messages']} messages)",
            f"long prompts: alone {r['longs_alone_s']:.1f} s, mixed {r['longs_mixed_s']:.1f} s "
            f"(x{r['longs_mixed_over_alone']:.2f}), errors: {r['long_errors'] or 'none'}",
            f"health seen: {'/'.join(r['health_seen'])}; peak memory "
            f"{format_bytes(r['peak_bytes'] or 0)} of {format_bytes(r['budget_bytes'] or 0)}",
        ]
    )
