"""Start-up, health, info RPCs, engine failure and graceful shutdown."""

from __future__ import annotations

import hashlib
import io
import json
import re
import signal
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smg_mlx.api.model_info import load_model_info
from smg_mlx.engine.batch.batch import Batch
from smg_mlx.engine.core import MAX_FAILED_STEPS_IN_A_ROW
from smg_mlx.grpc_stubs import common_pb2, mlx_engine_pb2_grpc
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.server import ONE_STOP_SECONDS, load_tokenizer

from helpers import (
    NOT_SERVING,
    SERVING,
    collect,
    generate,
    model_copy,
    prompt,
    request,
    wait_until,
)

ENGINE = "mlx.grpc.engine.MlxEngine"


def test_health_not_serving_until_ready_then_serving(spawn, model_dir):
    p = spawn("--model", str(model_dir))
    grpc.channel_ready_future(p.channel).result(60)
    watch = p.health.Watch(health_pb2.HealthCheckRequest(service=ENGINE), timeout=60)
    # The server listens before the model is loaded and says NOT_SERVING until
    # it is ready (the tiny model may be ready before the watch starts: the
    # router test holds the load to see that phase for certain).
    seen = [next(watch).status]
    while seen[-1] != SERVING:
        seen.append(next(watch).status)
    assert set(seen[:-1]) <= {NOT_SERVING}
    assert p.check() == SERVING and p.check(ENGINE) == SERVING
    assert p.stub.HealthCheck(pb.HealthCheckRequest()).healthy
    # Watch keeps streaming: shutdown shows up on it, and then it ends, OK
    # (left open, the server's stop would cancel it: UNAVAILABLE).
    p.proc.send_signal(signal.SIGTERM)
    assert next(watch).status == NOT_SERVING
    assert list(watch) == []
    assert p.proc.wait(30) == 0


def test_sigterm_lets_in_flight_requests_finish(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--shutdown-grace-seconds", "20")
    p.wait_serving()
    call = p.stub.Generate(request(prompt(5), max_tokens=400), timeout=60)
    next(call)
    p.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: p.check() == NOT_SERVING, 2)
    with pytest.raises(grpc.RpcError) as err:
        p.stub.HealthCheck(pb.HealthCheckRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:
        generate(p.stub, prompt(3), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in err.value.details()
    rest = collect(call)
    assert rest.complete.finish_reason == "length" and rest.complete.completion_tokens == 400
    assert p.proc.wait(30) == 0
    assert "Traceback" not in p.log.read_text()


def test_a_hang_up_drains_as_sigterm_does_unless_nohup_ignores_it(spawn, model_dir):
    # Closing the terminal a foreground worker runs in sends SIGHUP. A child
    # inherits an ignored SIGHUP (nohup's way; the test runner's may ignore it too).
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        kept = spawn("--model", str(model_dir))
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        p = spawn("--model", str(model_dir))
    finally:
        signal.signal(signal.SIGHUP, previous)
    kept.wait_serving()
    p.wait_serving()
    call = p.stub.Generate(request(prompt(5), max_tokens=300, ignore_eos=True), timeout=60)
    next(call)
    kept.proc.send_signal(signal.SIGHUP)
    p.proc.send_signal(signal.SIGHUP)
    assert collect(call).complete.finish_reason == "length"  # let finish, as SIGTERM does
    assert p.proc.wait(30) == 0
    assert "shutting down" in p.log.read_text()
    assert kept.proc.poll() is None and kept.check() == SERVING


def test_sigterm_aborts_what_outlives_the_grace_period(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--shutdown-grace-seconds", "0.5")
    p.wait_serving()
    calls = [p.stub.Generate(request(prompt(5, i), max_tokens=2000), timeout=60) for i in range(4)]
    for c in calls:
        next(c)
    started = time.monotonic()
    assert p.stop() == 0
    assert time.monotonic() - started < 10
    for c in calls:
        assert collect(c).complete.finish_reason == "abort"
    assert "Traceback" not in p.log.read_text()


def test_past_the_grace_streams_end_with_abort_while_the_engine_is_still_in_a_step(
    start_worker, model_dir, monkeypatch
):
    """A long prompt's chunk on a slow machine holds a step for seconds: past
    the grace, a stream still open ends with "abort" at once, not once that
    step ends (nor cut off by the server's own stop)."""
    w = start_worker(model_dir, shutdown_grace_seconds=0.2)
    channel = grpc.insecure_channel(f"127.0.0.1:{w.worker.port}")  # (stop closes w's)
    call = mlx_engine_pb2_grpc.MlxEngineStub(channel).Generate(
        request(prompt(5), max_tokens=2000), timeout=60
    )
    next(call)
    held, release = threading.Event(), threading.Event()
    step = Batch.step

    def slow(self, *args, **kwargs):
        held.set()
        release.wait(30)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Batch, "step", slow)
    assert held.wait(10)
    stopping = threading.Thread(target=w.stop)
    stopping.start()
    try:
        rest = collect(call)
        assert rest.complete.finish_reason == "abort"
        assert not release.is_set() and held.is_set()  # the step had not ended
    finally:
        release.set()
        stopping.join(60)
        channel.close()
    assert w.exit_code == 0


def test_past_the_grace_requests_without_a_token_are_for_another_worker(spawn, model_dir):
    """Requests still waiting for their first token when the grace ends get
    UNAVAILABLE (the router retries those on another worker), not an empty OK,
    and are logged (and counted) as turned away at a stop, not as failures;
    one that streamed ends with "abort"."""
    p = spawn("--model", str(model_dir), "--shutdown-grace-seconds", "0.5",
              "--completion-batch-size", "1", "--prefill-batch-size", "1")  # fmt: skip
    p.wait_serving()
    calls = [p.stub.Generate(request(prompt(5, i), max_tokens=2000), timeout=60) for i in range(3)]
    first = next(calls[0])  # the batch holds one: the others wait
    assert first.chunk.token_ids
    # (All three in before the stop: one that came later would be turned away unread.)
    info = pb.GetServerInfoRequest()
    assert wait_until(lambda: p.stub.GetServerInfo(info).active_requests == 3, 10)
    assert p.stop() == 0
    assert collect(calls[0]).complete.finish_reason == "abort"
    for call in calls[1:]:
        with pytest.raises(grpc.RpcError) as err:
            collect(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "had no token yet: send it to another worker" in err.value.details()
    log = p.log.read_text()
    assert "waiting up to 0.5s" in log
    ends = re.findall(r"request done .* finish_reason=(\w+)", log)
    assert sorted(ends) == ["abort", "shutdown", "shutdown"], ends


def test_at_a_stop_requests_waiting_for_a_place_go_to_another_worker_at_once(spawn, model_dir):
    """A stop turns away the requests still waiting for a place in the batch
    at once (UNAVAILABLE, for the router to retry elsewhere), rather than
    keeping them for a grace in which they may never start; the running one
    still finishes within it."""
    p = spawn("--model", str(model_dir), "--shutdown-grace-seconds", "60",
              "--completion-batch-size", "1", "--prefill-batch-size", "1")  # fmt: skip
    p.wait_serving()
    running = p.stub.Generate(request(prompt(5), max_tokens=300, ignore_eos=True), timeout=60)
    assert next(running).chunk.token_ids
    waiting = [p.stub.Generate(request(prompt(5, i), max_tokens=8), timeout=60)
               for i in (1, 2)]  # fmt: skip

    def queued() -> bool:
        _, call = p.stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
        return dict(call.initial_metadata())["waiting-requests"] == "2"

    assert wait_until(queued, 10)
    p.proc.send_signal(signal.SIGTERM)
    for call in waiting:
        with pytest.raises(grpc.RpcError) as err:
            collect(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "had no token yet: send it to another worker" in err.value.details()
    # (with a place freed within the grace, they would have started and ended "length")
    rest = collect(running)
    assert rest.complete.finish_reason == "length" and rest.complete.completion_tokens == 300
    assert p.proc.wait(30) == 0
    log = p.log.read_text()
    assert "2 requests still waiting for a place in the batch turned away" in log
    assert "shutting down: 1 request in flight" in log  # the running one alone
    ends = re.findall(r"request done .* finish_reason=(\w+)", log)
    assert sorted(ends) == ["length", "shutdown", "shutdown"], ends
    # Those turned away had no first token: their lines give no time to it.
    assert "ttft_ms=None" not in log and log.count("ttft_ms=") == 1


def test_sigterm_under_load_ends_every_stream_cleanly(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--shutdown-grace-seconds", "2")
    p.wait_serving()
    # Short requests finish within the grace period, long ones outlive it.
    lengths = [30 if i % 2 else 1900 for i in range(16)]
    calls = [
        p.stub.Generate(request(prompt(20, i), max_tokens=n, ignore_eos=True), timeout=60)
        for i, n in enumerate(lengths)
    ]
    for c in calls:
        next(c)
    with ThreadPoolExecutor(len(calls)) as pool:
        ends = [pool.submit(collect, c) for c in calls]
        p.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: p.check() == NOT_SERVING, 1)
        reasons = [e.result(timeout=10).complete.finish_reason for e in ends]
    assert reasons == ["length" if n == 30 else "abort" for n in lengths]
    assert p.proc.wait(30) == 0
    assert "Traceback" not in p.log.read_text()


def test_model_that_cannot_load_exits_non_zero_with_the_cause(refused, model_dir, tmp_path):
    broken = model_copy(model_dir, tmp_path / "broken-model", leave_out="model.safetensors")
    (broken / "model.safetensors").write_text("not safetensors")  # (none at all exits 2)
    refusal = refused(broken)
    assert refusal.exit_code == 1
    assert f"cannot serve {broken}: model load failed: RuntimeError: [load_safetensors]" in str(
        refusal
    )


def test_not_a_model_directory_is_refused_at_once(spawn, tmp_path):
    p = spawn("--model", str(tmp_path / "nowhere"))
    assert p.proc.wait(30) == 2
    assert "not a model directory" in p.log.read_text()


def test_steps_that_keep_failing_end_the_engine_and_the_worker(
    start_worker, model_dir, monkeypatch
):
    from smg_mlx.engine.batch.batch import Batch

    failing = threading.Event()
    step = Batch.step

    def step_or_fail(self, *args):
        if failing.is_set():
            raise RuntimeError("injected fault")
        return step(self, *args)

    monkeypatch.setattr(Batch, "step", step_or_fail)
    w = start_worker(model_dir)
    health = health_pb2_grpc.HealthStub(w.channel)
    calls = [w.stub.Generate(request(prompt(4, i), max_tokens=1900), timeout=60) for i in range(3)]
    for c in calls:
        next(c)
    failing.set()
    for c in calls:
        with pytest.raises(grpc.RpcError) as err:
            collect(c)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in err.value.details()
    # One failed step is contained; steps failing again and again end the engine.
    for _ in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        with pytest.raises(grpc.RpcError) as err:
            generate(w.stub, prompt(3), max_tokens=2)
        assert "injected fault" in err.value.details()
    assert wait_until(lambda: health.Check(health_pb2.HealthCheckRequest()).status == NOT_SERVING)
    with pytest.raises(grpc.RpcError) as err:
        w.stub.HealthCheck(pb.HealthCheckRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "injected fault" in err.value.details()
    assert w.active_requests() == 0
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(3), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert w.stop() == 1


def test_a_model_named_by_a_relative_path_is_reported_by_its_absolute_one(model_dir, monkeypatch):
    """The router reads the reported directory where it can, from its own
    working directory: `--model models/m` must not reach it as `models/m`."""
    monkeypatch.chdir(model_dir.parent)
    relative = Path(model_dir.name)
    info = load_model_info(relative, load_tokenizer(relative), None)
    assert info.model_path == str(model_dir)


def test_a_tokenizer_larger_than_the_vocabulary_is_warned_of_at_start(model_dir, tmp_path, caplog):
    tokenizer = load_tokenizer(model_dir)
    smaller = model_copy(model_dir, tmp_path / "m", vocab_size=len(tokenizer) - 8)
    info = load_model_info(smaller, tokenizer, None)
    assert info.vocab_size == len(tokenizer) - 8
    assert (
        f"the tokenizer has {len(tokenizer)} tokens and the model's vocabulary "
        f"{len(tokenizer) - 8}: prompts that tokenize to ids {len(tokenizer) - 8} and above"
    ) in caplog.text
    caplog.clear()
    load_model_info(model_dir, tokenizer, None)  # the model's own: nothing to say
    assert "the tokenizer has" not in caplog.text


def test_one_architecture_named_alone_is_reported_as_a_list_of_one(model_dir, tmp_path):
    named = model_copy(model_dir, tmp_path / "m", architectures="LlamaForCausalLM")
    info = load_model_info(named, load_tokenizer(model_dir), None)
    assert info.architectures == ("LlamaForCausalLM",)  # not one letter an entry


def test_model_info(worker, model_dir):
    info = worker.stub.GetModelInfo(pb.GetModelInfoRequest())
    config = json.loads((model_dir / "config.json").read_text())
    assert info.model_path == str(model_dir)
    assert info.served_model_name == model_dir.name
    assert info.is_generation
    assert info.max_context_length == 2048 and info.max_req_input_len == 2047
    assert info.vocab_size == config["vocab_size"]
    assert list(info.eos_token_ids) == [config["eos_token_id"]]
    assert info.bos_token_id == config["bos_token_id"]
    assert info.pad_token_id == config["pad_token_id"]
    assert info.model_type == "llama" and list(info.architectures) == ["LlamaForCausalLM"]


def test_served_model_name_flag(start_worker, model_dir):
    w = start_worker(model_dir, served_model_name="my-model")
    assert w.stub.GetModelInfo(pb.GetModelInfoRequest()).served_model_name == "my-model"


def test_server_info_counts_active_requests(worker):
    info = worker.stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.server_type == "mlx-grpc" and info.active_requests == 0
    assert info.uptime_seconds > 0
    call = worker.stub.Generate(request(prompt(4), max_tokens=1900), timeout=60)
    next(call)
    assert worker.active_requests() == 1
    call.cancel()
    assert wait_until(lambda: worker.active_requests() == 0)


def test_tokenizer_zip_with_checksum(worker, model_dir):
    chunks = list(worker.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(c.sha256 == "" for c in chunks[:-1])
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(names)
    assert "model.safetensors" not in names
    tokenizer = zipfile.ZipFile(io.BytesIO(data)).read("tokenizer.json")
    assert tokenizer == (model_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_position_embeddings": 0}, "context length of 0"),
        ({"max_position_embeddings": "lots"}, "max_position_embeddings"),
        ({"vocab_size": 0}, "vocab_size of 0"),
    ],
)
def test_a_model_config_that_cannot_be_served_is_refused_at_start(
    refused, model_dir, tmp_path, changes, message
):
    broken = model_copy(model_dir, tmp_path / "absurd-model", **changes)
    refusal = refused(broken)
    assert refusal.exit_code == 2  # the config is to be fixed: a restart cannot cure it
    assert message in str(refusal)


def test_a_huge_context_or_odd_token_ids_are_reported_within_range(
    start_worker, model_dir, tmp_path
):
    odd = model_copy(
        model_dir,
        tmp_path / "odd-model",
        max_position_embeddings=2**40,
        pad_token_id=-1,
        eos_token_id=[2, 10**12],
    )
    w = start_worker(odd)
    info = w.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_context_length == 2**32 - 1 and info.pad_token_id == 0
    assert list(info.eos_token_ids) == [2]
    assert len(generate(w.stub, prompt(4), max_tokens=3).tokens) == 3


def test_a_second_stop_request_ends_the_grace_period(start_worker, model_dir, monkeypatch):
    from smg_mlx.engine.batch.batch import Batch

    step = Batch.step

    def slow_step(self, *args):
        time.sleep(0.02)  # 1900 tokens take far longer than the test waits
        return step(self, *args)

    monkeypatch.setattr(Batch, "step", slow_step)
    w = start_worker(model_dir, shutdown_grace_seconds=600)
    # A channel of its own: stopping the test worker closes the worker's.
    with grpc.insecure_channel(f"127.0.0.1:{w.worker.port}") as channel:
        call = mlx_engine_pb2_grpc.MlxEngineStub(channel).Generate(
            request(prompt(4), max_tokens=1900), timeout=120
        )
        next(call)
        w.loop.call_soon_threadsafe(w.worker.request_stop)
        stopping = ThreadPoolExecutor(1).submit(w.stop)
        time.sleep(ONE_STOP_SECONDS + 0.2)  # (a second signal, not the first delivered twice)
        assert not stopping.done()  # draining: the stream may finish
        w.loop.call_soon_threadsafe(w.worker.request_stop)
        assert stopping.result(timeout=15) == 0
        assert collect(call).complete.finish_reason == "abort"


def test_an_engine_that_stopped_but_cannot_exit_does_not_hold_up_the_stop(
    start_worker, model_dir, monkeypatch
):
    """As an engine process whose write to a hung disk the system holds: it said it
    stopped, yet it does not end. The worker kills it once the grace (2 s) and a
    second are up, and exits 0, where it had waited 30 s more and exited 1."""
    w = start_worker(model_dir, shutdown_grace_seconds=2.0)
    engine, killed = w.worker.engine, []
    monkeypatch.setattr(engine, "join", lambda timeout=None: bool(time.sleep(timeout or 0)))
    monkeypatch.setattr(engine, "kill", lambda: killed.append(time.monotonic()))
    began = time.monotonic()
    w.loop.call_soon_threadsafe(w.worker.request_stop)
    stopping = ThreadPoolExecutor(1).submit(w.stop)
    assert stopping.result(timeout=20) == 0
    assert len(killed) == 1 and 2.0 < killed[0] - began < 6.0


def test_a_health_check_of_an_unknown_service_names_the_services_reported(worker):
    health = health_pb2_grpc.HealthStub(worker.channel)
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="bogus"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert err.value.details() == (
        "unknown service 'bogus'; this worker reports '', 'mlx.grpc.engine.MlxEngine'"
    )
    assert health.Check(health_pb2.HealthCheckRequest(service=ENGINE)).status == SERVING
    # Newer health clients list every service at once.
    listed = health.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {name: s.status for name, s in listed.items()} == {"": SERVING, ENGINE: SERVING}
