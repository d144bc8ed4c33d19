"""The fault matrix: malformed, oversized and hostile requests.

Each case checks the status code and the message a client sees, and that the
worker still serves a normal request afterwards (see also test_validation).
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from smg_mlx.engine.batch import sampling
from smg_mlx.grpc_stubs import common_pb2, mlx_engine_pb2_grpc
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from helpers import collect, generate, prompt, request, wait_until

GENERATE = "/mlx.grpc.engine.MlxEngine/Generate"
ABORT = "/mlx.grpc.engine.MlxEngine/Abort"
TOKENIZER = "/mlx.grpc.engine.MlxEngine/GetTokenizer"


def assert_still_serving(worker) -> None:
    assert len(generate(worker.stub, prompt(3), max_tokens=2).tokens) == 2
    assert wait_until(lambda: worker.active_requests() == 0)


def send_raw(worker, method: str, payload: bytes):
    """Send bytes as they are, the way a buggy or hostile client would."""
    if method in (GENERATE, TOKENIZER):
        answer = pb.GenerateResponse if method == GENERATE else common_pb2.GetTokenizerChunk
        call = worker.channel.unary_stream(method, response_deserializer=answer.FromString)
        return list(call(payload, timeout=30))
    return worker.channel.unary_unary(method, response_deserializer=pb.AbortResponse.FromString)(
        payload, timeout=30
    )


MALFORMED = [
    ("garbage", GENERATE, b"\xff\xff\xff\xff", "not a valid mlx.grpc.engine.GenerateRequest"),
    ("truncated", GENERATE, b"\x0a\x10ab", "not a valid mlx.grpc.engine.GenerateRequest"),
    ("bad utf-8 in a string", GENERATE, b"\x0a\x02\xff\xfe", "bad UTF-8"),
    # A field sent with the wrong wire type is skipped, which leaves no input.
    ("request_id as a number", GENERATE, b"\x08\x05", "no input"),
    ("abort garbage", ABORT, b"\xff\xff\xff\xff", "not a valid mlx.grpc.engine.AbortRequest"),
    # Each names the file its message is defined in.
    ("tokenizer garbage", TOKENIZER, b"\xff\xff\xff\xff",
     "Wire format was corrupt); build it from proto/common.proto"),
    # Counted before parsing, and refused without a parse (each holds the GIL).
    ("600,000 unknown fields", GENERATE, b"\x98\x06\x01" * 600_000,
     "more than 4160 fields"),
    ("stop ids sent unpacked", GENERATE, b"\x22\x80\x7d" + b"\x50\x07" * 8000,
     "stop_token_ids has at least 4159 entries"),
    ("abort of 600,000 ids", ABORT, b"\x0a\x01x" * 600_000, "at most 1048576"),
    # The health service too: a prober's bytes are told apart from a worker's fault.
    ("health check garbage", "/grpc.health.v1.Health/Check", b"\xff\xff\xff\xff",
     "not a valid grpc.health.v1.HealthCheckRequest"),
    ("health list garbage", "/grpc.health.v1.Health/List", b"\x0a\x10ab",
     "not a valid grpc.health.v1.HealthListRequest"),
]  # fmt: skip


@pytest.mark.parametrize(
    "method,payload,needle", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_message_is_invalid_argument(worker, method, payload, needle):
    with pytest.raises(grpc.RpcError) as err:
        send_raw(worker, method, payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert_still_serving(worker)


def test_request_over_the_size_limit_is_resource_exhausted(worker):
    # 2M ids of 3 bytes each: about 6 MB, over the default 2 MiB limit; refused
    # before any of it reaches Python.
    huge = request([70000] * 2_000_000)
    with pytest.raises(grpc.RpcError) as err:
        list(worker.stub.Generate(huge, timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    assert_still_serving(worker)


def test_huge_repeated_fields_under_the_limit_are_refused_by_validation(worker):
    with pytest.raises(grpc.RpcError) as err:
        list(worker.stub.Generate(request([5] * 2_000_000), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2000000 tokens" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(
            worker.stub.Generate(
                request([5], stop_token_ids=list(range(1000, 500_000))), timeout=60
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids" in err.value.details()
    assert_still_serving(worker)


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.8, "top_k": 4_000_000_000},  # beyond the vocabulary: no filter
        {"temperature": 0.8, "seed": -7},  # int32 seeds may be negative
        {"temperature": 0.8, "top_k": 1, "top_p": 0.01, "min_p": 1.0},
        {"temperature": 100.0, "top_p": 1e-45, "min_p": 1e-45},
        {"logit_bias": {k: 100.0 if k % 2 else -100.0 for k in range(0, 300, 7)}},
        {"repetition_penalty": 0.01, "frequency_penalty": -2.0, "presence_penalty": -2.0},
        {"repetition_penalty": 100.0, "frequency_penalty": 2.0, "presence_penalty": 2.0},
    ],
    ids=[
        "top_k above vocab",
        "negative seed",
        "strictest filters",
        "hottest and tiny filters",
        "largest biases",
        "penalties at their lows",
        "penalties at their highs",
    ],
)
def test_edge_settings_never_reach_the_engine_as_faults(worker, settings):
    r = generate(
        worker.stub, prompt(5, 1) * 4, max_tokens=24, ignore_eos=True, logprobs=20, **settings
    )
    assert len(r.tokens) == 24
    assert r.complete.finish_reason == "length"
    # Penalties apply to repeated tokens: the prompt repeats itself.
    values = [v for c in r.chunks for v in c.output_logprobs.token_logprobs]
    values += [v for c in r.chunks for top in c.output_logprobs.top_logprobs for v in top.values]
    assert len(values) == 24 * 21 and all(math.isfinite(v) for v in values)
    assert_still_serving(worker)


def test_a_request_that_fails_to_start_fails_alone(start_worker, model_dir, monkeypatch):
    broken = sampling.make_sampler

    def make_sampler(settings):
        if settings.seed == 666:
            raise ValueError("sampler exploded")
        return broken(settings)

    monkeypatch.setattr(sampling, "make_sampler", make_sampler)
    w = start_worker(model_dir)
    neighbour = w.stub.Generate(request(prompt(4), max_tokens=200), timeout=60)
    next(neighbour)
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(4), temperature=0.5, seed=666, max_tokens=3)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "could not start" in err.value.details() and "sampler exploded" in err.value.details()
    # The batch it would have joined carries on.
    assert sum(len(c.chunk.token_ids) for c in neighbour) == 199
    assert_still_serving(w)


def test_abort_with_no_ids_or_ten_thousand(worker):
    assert send_raw(worker, ABORT, b"") == pb.AbortResponse()
    running = worker.stub.Generate(request(prompt(4), request_id="victim", max_tokens=1900))
    next(running)
    ids = [f"unknown-{i}" for i in range(10_000)]
    ids[5_000] = "victim"
    worker.stub.Abort(pb.AbortRequest(request_ids=ids), timeout=10)
    last = list(running)[-1]
    assert last.complete.finish_reason == "abort"
    assert_still_serving(worker)


def test_overload_burst_rejects_the_excess_at_once(start_worker, model_dir):
    batch, pending = 2, 4
    w = start_worker(model_dir, completion_batch_size=batch, max_pending=pending)

    async def burst() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{w.worker.port}") as channel:
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)

            async def one(i: int) -> tuple[str, float]:
                req = request(prompt(8, i), max_tokens=150, ignore_eos=True)
                try:
                    last = [r async for r in stub.Generate(req, timeout=60)][-1]
                    return last.complete.finish_reason, loop.time()
                except grpc.aio.AioRpcError as err:
                    assert "full" in err.details()
                    return err.code().name, loop.time()

            return await asyncio.gather(*(one(i) for i in range(4 * pending)))

    ends = asyncio.run(burst())
    served = [t for outcome, t in ends if outcome == "length"]
    refused = [t for outcome, t in ends if outcome == "RESOURCE_EXHAUSTED"]
    assert len(served) == batch + pending and len(refused) == 4 * pending - batch - pending
    # Refusals do not wait for the work in front of them.
    assert max(refused) < min(served)
    assert_still_serving(w)


def test_a_flood_of_large_payloads_past_capacity_is_refused_before_any_is_parsed(
    start_worker, model_dir
):
    w = start_worker(model_dir, completion_batch_size=1, max_pending=1)
    # Hold the one thread that parses large payloads, one after another.
    parsing = threading.Event()
    w.worker.servicer.payload._thread.submit(parsing.wait, 60)
    text = "Hello, world! " * 6000  # 84,000 characters: more than is parsed on the loop
    outcomes: list[str] = []

    def send(i: int) -> None:
        try:
            collect(w.stub.Generate(request(text=f"{i} {text}", max_tokens=2), timeout=60))
            outcomes.append("served")
        except grpc.RpcError as err:
            outcomes.append(err.code().name)

    with ThreadPoolExecutor(8) as pool:
        for i in range(8):
            pool.submit(send, i)
        # Two fit (the batch, one pending): the six others hear so while those wait.
        assert wait_until(lambda: outcomes.count("RESOURCE_EXHAUSTED") == 6, 10), outcomes
        assert len(outcomes) == 6
        parsing.set()
    assert len(outcomes) == 8
    assert_still_serving(w)


def test_an_abort_reaches_a_request_still_waiting_for_the_tokenizer(start_worker, model_dir):
    w = start_worker(model_dir)
    servicer = w.worker.servicer
    tokenizer, tokenizing = servicer.tokenizer, threading.Event()

    class Held:
        bos_token = tokenizer.bos_token

        def encode(self, text: str, **options) -> list[int]:
            tokenizing.wait(30)
            return tokenizer.encode(text, **options)

    servicer.tokenizer = Held()
    asked = request(text="Hello there", request_id="early", max_tokens=400, ignore_eos=True)
    again = request(text="Hello again", request_id="early", max_tokens=4, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        call = pool.submit(lambda: collect(w.stub.Generate(asked, timeout=60)))
        assert wait_until(lambda: w.active_requests() == 1)
        w.stub.Abort(pb.AbortRequest(request_ids=["early"]))
        # Its id is free once Abort returns, while its text is still being tokenized.
        resent = pool.submit(lambda: collect(w.stub.Generate(again, timeout=60)))
        assert wait_until(lambda: w.active_requests() == 2)
        tokenizing.set()
        result = call.result(30)
        served = resent.result(30)
        assert (served.complete.finish_reason, len(served.tokens)) == ("length", 4)
    assert (result.complete.finish_reason, result.tokens) == ("abort", [])
    servicer.tokenizer = tokenizer
    assert_still_serving(w)
