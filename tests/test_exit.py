"""The exit codes supervisors act on (launchd KeepAlive, systemd Restart, Kubernetes):
every way a worker ends gives the documented code, every time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from bench.workers import free_port, session_pids
from smg_mlx.engine.core import MAX_FAILED_STEPS_IN_A_ROW
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import (
    NOT_SERVING,
    Process,
    collect,
    generate,
    model_copy,
    prompt,
    request,
    serving_within,
    wait_until,
)

# More with SOAK_EXIT_CYCLES (make soak runs 200); 4 take each signal with and without traffic.
CYCLES = int(os.environ.get("SOAK_EXIT_CYCLES", "4"))


def test_start_stop_cycles_always_exit_zero(spawn, model_dir):
    codes = []
    for i in range(CYCLES):
        p = spawn("--model", str(model_dir))
        p.wait_serving()
        if i % 2:  # with traffic, half of them
            generate(p.stub, prompt(8, i), max_tokens=4)
        codes.append(p.stop(signal.SIGINT if i % 3 == 0 else signal.SIGTERM))
        log = p.log.read_text()
        assert "Traceback" not in log and "terminate called" not in log, log
        p.close()
    assert codes == [0] * CYCLES


# A thread that ran MLX (as the engine thread does: its own stream, compiled
# functions), then the exit the worker uses, in a fresh interpreter. With a
# plain exit instead, MLX's per-thread teardown races interpreter finalization
# and aborts the process (exit -6) in a good share of runs.
MLX_THREAD_THEN_EXIT = textwrap.dedent(
    """
    import threading
    import mlx.core as mx
    from smg_mlx.cli import exit_process

    def work():
        with mx.stream(mx.new_stream(mx.default_device())):
            square = mx.compile(lambda x: x @ x + 1)
            mx.eval(square(mx.random.normal((64, 64))))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    exit_process(0)
    """
)


def test_a_thread_that_ran_mlx_never_spoils_the_exit_code():
    def run(_: int) -> int:
        done = subprocess.run(
            [sys.executable, "-c", MLX_THREAD_THEN_EXIT], capture_output=True, timeout=60
        )
        return done.returncode

    # A plain exit aborted 11 runs of 40: 24 runs miss that but once in a few thousand.
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(run, range(24)))
    assert codes == [0] * 24


@pytest.fixture
def loading_model(model_dir, tmp_path):
    """A model that never finishes loading: reading its tokenizer config blocks
    (a FIFO no one writes), in a thread that lets the event loop run."""
    stuck = model_copy(model_dir, tmp_path / "stuck-model", leave_out="tokenizer_config.json")
    os.mkfifo(stuck / "tokenizer_config.json")
    return stuck


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_model_loads_exits_zero_quietly(spawn, loading_model, sig):
    p = spawn("--model", str(loading_model))
    assert wait_until(lambda: "loading" in p.log.read_text(), 60)
    assert p.check() == NOT_SERVING
    assert p.stop(sig, timeout=15) == 0
    log = p.log.read_text()
    assert "Traceback" not in log and "Exception ignored" not in log, log
    assert "asked to stop while starting" in log


def test_ctrl_c_while_the_engine_process_starts_prints_no_traceback(tmp_path, loading_model):
    """A terminal's Ctrl-C reaches its whole process group, the engine's process
    too, which may still be importing MLX then: it ignores stop signals from its
    start (the worker relays a stop), so the worker stops quietly, exit 0."""
    p = Process(tmp_path, "--model", str(loading_model), session=True)
    try:
        assert wait_until(lambda: "loading" in p.log.read_text(), 60)
        os.killpg(p.proc.pid, signal.SIGINT)
        assert p.proc.wait(15) == 0
        log = p.log.read_text()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert "asked to stop while starting" in log
    finally:
        p.close()


def test_a_demo_worker_stopped_while_it_builds_leaves_no_builder_nor_its_folder(tmp_path):
    """SIGTERM to the worker alone (a supervisor's stop) while --demo builds its
    model on a first run: the build's process ends with it, its folder goes."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads processes from /proc")
    cache = tmp_path / "cache"
    p = Process(tmp_path, "--demo", session=True, env={"XDG_CACHE_HOME": str(cache)})

    def builders() -> list[int]:
        found = []
        for pid in session_pids(p.proc.pid):
            with contextlib.suppress(OSError):  # (ended meanwhile)
                if b"smg_mlx.demo_model" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found

    try:
        assert wait_until(lambda: "building the demo model" in p.log.read_text(), 60)
        assert wait_until(lambda: bool(builders()), 30), p.log.read_text()
        assert p.stop(signal.SIGTERM, timeout=30) == 0
        assert builders() == [] and not list((cache / "smg-mlx").glob(".demo-*.tmp*"))
        assert "asked to stop while starting" in p.log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        p.close()


def test_server_info_while_the_model_loads_says_it_is_loading(spawn, loading_model):
    """What a router or grpcurl sees of a worker that is not ready yet: nothing
    running or waiting, and a serving mode that says why, not an empty one."""
    p = spawn("--model", str(loading_model))
    assert wait_until(lambda: "loading" in p.log.read_text(), 60)
    _, call = p.stub.GetServerInfo.with_call(pb.GetServerInfoRequest(), timeout=10)
    headers = dict(call.initial_metadata())
    assert headers["serving-mode"] == headers["speculative-decoding"] == "loading"
    assert headers["running-requests"] == headers["waiting-requests"] == "0"
    assert "serving mode loading;" in p.log.read_text()
    assert p.stop(signal.SIGTERM, timeout=15) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_before_the_event_loop_runs_exits_zero_quietly(spawn, model_dir, sig):
    p = spawn("--model", str(model_dir))
    assert wait_until(lambda: "starting" in p.log.read_text(), 30)  # importing the rest now
    assert p.stop(sig, timeout=15) == 0
    assert "Traceback" not in p.log.read_text()


# `python -m smg_mlx`, its command-line module held importing until a signal comes.
SLOW_IMPORT = textwrap.dedent(
    """
    import runpy, sys, time
    from pathlib import Path

    importing = Path(sys.argv[1])

    class Held:
        def find_spec(self, name, path, target=None):
            if name == "smg_mlx.cli":
                importing.touch()
                time.sleep(30)

    sys.meta_path.insert(0, Held())
    sys.argv = ["smg_mlx", "serve", "--demo"]
    runpy.run_module("smg_mlx", run_name="__main__")
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_command_line_imports_exits_zero_quietly(tmp_path, sig):
    """The tenth of a second the worker spends importing before its flags are
    read: a supervisor's stop then still ends it with 0."""
    importing = tmp_path / "importing"
    script = tmp_path / "slow_import.py"
    script.write_text(SLOW_IMPORT)
    proc = subprocess.Popen([sys.executable, str(script), str(importing)],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert wait_until(importing.exists, 30)
    proc.send_signal(sig)
    assert proc.wait(15) == 0
    assert "Traceback" not in proc.stderr.read()


def test_a_second_worker_on_a_taken_port_exits_one(start_worker, model_dir, tmp_path):
    first = start_worker(model_dir)  # (in-process: the second's exit is what is tested)
    port = first.worker.port
    second = subprocess.run(
        [sys.executable, "-m", "smg_mlx", "serve", "--model", str(model_dir),
         "--port", str(port)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is in use" in second.stderr
    assert "Failed to add port" not in second.stderr  # gRPC's own line, before ours
    # The first still owns the port and serves.
    assert len(generate(first.stub, prompt(4), max_tokens=2).tokens) == 2


def test_bad_flags_exit_two(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--max-pending", "-3")
    assert p.proc.wait(30) == 2


# The worker's command line, with the engine made to fail at every step once
# the file named by FAIL_FLAG exists. A script file, not `-c`: the engine's
# process runs its top (the patch) again, and not what `__main__` guards.
FAILING_ENGINE = textwrap.dedent(
    """
    import os
    import sys
    from pathlib import Path
    from smg_mlx.cli import main
    from smg_mlx.engine.batch.batch import Batch

    flag, step = Path(os.environ["FAIL_FLAG"]), Batch.step

    def step_or_fail(self, *args):
        if flag.exists():
            raise RuntimeError("injected engine fault")
        return step(self, *args)

    Batch.step = step_or_fail
    if __name__ == "__main__":
        sys.exit(main(sys.argv[1:]))
    """
)


def test_an_engine_failure_ends_the_process_with_one(model_dir, tmp_path):
    port = free_port()
    log = tmp_path / "failing.log"
    flag = tmp_path / "fail"
    script = tmp_path / "failing_engine.py"
    script.write_text(FAILING_ENGINE)
    proc = subprocess.Popen(
        [sys.executable, str(script), "serve", "--model", str(model_dir),
         "--port", str(port)],
        stderr=log.open("w"),
        env={**os.environ, "FAIL_FLAG": str(flag)},
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(60)
            stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
            assert serving_within(port, 60, rpc_timeout=5)
            call = stub.Generate(request(prompt(4), max_tokens=1900, ignore_eos=True), timeout=60)
            # Fails once the client has a token: the request cannot go elsewhere.
            next(call)
            flag.touch()
            with pytest.raises(grpc.RpcError) as err:
                collect(call)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            # One failed step is contained; steps failing again and again end the engine.
            for _ in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
                with pytest.raises(grpc.RpcError):
                    collect(stub.Generate(request(prompt(4), max_tokens=3), timeout=60))
        assert proc.wait(30) == 1  # for the supervisor to restart it
    finally:
        proc.kill()
    assert "injected engine fault" in log.read_text()
