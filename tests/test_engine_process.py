"""The engine in a process of its own (`smg-mlx serve` runs it so): it serves as an
engine thread does, dies with the worker, and its death fails the worker loudly."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from bench.workers import free_port
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import collect, generate, prompt, request, serving_within, wait_until


def engine_pid(worker_pid: int) -> int:
    """The worker's engine process (the spawned child that is not multiprocessing's
    resource tracker)."""
    found = subprocess.run(
        ["pgrep", "-P", str(worker_pid), "-f", "spawn_main"], capture_output=True, text=True
    ).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone but for its exit code (its parent, killed, cannot reap it).
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_it_serves_what_an_engine_thread_serves(worker, start_worker, model_dir, caplog):
    caplog.set_level(logging.INFO, "smg_mlx")
    own = start_worker(model_dir, engine_process=True)
    ids = prompt(12, 5)
    expected = generate(worker.stub, ids, max_tokens=16).tokens
    assert len(set(expected)) > 1  # the model's output varies: the equality means something
    assert generate(own.stub, ids, max_tokens=16).tokens == expected
    # Its log lines reach the worker's log, under their own loggers.
    assert any(r.name.startswith("smg_mlx.engine.") and "warm-up" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert own.stop() == 0


def test_killing_the_worker_ends_its_engine_process(spawn, model_dir):
    p = spawn("--model", str(model_dir))
    p.wait_serving()
    engine = engine_pid(p.proc.pid)
    p.proc.kill()
    p.proc.wait()
    # Nothing is left holding the model's memory (the engine notices its pipe close).
    assert wait_until(lambda: not alive(engine), 30)


def test_a_killed_engine_fails_its_requests_and_the_worker_exits_one(spawn, model_dir):
    p = spawn("--model", str(model_dir))
    p.wait_serving()
    call = p.stub.Generate(request(prompt(4), max_tokens=1900, ignore_eos=True), timeout=60)
    next(call)
    os.kill(engine_pid(p.proc.pid), signal.SIGKILL)  # as the system does when memory runs out
    with pytest.raises(grpc.RpcError) as err:
        collect(call)
    assert "killed by SIGKILL" in err.value.details()
    p.proc.send_signal(signal.SIGTERM)  # as mlx.launch does to what is left of its group
    assert p.proc.wait(30) == 1  # for the supervisor to restart it
    said = p.log.read_text()
    assert "the engine process was killed by SIGKILL" in said
    assert "asked again to stop" not in said  # the first signal is the first request
    # No grace is waited for: what was in flight ended with the engine.
    assert "in flight end with the engine" in said and "waiting up to" not in said


def test_ctrl_c_in_a_terminal_drains_and_exits_zero(model_dir, tmp_path):
    # A terminal's Ctrl-C signals the whole process group, the engine's process too.
    port = str(free_port())
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "smg_mlx", "serve", "--model", str(model_dir), "--port", port],
        stderr=log.open("w"),
        start_new_session=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
            grpc.channel_ready_future(channel).result(60)
            assert serving_within(int(port), 60, rpc_timeout=5), log.read_text()
            call = stub.Generate(request(prompt(4), max_tokens=64, ignore_eos=True), timeout=60)
            next(call)
            time.sleep(0.1)
            os.killpg(proc.pid, signal.SIGINT)
            # The request in flight still finishes: the engine ignored the signal.
            assert collect(call).complete.finish_reason == "length"
        assert proc.wait(60) == 0, log.read_text()
    finally:
        proc.kill()
    assert "Traceback" not in log.read_text()


def test_a_stop_signal_delivered_twice_at_once_is_one_stop(spawn, model_dir):
    """`kill %1` of the README's `make serve &` signals the job's process group,
    and make passes SIGTERM on to the worker too: one stop, delivered twice in a
    moment, not a second request that aborts what is running."""
    p = spawn("--model", str(model_dir))
    p.wait_serving()
    call = p.stub.Generate(request(prompt(4), max_tokens=1000, ignore_eos=True), timeout=60)
    next(call)
    p.proc.send_signal(signal.SIGTERM)
    p.proc.send_signal(signal.SIGTERM)
    assert collect(call).complete.finish_reason == "length"
    assert p.proc.wait(60) == 0
    assert "asked again to stop" not in p.log.read_text()


def test_a_stop_ends_within_its_grace_while_the_engine_is_stuck_in_a_step(spawn, model_dir):
    # A stopped engine process stands in for a step that outlasts the grace (a
    # long prompt's chunk of a request already aborted, on a slow machine).
    p = spawn("--model", str(model_dir), "--shutdown-grace-seconds", "1")
    p.wait_serving()
    engine = engine_pid(p.proc.pid)
    os.kill(engine, signal.SIGSTOP)
    began = time.monotonic()
    assert p.stop() == 0  # no request was open: nothing was lost
    assert time.monotonic() - began < 6  # the grace and a second, not the step's end
    assert wait_until(lambda: not alive(engine), 10)
    assert "the engine was still in a step" in p.log.read_text()


def test_an_engine_stuck_in_a_step_fails_its_requests_and_the_worker_exits_one(spawn, model_dir):
    # A stopped engine process stands in for a step that never ends (a hung GPU).
    p = spawn("--model", str(model_dir), "--watchdog-seconds", "1")
    p.wait_serving()
    engine = engine_pid(p.proc.pid)
    call = p.stub.Generate(request(prompt(4), max_tokens=1900, ignore_eos=True), timeout=60)
    next(call)
    os.kill(engine, signal.SIGSTOP)
    with pytest.raises(grpc.RpcError) as err:
        collect(call)
    assert err.value.code() == grpc.StatusCode.INTERNAL  # (the stream had begun)
    assert "the engine is stuck: one step has run" in err.value.details()
    assert p.proc.wait(30) == 1  # for the supervisor to restart it
    assert wait_until(lambda: not alive(engine), 10)  # its memory is freed for the restart
    assert "reporting NOT_SERVING" in p.log.read_text()
    # The limit in force was said at start-up.
    # (A loaded machine's slowest step expected may make it longer than asked.)
    said = re.search(r"watchdog: a step running past ([\d.]+)s counts as the engine stuck "
                     r"\(--watchdog-seconds 1[;)]", p.log.read_text())  # fmt: skip
    assert said is not None and float(said[1]) >= 1


def test_an_engine_that_takes_up_no_request_fails_the_worker(spawn, model_dir):
    # Stopped while idle, it is between steps: the request handed over says it is stuck.
    p = spawn("--model", str(model_dir), "--watchdog-seconds", "1")
    p.wait_serving()
    os.kill(engine_pid(p.proc.pid), signal.SIGSTOP)
    with pytest.raises(grpc.RpcError) as err:
        collect(p.stub.Generate(request(prompt(4), max_tokens=8), timeout=60))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # (no token yet: the router retries)
    assert "the engine is stuck: a request handed to it has waited" in err.value.details()
    assert p.proc.wait(30) == 1


def test_a_stop_counts_the_requests_in_flight_not_those_whose_clients_left(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--watchdog-seconds", "0", "--shutdown-grace-seconds", "1")
    p.wait_serving()
    running = p.stub.Generate(request(prompt(4), max_tokens=1900, ignore_eos=True), timeout=60)
    next(running)
    os.kill(engine_pid(p.proc.pid), signal.SIGSTOP)
    left = p.stub.Generate(request(prompt(5), max_tokens=8), timeout=60)
    time.sleep(0.5)  # handed to the engine, which never takes it up
    left.cancel()
    time.sleep(0.5)
    p.proc.send_signal(signal.SIGTERM)
    assert collect(running).complete.finish_reason == "abort"  # at the grace
    p.proc.wait(30)
    said = p.log.read_text()
    assert "shutting down: 1 request in flight" in said
    assert "turned away" not in said  # its client had left: nobody to turn away
