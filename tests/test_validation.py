"""Bad requests get a clear status and message, and the worker keeps serving."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from helpers import collect, generate, prompt, request, rss_mb, wait_until

GENERATE = "/mlx.grpc.engine.MlxEngine/Generate"

BAD_REQUESTS = [
    ("no input", pb.GenerateRequest(request_id="x"), "no input"),
    ("empty prompt", request([]), "no tokens"),
    ("empty text", request(text=""), "text is empty"),
    ("token outside vocabulary", request([1, 2, 99999]), "outside the vocabulary"),
    ("prompt at context length", request(prompt(2048)), "context length"),
    ("max_tokens 0", request([5, 6], max_tokens=0), "max_tokens"),
    ("negative temperature", request([5, 6], temperature=-0.5), "temperature"),
    ("nan temperature", request([5, 6], temperature=float("nan")), "temperature"),
    ("top_p above 1", request([5, 6], top_p=1.5), "top_p"),
    ("negative top_p", request([5, 6], top_p=-0.1), "top_p"),
    ("min_p above 1", request([5, 6], min_p=2.0), "min_p"),
    ("logprobs too many", request([5, 6], logprobs=21), "logprobs"),
    ("negative logprobs", request([5, 6], logprobs=-1), "logprobs"),
    ("logit_bias outside vocabulary", request([5, 6], logit_bias={100000: 1.0}), "logit_bias"),
    ("stop token outside vocabulary", request([5, 6], stop_token_ids=[100000]),
     "stop_token_ids has 100000, outside the vocabulary (ids must be below 384)"),
    # Values that made logprobs NaN: each refused with its allowed range.
    ("tiny repetition penalty", request([5, 6], repetition_penalty=1e-45),
     "repetition_penalty must be 0 (unset) or in [0.01, 100], got 1.4013e-45"),
    ("huge frequency penalty", request([5, 6], frequency_penalty=-3e38),
     "frequency_penalty must be in [-2, 2]"),
    ("huge presence penalty", request([5, 6], presence_penalty=1e30),
     "presence_penalty must be in [-2, 2]"),
    ("huge logit bias", request([5, 6], logit_bias={7: 1e30}),
     "logit_bias[7] must be in [-100, 100], got 1e+30"),
    ("huge temperature", request([5, 6], temperature=1e38), "temperature must be in [0, 100]"),
]  # fmt: skip


@pytest.mark.parametrize(
    "req,needle", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_is_invalid_argument(worker, req, needle):
    with pytest.raises(grpc.RpcError) as err:
        list(worker.stub.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    # The worker is unharmed.
    assert len(generate(worker.stub, prompt(3), max_tokens=2).tokens) == 2
    assert worker.active_requests() == 0


def test_prompt_one_below_context_is_served(worker):
    r = generate(worker.stub, prompt(2047), max_tokens=5)
    assert len(r.tokens) == 1 and r.complete.finish_reason == "length"


@pytest.mark.parametrize("dup", ["dup", "L" * 20_000], ids=["short", "over 16 KiB"])
def test_request_id_in_flight_is_already_exists(worker, dup):
    """(An id longer than a status message may be, 16 KiB for grpcio's
    clients, is shortened there: not a RESOURCE_EXHAUSTED of the client's own.)"""
    first = worker.stub.Generate(request(prompt(4), request_id=dup, max_tokens=500), timeout=60)
    next(first)  # running now
    with pytest.raises(grpc.RpcError) as err:
        generate(worker.stub, prompt(4), request_id=dup, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert dup[:100] in err.value.details() and len(err.value.details()) < 1000
    first.cancel()
    assert wait_until(lambda: worker.active_requests() == 0)
    # Free again once the first one has ended.
    assert len(generate(worker.stub, prompt(4), request_id=dup, max_tokens=2).tokens) == 2


def test_full_queue_is_resource_exhausted(start_worker, model_dir):
    w = start_worker(model_dir, completion_batch_size=1, prefill_batch_size=1, max_pending=1)
    calls = [w.stub.Generate(request(prompt(4, i), max_tokens=2000), timeout=60) for i in range(2)]
    assert wait_until(lambda: w.active_requests() == 2)
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(4), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "full" in err.value.details()
    for c in calls:
        c.cancel()
    assert wait_until(lambda: w.active_requests() == 0)
    assert len(generate(w.stub, prompt(4), max_tokens=2).tokens) == 2


def test_abort_frees_running_and_queued_requests(start_worker, model_dir):
    w = start_worker(model_dir, completion_batch_size=1, prefill_batch_size=1)
    ids = ["run", "queued-1", "queued-2"]
    calls = [
        w.stub.Generate(request(prompt(4, i), request_id=r, max_tokens=5000), timeout=60)
        for i, r in enumerate(ids)
    ]
    # One runs (the batch holds one), two wait; arrival order is the server's.
    assert wait_until(lambda: w.active_requests() == 3)
    w.stub.Abort(pb.AbortRequest(request_ids=[*ids, "no-such-request"]))
    for call in calls:
        last = list(call)[-1]
        assert last.complete.finish_reason == "abort"
    assert w.active_requests() == 0
    assert w.worker.engine.running == 0
    assert len(generate(w.stub, prompt(4), max_tokens=3).tokens) == 3


def test_an_aborted_id_may_be_sent_again_as_soon_as_abort_returns(worker):
    first = worker.stub.Generate(
        request(prompt(4), request_id="again", max_tokens=5000), timeout=60
    )
    next(first)
    worker.stub.Abort(pb.AbortRequest(request_ids=["again"]))
    # Not ALREADY_EXISTS, though the aborted stream may not have ended yet.
    second = generate(worker.stub, prompt(4, 1), request_id="again", max_tokens=3)
    assert len(second.tokens) == 3
    assert list(first)[-1].complete.finish_reason == "abort"
    # An abort of the id now reaches no one; a third request with it runs whole.
    worker.stub.Abort(pb.AbortRequest(request_ids=["again"]))
    assert len(generate(worker.stub, prompt(4, 2), request_id="again", max_tokens=3).tokens) == 3
    assert wait_until(lambda: worker.active_requests() == 0)


def test_abort_of_unknown_id_is_a_no_op(worker):
    worker.stub.Abort(pb.AbortRequest(request_ids=["never-seen"]))
    worker.stub.Abort(pb.AbortRequest())
    assert len(generate(worker.stub, prompt(3), max_tokens=2).tokens) == 2


def test_client_cancellation_frees_the_slot(worker):
    call = worker.stub.Generate(request(prompt(4), max_tokens=5000), timeout=60)
    next(call), next(call)
    call.cancel()
    assert wait_until(lambda: worker.active_requests() == 0, timeout=2)
    assert wait_until(lambda: worker.worker.engine.running == 0, timeout=2)


def test_deadline_frees_the_slot(worker):
    with pytest.raises(grpc.RpcError) as err:
        list(worker.stub.Generate(request(prompt(4), max_tokens=1900), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: worker.active_requests() == 0, timeout=2)
    assert wait_until(lambda: worker.worker.engine.running == 0, timeout=2)


def test_abort_ends_non_streaming_request_too(worker):
    done = {}

    def run():
        done["r"] = generate(worker.stub, prompt(4), request_id="ns", max_tokens=1900, stream=False)

    t = threading.Thread(target=run)
    t.start()
    assert wait_until(lambda: worker.active_requests() == 1)
    worker.stub.Abort(pb.AbortRequest(request_ids=["ns"]))
    t.join(10)
    assert done["r"].complete.finish_reason == "abort"
    assert len(done["r"].tokens) == done["r"].complete.completion_tokens < 1900


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing(worker, monkeypatch):
    tokenizer = worker.worker.servicer.tokenizer
    monkeypatch.setattr(tokenizer, "encode", lambda text: pytest.fail("tokenized"))
    with pytest.raises(grpc.RpcError) as err:
        generate(worker.stub, text="x" * 1_000_000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the text has 1000000 characters" in err.value.details()
    assert "send a shorter prompt" in err.value.details()


def test_tokenizing_a_text_never_blocks_the_event_loop(worker, monkeypatch):
    tokenizer = worker.worker.servicer.tokenizer
    encode, release = tokenizer.encode, threading.Event()

    def slow_encode(text, **options):
        release.wait(30)  # a text that takes long to tokenize
        return encode(text, **options)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    call = worker.stub.Generate(request(text="Hello there", max_tokens=3), timeout=60)
    replies = threading.Thread(target=lambda: list(call), daemon=True)
    replies.start()
    try:
        # The loop answers other calls meanwhile, token-id requests included.
        assert worker.stub.HealthCheck(pb.HealthCheckRequest(), timeout=5).healthy
        assert len(generate(worker.stub, prompt(3), max_tokens=2).tokens) == 2
    finally:
        release.set()
    replies.join(30)
    assert wait_until(lambda: worker.active_requests() == 0)


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-38, 1e-45])
def test_a_tiny_temperature_is_greedy(worker, temperature):
    greedy = generate(worker.stub, prompt(9), max_tokens=12, ignore_eos=True)
    tiny = generate(worker.stub, prompt(9), max_tokens=12, ignore_eos=True, temperature=temperature)
    assert tiny.tokens == greedy.tokens


def test_text_beyond_capacity_is_refused_at_once_not_after_tokenizing(
    start_worker, model_dir, monkeypatch
):
    w = start_worker(model_dir, completion_batch_size=1, prefill_batch_size=1, max_pending=1)
    tokenizer = w.worker.servicer.tokenizer
    # Texts the tokenizer takes but the context does not: refused after
    # tokenizing, each gives its place back.
    for _ in range(3):
        with pytest.raises(grpc.RpcError) as err:
            generate(w.stub, text="lorem ipsum " * 3000, max_tokens=2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    encode, release = tokenizer.encode, threading.Event()

    def slow_encode(text, **options):
        release.wait(30)  # a long text, taking its time
        return encode(text, **options)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    # The batch (1) and --max-pending (1) are taken by two texts being tokenized.
    calls = [
        w.stub.Generate(request(text=f"Hello {i}", max_tokens=2), timeout=60) for i in range(2)
    ]
    replies = [threading.Thread(target=lambda c=c: list(c), daemon=True) for c in calls]
    for t in replies:
        t.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            collect(w.stub.Generate(request(text="Hello", max_tokens=2), timeout=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "full (2 requests in flight: " in err.value.details()
    finally:
        release.set()
    for t in replies:
        t.join(30)
    assert all(c.code() == grpc.StatusCode.OK for c in calls)
    assert len(generate(w.stub, text="Hello", max_tokens=2).tokens) == 2


def test_memory_taken_by_a_flood_of_texts_is_given_back(spawn, model_dir):
    """400 texts of 130,000 characters at once, against a worker that takes 48:
    most are refused at once, the rest after tokenizing. What they took (their
    bytes, their token ids) is given back: gRPC keeps each refused call's
    exception, and its traceback the request, in cycles only a full collection
    frees, and an idle worker ran none; about 200 MB stayed."""
    p = spawn("--model", str(model_dir), "--max-pending", "16")
    p.wait_serving()
    generate(p.stub, text="Hello", max_tokens=2)
    before = rss_mb(p.proc.pid)
    payload = request(text=("lorem ipsum dolor " * 8000)[:130_000]).SerializeToString()

    async def flood() -> list[str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{p.port}") as channel:
            send = channel.unary_stream(GENERATE)

            async def one() -> str:
                try:
                    async for _ in send(payload, timeout=120):
                        pass
                except grpc.aio.AioRpcError as err:
                    return err.code().name
                return "OK"

            return await asyncio.gather(*(one() for _ in range(400)))

    codes = asyncio.run(flood())
    assert set(codes) == {"RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"}, codes
    # A second after the flood; allow for what a first flood leaves (about 10 MB).
    assert wait_until(lambda: rss_mb(p.proc.pid) < before + 64, timeout=20), (
        before,
        rss_mb(p.proc.pid),
    )
