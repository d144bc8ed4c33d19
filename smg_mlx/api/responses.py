"""Protobuf messages of the Generate stream, built from a Job's progress."""

from __future__ import annotations

from collections.abc import Sequence

from smg_mlx.api.jobs import Job
from smg_mlx.engine.types import TokenLogprobs
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb


def output_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprobs]) -> pb.OutputLogProbs:
    return pb.OutputLogProbs(
        token_ids=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=[pb.TopLogProbs(values=e.top_values, token_ids=e.top_ids) for e in entries],
    )


def chunk(job: Job, start: int, end: int) -> pb.GenerateResponse:
    """Tokens `start` to `end` (excluded), with counts as of `end`."""
    tokens = job.tokens[start:end]
    message = pb.GenerateStreamChunk(
        token_ids=tokens,
        prompt_tokens=len(job.spec.prompt),
        completion_tokens=end,
        cached_tokens=job.cached_tokens,
    )
    if job.spec.logprobs is not None:
        message.output_logprobs.CopyFrom(output_logprobs(tokens, job.logprobs[start:end]))
    return pb.GenerateResponse(chunk=message)


def complete(job: Job, *, streamed: bool) -> pb.GenerateResponse:
    """The final message. A streamed request already got its tokens in chunks."""
    message = pb.GenerateComplete(
        finish_reason=job.finish_reason,
        prompt_tokens=len(job.spec.prompt),
        completion_tokens=len(job.tokens),
        cached_tokens=job.cached_tokens,
    )
    if not streamed:
        message.output_ids.extend(job.tokens)
        if job.spec.logprobs is not None:
            message.output_logprobs.CopyFrom(output_logprobs(job.tokens, job.logprobs))
    if job.finish_reason == "stop" and job.tokens:
        message.matched_stop_token_id = job.tokens[-1]
    return pb.GenerateResponse(complete=message)
