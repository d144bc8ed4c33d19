"""Large requests: the lists a request may carry are bounded (each with its flag),
and however large its payload, the worker keeps answering everyone else."""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from pathlib import Path

import grpc
import pytest

from smg_mlx.api.model_info import ModelInfo
from smg_mlx.api.translation import InvalidRequest, check_sizes
from smg_mlx.config import RequestLimits
from smg_mlx.demo_model import build_model
from smg_mlx.engine.batch.sampling import StopTokens
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc as pb_grpc

from helpers import generate, model_copy, prompt, request

QWEN_VOCAB = 151_936
GENERATE = "/mlx.grpc.engine.MlxEngine/Generate"


@pytest.fixture(scope="module")
def wide_model_dir(models_root: Path) -> Path:
    """A Qwen-sized vocabulary: room for lists of 150,000 token ids."""
    return build_model(models_root / "tiny-vocab152k", ["--vocab-size", str(QWEN_VOCAB)])


def test_vocabulary_sized_stop_sets_and_biases_are_refused_naming_the_flag(
    start_worker, wide_model_dir
):
    w = start_worker(wide_model_dir)
    ids = list(range(QWEN_VOCAB))
    random.Random(0).shuffle(ids)
    for settings, field, flag in (
        ({"stop_token_ids": ids[:150_000]}, "stop_token_ids has 150000 entries", "stop-token"),
        # Counted unparsed, up to the most fields a request within the limits has.
        ({"logit_bias": dict.fromkeys(ids, 0.5)}, "logit_bias has at least 4", "logit-bias"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            generate(w.stub, prompt(4), max_tokens=2, **settings)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        assert f"at most 1024 (its --max-{flag}" in err.value.details()
    # The largest lists allowed are served, and the stop set still stops.
    free = generate(w.stub, prompt(9), max_tokens=6, ignore_eos=True).tokens
    stop = free[3]
    stops = [stop, *[t for t in ids if t not in free][:1023]]
    biases = dict.fromkeys(ids[:1024], 0.0)  # no change, but the largest map
    r = generate(w.stub, prompt(9), max_tokens=6, stop_token_ids=stops, logit_bias=biases)
    assert r.tokens == free[: free.index(stop) + 1]
    assert r.complete.finish_reason == "stop" and r.complete.matched_stop_token_id == stop


def test_stop_tokens_answer_as_mlx_lms_automaton_does():
    from mlx_lm.generate import StopSequences

    ids = frozenset({3, 17, 250})
    ours, theirs = StopTokens(ids).matcher(), StopSequences([[t] for t in ids]).matcher()
    for token in [1, 3, 5, 17, 17, 250, 0, 249, 3]:
        assert ours.advance(token) == theirs.advance(token) == (token in ids)


def test_health_answers_at_once_while_large_requests_arrive(spawn, model_dir):
    p = spawn("--model", str(model_dir))
    p.wait_serving()
    # Just under the 2 MiB limit, each a list of 2 million stop ids: refused
    # from their bytes, unparsed (a parse holds the GIL throughout). Parsed on
    # the event loop, thirty of these held health for seconds.
    big = request([5], max_tokens=2)
    big.sampling_params.stop_token_ids.extend([7] * 2_000_000)
    payload = big.SerializeToString()
    send = p.channel.unary_stream(GENERATE)
    codes: list[str] = []

    def one() -> None:
        try:
            list(send(payload, timeout=120))
        except grpc.RpcError as err:
            codes.append(f"{err.code().name}: {err.details()}")

    # A probe has a connection of its own, as Kubernetes' does.
    probe = pb_grpc.MlxEngineStub(grpc.insecure_channel(f"127.0.0.1:{p.port}"))
    assert probe.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
    senders = [threading.Thread(target=one) for _ in range(30)]
    waits = []
    for t in senders:
        t.start()
    while any(t.is_alive() for t in senders):
        started = time.perf_counter()
        assert probe.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy
        waits.append(time.perf_counter() - started)
    print(f"health: {len(waits)} checks, slowest {max(waits) * 1000:.0f} ms")
    # Idle, a health check takes about a millisecond; the margin is for a
    # loaded machine.
    assert max(waits) < 0.5, waits
    # (each began while requests were still arriving; on a fast machine they all
    # arrive within two checks)
    assert waits
    assert len(codes) == 30 and all("--max-stop-token-ids" in c for c in codes), codes


def test_a_request_limit_too_small_for_the_context_is_named_at_start_up(
    start_worker, model_dir, caplog
):
    caplog.set_level(logging.INFO, "smg_mlx")
    start_worker(model_dir, limits=RequestLimits(max_request_bytes=64 << 10))
    records = [r for r in caplog.records if "--max-request-bytes" in r.getMessage()]
    assert len(records) == 1 and records[0].levelname == "WARNING", caplog.text
    said = records[0].getMessage()
    # What a whole-context prompt takes (a plain one fits in 64 KiB: no claim
    # that nothing fits), and the size that takes it whatever else the request
    # carries, which then says nothing.
    takes = re.search(r"whole context \((\d+) tokens\) takes about (\d+) bytes", said)
    assert takes is not None and 0 < int(takes.group(2)) < 64 << 10, said
    fix = re.search(r"set --max-request-bytes (\d+KiB)", said)
    assert fix is not None, said
    caplog.clear()
    start_worker(model_dir, limits=RequestLimits(max_request_bytes=int(fix.group(1)[:-3]) << 10))
    assert "--max-request-bytes" not in caplog.text


def test_counts_in_refusals_are_said_in_the_singular_for_one(start_worker, model_dir):
    info = ModelInfo(str(model_dir), "m", "llama", (), 2048, 384, (2,), None, None)
    one_stop = request(prompt(4), stop_token_ids=[5]).SerializeToString()
    with pytest.raises(InvalidRequest) as err:
        check_sizes(one_stop, info, RequestLimits(max_stop_token_ids=0), 10_000)
    assert "stop_token_ids has 1 entry; this worker takes at most 0" in str(err.value)
    w = start_worker(model_dir, completion_batch_size=1, max_pending=0)
    running = w.stub.Generate(request(prompt(4), max_tokens=1900), timeout=60)
    next(running)
    with pytest.raises(grpc.RpcError) as full:
        generate(w.stub, prompt(4), max_tokens=2)
    running.cancel()
    assert (
        "the worker is full (1 request in flight: the most it takes: --completion-batch-size 1 "
        "+ --max-pending 0; 1 running); retry on another worker or later"
    ) == full.value.details()


def test_a_context_no_request_limit_can_hold_is_said_with_the_most_the_flag_takes(
    start_worker, model_dir, tmp_path, caplog
):
    """Advice the flag would refuse helps no one: past --max-request-bytes' most, the
    warning says how long a prompt that most holds."""
    vast = model_copy(model_dir, tmp_path / "m", max_position_embeddings=10**12)
    with caplog.at_level("WARNING", logger="smg_mlx.server"):
        start_worker(vast)
    [said] = [r.getMessage() for r in caplog.records if "--max-request-bytes" in r.getMessage()]
    most = re.search(r"at its most \((\d+) bytes\) --max-request-bytes takes prompts of up "
                     r"to (\d+) tokens", said)  # fmt: skip
    assert most is not None and "for any such request to fit" not in said, said
    assert int(most.group(1)) == (1 << 31) - 1
    assert 0 < int(most.group(2)) * 2 + (64 << 10) <= int(most.group(1))  # (2-byte varints)
