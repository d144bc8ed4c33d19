"""A response never outgrows one message a client can receive (--max-response-bytes):
a non-streamed request that could is refused before it runs, not after."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from smg_mlx.api import responses, streaming
from smg_mlx.api.jobs import Job
from smg_mlx.api.model_info import ModelInfo
from smg_mlx.api.translation import generation_spec
from smg_mlx.config import RequestLimits
from smg_mlx.demo_model import build_model
from smg_mlx.engine.types import GenerationSpec, LogitsSettings, SamplingSettings, TokenLogprobs
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import collect, generate, prompt, request

GRPC_DEFAULT_MESSAGE_BYTES = 4 << 20  # what gRPC clients and the router receive by default


@pytest.fixture(scope="module")
def long_model_dir(models_root: Path) -> Path:
    """A 64k-token context: room for a response larger than one message."""
    return build_model(
        models_root / "tiny-ctx64k", ["--context-length", "65536"]
    )


def test_a_response_too_large_for_one_message_is_refused_before_it_runs(
    start_worker, long_model_dir
):
    w = start_worker(long_model_dir)
    generated = "smg_mlx_generation_tokens_total"
    before = w.worker.metrics.registry.get_sample_value(generated)
    # 40,000 tokens with 20 logprobs each: about 5 MiB in the final message.
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(5), max_tokens=40_000, logprobs=20, stream=False)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fits = responses.tokens_within(GRPC_DEFAULT_MESSAGE_BYTES, 384, 20)
    for needle in (
        "40000 tokens with 20 logprobs each",
        f"{GRPC_DEFAULT_MESSAGE_BYTES} bytes",
        "--max-response-bytes",
        "stream",
        "fewer logprobs",
        f"max_tokens to at most {fits}",
    ):
        assert needle in err.value.details()
    assert w.worker.metrics.registry.get_sample_value(generated) == before
    # Streamed, the same request is served.
    call = w.stub.Generate(request(prompt(5), max_tokens=40_000, logprobs=20), timeout=60)
    assert len(next(call).chunk.output_logprobs.top_logprobs[0].values) == 20
    call.cancel()


def test_without_max_tokens_a_non_streamed_response_ends_where_one_message_is_full(
    start_worker, model_dir
):
    limit = 64 << 10
    w = start_worker(model_dir, limits=RequestLimits(max_response_bytes=limit))
    channel = grpc.insecure_channel(
        f"127.0.0.1:{w.worker.port}", options=[("grpc.max_receive_message_length", limit)]
    )
    stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
    req = request(prompt(5), logprobs=20, ignore_eos=True, stream=False)
    r = collect(stub.Generate(req, timeout=60))
    assert r.complete.finish_reason == "length"
    assert len(r.tokens) == responses.tokens_within(limit, 384, 20) == 481
    # A stream carries the tokens past that, in messages within the limit too.
    req = request(prompt(5), logprobs=20, ignore_eos=True, max_tokens=600)
    assert len(collect(stub.Generate(req, timeout=60)).tokens) == 600
    channel.close()


def _job(tokens: int, vocab_size: int, logprobs: int | None) -> Job:
    spec = GenerationSpec(
        prompt=(1, 2, 3),
        max_tokens=tokens,
        stop_token_ids=frozenset(),
        sampling=SamplingSettings(),
        logits=LogitsSettings(),
        logprobs=logprobs,
    )
    job = Job("r", spec)
    largest = vocab_size - 1  # the longest varint
    job.tokens = [largest] * tokens
    if logprobs is not None:
        top = TokenLogprobs(-1.5, (largest,) * logprobs, (-2.5,) * logprobs)
        job.logprobs = [top] * tokens
    job.finish_reason = "length"
    return job


@pytest.mark.parametrize(
    "vocab_size,logprobs", [(384, 20), (151_936, 20), (151_936, 0), (151_936, None)]
)
def test_the_largest_response_allowed_fits_one_message(vocab_size, logprobs):
    limit = GRPC_DEFAULT_MESSAGE_BYTES
    fits = responses.tokens_within(limit, vocab_size, logprobs)
    size = responses.complete(_job(fits, vocab_size, logprobs), streamed=False).ByteSize()
    assert limit - 2 * responses.RESERVED_BYTES < size <= limit


def test_generation_spec_caps_only_non_streamed_responses():
    info = ModelInfo("m", "m", "llama", ("LlamaForCausalLM",), 65536, 384, (2,), None, None)
    limits = RequestLimits()
    fits = responses.tokens_within(limits.max_response_bytes, 384, 20)
    for stream, expected in ((False, fits), (True, 65536 - 5)):
        req = request(prompt(5), logprobs=20, stream=stream)
        spec = generation_spec(req, info, prompt(5), 10**6, limits)
        assert spec.max_tokens == expected


def test_a_reader_that_fell_behind_gets_its_tokens_in_chunks_within_the_limit():
    job = _job(100, 384, 20)

    async def sizes() -> list[int]:
        stream = streaming.chunks(job, True, lambda: 50, most=8)
        return [len(m.chunk.token_ids) async for m in stream]

    got = asyncio.run(sizes())
    assert sum(got) == 100 and max(got) == 8
