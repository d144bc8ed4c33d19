"""Client-side helpers for the tests: what a router does, in a few lines."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    chunks: list[pb.GenerateStreamChunk] = field(default_factory=list)
    complete: pb.GenerateComplete | None = None


def request(
    ids: list[int] | None = None,
    *,
    request_id: str = "",
    text: str | None = None,
    stream: bool = True,
    **sampling,
) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    req = pb.GenerateRequest(
        request_id=request_id, sampling_params=pb.SamplingParams(**sampling), stream=stream
    )
    if text is not None:
        req.text = text
    elif ids is not None:
        req.tokenized.input_ids.extend(ids)
    return req


def collect(responses) -> Result:
    """Read a Generate call to its end."""
    result = Result()
    for response in responses:
        if response.HasField("chunk"):
            result.chunks.append(response.chunk)
            result.tokens.extend(response.chunk.token_ids)
        else:
            result.complete = response.complete
            result.tokens.extend(response.complete.output_ids)
    return result


def generate(stub, ids: list[int] | None = None, **kwargs) -> Result:
    return collect(stub.Generate(request(ids, **kwargs), timeout=60))


def prompt(length: int, offset: int = 0) -> list[int]:
    """A deterministic prompt of `length` ordinary token ids."""
    return [10 + (offset * 7 + i * 13) % 300 for i in range(length)]


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
