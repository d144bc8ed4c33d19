"""Every request field at its extremes, alone and combined at random: each request
either runs to a normal end or is refused with INVALID_ARGUMENT naming the field,
and the worker keeps serving with nothing left behind."""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from helpers import collect, generate, prompt, wait_until

FLOATS = [0.0, -0.0, 1e-45, -1e-45, 1e-30, 0.5, 1.0, 1.5, -1.0, 1e30, -1e30, 3.4e38,
          math.inf, -math.inf, math.nan]  # fmt: skip
UINT32 = [0, 1, 2, 63, 64, 383, 384, 2**31, 2**32 - 1]
INT32 = [-(2**31), -1, 0, 1, 20, 21, 2**31 - 1]
# Each field's extremes: the values a client could send there.
FIELDS = {
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": UINT32,
    "min_p": FLOATS,
    "repetition_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "presence_penalty": FLOATS,
    "logit_bias": [{}, {0: 1e30}, {383: -math.inf}, {-1: 1.0}, {2**31 - 1: 1.0},
                   {t: 100.0 for t in range(0, 384, 3)}, {5: math.nan}],  # fmt: skip
    "max_tokens": UINT32,
    "stop_token_ids": [[], [0], [383], [384], [2**32 - 1], list(range(384)), [7] * 5000],
    "ignore_eos": [True, False],
    "logprobs": INT32,
    "seed": INT32,
}
PROMPTS = {
    "empty": [],
    "one token": [5],
    "at the context end": prompt(63),
    "at the context length": prompt(64),
    "outside the vocabulary": [5, 384],
    "largest id": [2**32 - 1],
}
ENDS = {"length", "stop"}


def build(ids: list[int], fields: dict, request_id: str = "") -> pb.GenerateRequest:
    params = pb.SamplingParams()
    for name, value in fields.items():
        if name == "logit_bias":
            params.logit_bias.update(value)
        elif name == "stop_token_ids":
            params.stop_token_ids.extend(value)
        else:
            setattr(params, name, value)
    req = pb.GenerateRequest(request_id=request_id, sampling_params=params, stream=True)
    req.tokenized.input_ids.extend(ids)
    return req


def outcome(stub, req: pb.GenerateRequest) -> str:
    """"end" for a normal end, else the status code's name and its message."""
    try:
        result = collect(stub.Generate(req, timeout=60))
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    assert result.complete is not None and result.complete.finish_reason in ENDS
    assert result.complete.completion_tokens == len(result.tokens) >= 1
    return "end"


@pytest.fixture(scope="module")
def fuzzed(short_model_dir):
    from conftest import RunningWorker, worker_config

    running = RunningWorker(worker_config(short_model_dir))
    yield running
    running.stop()


def refused_for(result: str, *names: str) -> bool:
    return result.startswith("INVALID_ARGUMENT") and any(n in result for n in names)


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_each_field_at_its_extremes(fuzzed, field):
    for value in FIELDS[field]:
        fields = {field: value}
        if field != "max_tokens":
            fields["max_tokens"] = 3
        result = outcome(fuzzed.stub, build(prompt(5), fields))
        name = "logit_bias" if field == "logit_bias" else field
        assert result == "end" or refused_for(result, name), (field, value, result)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompts_at_their_extremes(fuzzed, name):
    result = outcome(fuzzed.stub, build(PROMPTS[name], {"max_tokens": 3}))
    assert result == "end" or refused_for(result, "token", "prompt"), (name, result)


@pytest.mark.parametrize("request_id", ["", "x" * 100_000, "\x00\n\u2028", "ü" * 300])
def test_request_ids_at_their_extremes(fuzzed, request_id):
    assert outcome(fuzzed.stub, build(prompt(5), {"max_tokens": 2}, request_id)) == "end"


def test_a_request_id_too_long_for_an_abort_to_name_is_refused(fuzzed):
    longest = "x" * (512 << 10)
    result = outcome(fuzzed.stub, build(prompt(5), {"max_tokens": 2}, longest + "x"))
    assert result.startswith("INVALID_ARGUMENT") and "request_id is 524289 bytes" in result
    assert outcome(fuzzed.stub, build(prompt(5), {"max_tokens": 2}, longest)) == "end"
    fuzzed.stub.Abort(pb.AbortRequest(request_ids=[longest]), timeout=10)  # one it can name


def test_random_combinations_at_concurrency(fuzzed):
    rng = random.Random(1)

    def one(i: int) -> str:
        fields = {f: rng.choice(v) for f, v in FIELDS.items() if rng.random() < 0.25}
        fields.setdefault("max_tokens", rng.choice([1, 4, 2**32 - 1]))
        ids = rng.choice(list(PROMPTS.values()) + [prompt(rng.randint(1, 60), i)] * 4)
        return outcome(fuzzed.stub, build(ids, fields))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(240)))
    odd = [r for r in results if r != "end" and not r.startswith("INVALID_ARGUMENT")]
    assert not odd, odd
    assert results.count("end") > 30  # the mix is not all refusals
    assert wait_until(lambda: fuzzed.active_requests() == 0)
    engine = fuzzed.worker.engine
    assert wait_until(lambda: engine.running == 0 and engine.waiting == 0)
    assert len(generate(fuzzed.stub, prompt(4), max_tokens=2).tokens) == 2
