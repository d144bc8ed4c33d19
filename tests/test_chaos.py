"""Disconnects, deadlines and abort storms racing with admission leave nothing behind."""

from __future__ import annotations

import asyncio
import random

import grpc

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import generate, prompt, request, wait_until

STREAMS = 64
# The end of every stream the clients did not cancel themselves.
CLEAN_ENDS = {"length", "stop", "abort"}


async def one_stream(stub, rng: random.Random, i: int, fate: str, outcomes: dict) -> None:
    """Run one request whose client misbehaves as `fate` says."""
    length = 1500 if fate == "abort-in-prefill" else rng.randint(4, 300)
    call = stub.Generate(
        request(prompt(length, i), request_id=f"s{i}", max_tokens=rng.randint(1, 300)),
        timeout=0.05 + rng.random() * 0.5 if fate == "deadline" else 60,
    )
    chunks = 0
    cancel_after = rng.randint(0, 12)
    try:
        async for response in call:
            if response.HasField("complete"):
                outcomes[i] = response.complete.finish_reason
                return
            chunks += 1
            if fate == "cancel" and chunks >= cancel_after:
                call.cancel()
                outcomes[i] = "cancelled"
                return
    except asyncio.CancelledError:
        outcomes[i] = "cancelled"
    except grpc.aio.AioRpcError as err:
        outcomes[i] = err.code().name


async def abort_storm(stub, rng: random.Random, fates: dict[int, str], stop: asyncio.Event):
    """Abort ids at random moments: queued, prefilling, decoding, finished, unknown."""
    while not stop.is_set():
        await asyncio.sleep(rng.random() * 0.01)
        ids = [f"s{i}" for i, fate in fates.items() if fate.startswith("abort")]
        rng.shuffle(ids)
        await stub.Abort(pb.AbortRequest(request_ids=ids[:4] + [f"ghost-{rng.random()}"]))


async def storm(port: int, seed: int) -> dict[int, str]:
    rng = random.Random(seed)
    fates = {
        i: rng.choice(["cancel", "cancel", "deadline", "abort", "abort-in-prefill", "complete"])
        for i in range(STREAMS)
    }
    outcomes: dict[int, str] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
        stop = asyncio.Event()
        aborter = asyncio.create_task(abort_storm(stub, rng, fates, stop))
        streams = []
        for i, fate in fates.items():
            streams.append(asyncio.create_task(one_stream(stub, rng, i, fate, outcomes)))
            await asyncio.sleep(rng.random() * 0.005)  # arrivals spread over prefill and decode
        await asyncio.wait_for(asyncio.gather(*streams), 120)
        stop.set()
        await aborter
        # Aborts of requests that are long finished are no-ops.
        await stub.Abort(pb.AbortRequest(request_ids=[f"s{i}" for i in range(STREAMS)]))
    return {i: f"{fates[i]}:{outcomes[i]}" for i in fates}


def test_cancellations_and_abort_storms_leak_nothing(start_worker, model_dir):
    w = start_worker(
        model_dir, completion_batch_size=16, prefill_batch_size=4, prefill_step_size=32
    )
    solo = generate(w.stub, prompt(40, 99), max_tokens=40).tokens
    engine = w.worker.engine
    for seed in range(3):
        results = asyncio.run(storm(w.worker.port, seed))
        for i, result in results.items():
            fate, outcome = result.split(":")
            if fate == "cancel":
                assert outcome in CLEAN_ENDS | {"cancelled"}, (i, result)
            elif fate == "deadline":
                assert outcome in CLEAN_ENDS | {"DEADLINE_EXCEEDED"}, (i, result)
            elif fate == "complete":
                assert outcome in {"length", "stop"}, (i, result)
            else:
                assert outcome in CLEAN_ENDS, (i, result)
        assert any(r.endswith(":abort") for r in results.values())
        assert wait_until(lambda: w.active_requests() == 0, timeout=5)
        assert wait_until(lambda: engine.running == 0 and engine.waiting == 0)
    # The batch is clean: greedy output is what it was before the storms.
    assert generate(w.stub, prompt(40, 99), max_tokens=40).tokens == solo
