"""An asyncio MlxEngine client: keeps `concurrency` Generate streams in flight.

Both workers speak the same `mlx.grpc.engine.MlxEngine` wire protocol, so our
generated stubs drive the peer as well. One channel (one HTTP/2 connection)
carries every stream, as a router's connection to a worker would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from bench.stats import RequestRecord
from bench.workload import Workload
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

REQUEST_TIMEOUT_S = 600.0


def token_request(
    ids: list[int], max_tokens: int, request_id: str, temperature: float = 0.0
) -> pb.GenerateRequest:
    """Streaming, exactly `max_tokens` tokens (EOS ignored), greedy unless `temperature`."""
    return pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=pb.SamplingParams(
            temperature=temperature, max_tokens=max_tokens, ignore_eos=True
        ),
        stream=True,
    )


def generate_request(
    workload: Workload, index: int, tag: str, temperature: float = 0.0
) -> pb.GenerateRequest:
    """Prompt number `index` of the workload and its answer's length."""
    return token_request(
        workload.prompt(index), workload.answer_tokens(index), f"bench-{tag}-{index}", temperature
    )


async def stream_one(stub: mlx_engine_pb2_grpc.MlxEngineStub, request: pb.GenerateRequest,
                     expected: int, keep_ids: bool = False) -> RequestRecord:  # fmt: skip
    """One streamed request's timeline; `keep_ids` also keeps the generated ids
    (a multi-turn conversation resends them), left off in the throughput loop."""
    record = RequestRecord(output_ids=[] if keep_ids else None)
    start = time.perf_counter()
    finish = None
    try:
        async for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
            if response.HasField("chunk"):
                record.arrived(time.perf_counter() - start, len(response.chunk.token_ids))
                if keep_ids:
                    record.output_ids.extend(response.chunk.token_ids)
            else:
                finish = response.complete.finish_reason
                record.cached_tokens = response.complete.cached_tokens
                # A non-streaming answer would carry the ids here; streamed ones don't.
                record.arrived(time.perf_counter() - start, len(response.complete.output_ids))
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
        return record
    if record.tokens != expected or finish != "length":
        record.error = f"finish {finish!r} after {record.tokens} of {expected} tokens"
    return record


async def closed_loop(
    address: str, workload: Workload, concurrency: int, indices: range, tag: str,
    temperature: Callable[[int], float] = lambda index: 0.0,
) -> tuple[list[RequestRecord], float]:  # fmt: skip
    """Runs the requests with these prompt indices, `concurrency` at a time
    (request `index` at `temperature(index)`).

    Each of `concurrency` slots sends its next request the moment its previous
    one ends. Returns the records and the wall time from first send to last end.
    """
    queue = list(indices)
    queue.reverse()  # pop() from the end hands them out in order
    records: list[RequestRecord] = []
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)

        async def slot() -> None:
            while queue:
                index = queue.pop()
                request = generate_request(workload, index, tag, temperature(index))
                expected = workload.answer_tokens(index)
                record = await stream_one(stub, request, expected)
                record.index = index
                records.append(record)

        begin = time.perf_counter()
        await asyncio.gather(*(slot() for _ in range(concurrency)))
        wall = time.perf_counter() - begin
    return records, wall


def run_closed_loop(
    address: str, workload: Workload, concurrency: int, indices: range, tag: str
) -> tuple[list[RequestRecord], float]:
    """`closed_loop` on a fresh event loop (the bench's main thread is synchronous)."""
    return asyncio.run(closed_loop(address, workload, concurrency, indices, tag))
