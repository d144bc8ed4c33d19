"""Protobuf messages of the Generate stream, built from a Job's progress, and
how large they can grow."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from smg_mlx.api.jobs import Job
from smg_mlx.engine.types import TokenLogprobs
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

# Room in a message for everything but its tokens: counts, finish_reason,
# field tags and length prefixes (well under this).
RESERVED_BYTES = 1024


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


@functools.lru_cache(maxsize=64)
def bytes_per_token(vocab_size: int, logprobs: int | None) -> int:
    """The most bytes one output token adds to a message (a chunk or a
    non-streamed final message): its id and, if asked, its logprobs, all ids
    the largest (their varints are the longest). Measured on the messages
    themselves, so it follows the proto."""

    def size(n: int) -> int:
        ids = [vocab_size - 1] * n
        message = pb.GenerateComplete(output_ids=ids)
        if logprobs is not None:
            top = TokenLogprobs(0.0, (vocab_size - 1,) * logprobs, (0.0,) * logprobs)
            message.output_logprobs.CopyFrom(output_logprobs(ids, [top] * n))
        return message.ByteSize()

    return size(2) - size(1)


def tokens_within(limit: int, vocab_size: int, logprobs: int | None) -> int:
    """The most tokens one message of at most `limit` bytes can carry (at least
    one: a message carries one token whatever its size)."""
    return max(1, (limit - RESERVED_BYTES) // bytes_per_token(vocab_size, logprobs))
