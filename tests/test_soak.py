"""Soak: thousands of requests with random lengths and cancellations (`make soak`).

Marked slow, so `make test` skips it. Prints errors, leaked slots and RSS.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import grpc
import pytest

from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import generate, prompt, request, rss_mb, wait_until

REQUESTS = int(os.environ.get("SOAK_REQUESTS", "10000"))
CONCURRENCY = 64
CANCEL_SHARE = 0.2
# The prefix cache keeps finished requests' KV caches up to this bound: memory
# that grows by design, so the leak check allows for it.
PROMPT_CACHE_BYTES = 128 * 1024 * 1024


async def soak(port: int, rss_after_warmup: list[float]) -> dict[str, int]:
    rng = random.Random(1234)
    counts: dict[str, int] = {}
    queue = iter(range(REQUESTS))
    started = time.monotonic()

    async def client(stub) -> None:
        for i in queue:
            if i == REQUESTS // 20:
                rss_after_warmup.append(rss_mb())
            if i and i % 1000 == 0:
                print(f"  {i} requests sent, {time.monotonic() - started:.0f}s", flush=True)
            max_tokens = rng.randint(1, 64)
            cancel_at = rng.randint(0, max_tokens // 2) if rng.random() < CANCEL_SHARE else None
            req = request(prompt(rng.randint(1, 200), i), max_tokens=max_tokens, ignore_eos=True)
            call = stub.Generate(req, timeout=120)
            outcome = "unfinished"
            try:
                chunks = 0
                async for response in call:
                    if response.HasField("complete"):
                        outcome = response.complete.finish_reason
                        break
                    chunks += 1
                    if cancel_at is not None and chunks > cancel_at:
                        call.cancel()
                        outcome = "cancelled"
                        break
            except grpc.aio.AioRpcError as err:
                outcome = f"error {err.code().name}: {err.details()}"
            counts[outcome] = counts.get(outcome, 0) + 1

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(CONCURRENCY)))
    return counts


@pytest.mark.slow
def test_soak(start_worker, model_dir):
    w = start_worker(model_dir, completion_batch_size=64, prompt_cache_bytes=PROMPT_CACHE_BYTES)
    solo = generate(w.stub, prompt(30, 5), max_tokens=30).tokens
    rss_start = rss_mb()
    rss_warm: list[float] = []
    started = time.monotonic()
    counts = asyncio.run(soak(w.worker.port, rss_warm))
    elapsed = time.monotonic() - started
    engine = w.worker.engine
    assert wait_until(lambda: w.active_requests() == 0, timeout=10)
    assert wait_until(lambda: engine.running == 0 and engine.waiting == 0)
    rss_end = rss_mb()
    errors = {k: v for k, v in counts.items() if k not in {"length", "cancelled"}}
    print(
        f"\nsoak: {REQUESTS} requests in {elapsed:.0f}s at concurrency {CONCURRENCY}; "
        f"outcomes {counts}; errors {sum(errors.values())}; "
        f"leaked slots {w.active_requests()} (engine {engine.running} running, "
        f"{engine.waiting} waiting); "
        f"prefix cache {engine.memory.prefix_cache / 2**20:.0f} MB; "
        f"RSS start {rss_start:.0f} MB, after warm-up {rss_warm[0]:.0f} MB, end {rss_end:.0f} MB"
    )
    assert not errors
    # Some cancels come too late (the request already ended); most do not.
    assert counts["cancelled"] > REQUESTS * CANCEL_SHARE * 0.5
    assert engine.memory.prefix_cache <= PROMPT_CACHE_BYTES
    # One-time allocations happen early; afterwards only the prefix cache grows.
    assert rss_end - rss_warm[0] < PROMPT_CACHE_BYTES / 2**20 + 150
    assert generate(w.stub, prompt(30, 5), max_tokens=30).tokens == solo
