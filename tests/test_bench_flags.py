"""`python -m bench` as a user runs it: flags no run can use are refused before anything
runs, a peer that cannot be installed costs the peer's column only, and a SIGTERM leaves
no child process running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import bench.__main__ as bench_main
from bench import peer, runner
from bench.workload import Workload

from helpers import wait_until


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--concurrency", "0"], "--concurrency: positive integers, comma-separated"),
        (["--concurrency", "1,four"], "not '1,four'"),
        (["--gen-spread", "-10"], "--gen-spread: at least 0, not -10"),
        (["--agent", "--sessions", "0"], "--sessions: at least 1, not 0"),
        (["--speculation", "--speculation-draft", "nonsense"],
         "--speculation-draft: self or a shape (llama-8b, qwen3-0.6b"),
        (["--speculation", "--speculation-kinds", "right,bogus"],
         "--speculation-kinds: each of right, wrong, half; not bogus"),
        (["--agent", "--agent-settings", "default,2gib"], "not 2gib"),
        (["--kv-formats", "16", "--kv-parts", "decode,speed"], "not speed"),
        (["--followups", "4096,-1"], "--followups: positive integers"),
    ],
)  # fmt: skip
def test_flags_no_run_can_use_are_refused_before_anything_runs(argv, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_main.main([*argv, "--work-dir", str(tmp_path / "work")])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # no model built, no worker started


def test_an_out_file_that_cannot_be_written_is_refused_at_the_start(tmp_path, capsys):
    for out, said in ((tmp_path, "a directory; name a file"),
                      (tmp_path / "f" / "x.json", "cannot make its folder")):  # fmt: skip
        (tmp_path / "f").write_text("a file where a folder should be")
        with pytest.raises(SystemExit):
            bench_main.main(["--out", str(out), "--work-dir", str(tmp_path / "work")])
        assert said in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_a_peer_that_cannot_be_installed_is_reported_and_the_rest_still_run(
    monkeypatch, tmp_path
):
    # Offline (the prober's case): pip finds nothing to install.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setattr(peer, "_requirements", lambda: ["smg-grpc-servicer-not-published==0"])
    ran = []

    def worker_round(name, opts, level, kept):
        if name == "peer":
            return original(name, opts, level, kept)
        ran.append(name)
        return [], 1.0, {}

    original = runner._worker_round
    monkeypatch.setattr(runner, "_worker_round", worker_round)
    opts = runner.Options(["ours", "peer"], [1, 4], Workload(), tmp_path, tmp_path, rounds=1)
    results, systems = runner.run_all(opts)
    assert "creating the peer venv failed" in systems["peer"]["error"]
    assert ran == ["ours", "ours"]  # both levels, without the peer
    assert [r.system for r in results] == ["ours", "ours"]


def test_a_sigterm_during_an_engine_round_ends_the_engine_process_too(model_dir, tmp_path):
    command = [sys.executable, "-m", "bench", "--systems", "engine", "--concurrency", "4",
               "--requests", "100000", "--no-agent", "--model", str(model_dir),
               "--work-dir", str(tmp_path), "--system-cpus", "0",
               "--out", str(tmp_path / "out.json")]  # fmt: skip
    bench = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def engine_pids() -> list[int]:
        found = subprocess.run(["pgrep", "-g", str(bench.pid), "-f", "bench.engine_raw"],
                               capture_output=True, text=True)  # fmt: skip
        return [int(pid) for pid in found.stdout.split()]

    try:
        assert wait_until(lambda: bool(engine_pids()), timeout=60)
        (engine,) = engine_pids()
        time.sleep(1.0)  # into its round (of 100,000 requests)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        assert wait_until(lambda: not os.path.exists(f"/proc/{engine}"), timeout=10)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--kv-formats", "16,8"], "--kv-fill-tokens come to 8193 tokens, past the 2048-token"),
        (["--kv-formats", "16", "--kv-parts", "decode", "--kv-context-tokens", "2000"],
         "--kv-context-tokens come to 2080 tokens"),  # its tail of 16 and 64 out
        (["--gate"], "--long-prompt-tokens plus --long-gen-tokens come to 24016 tokens, past "
         "the 2048-token context of {model}: give fewer (or --mixed 0)"),
        (["--prompt-tokens", "2000", "--gen-tokens", "49"], "come to 2049 tokens"),
    ],
)  # fmt: skip
def test_prompts_past_the_models_context_are_refused_before_anything_runs(
    argv, said, model_dir, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exited:
        bench_main.main([*argv, "--model", str(model_dir), "--work-dir", str(tmp_path / "work")])
    assert exited.value.code == 2
    assert said.format(model=model_dir) in capsys.readouterr().err
    assert not (tmp_path / "work").exists()  # no worker started
