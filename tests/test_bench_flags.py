"""`python -m bench` as a user runs it: flags no run can use are refused before anything
runs, a peer that cannot be installed costs the peer's column only, and a SIGTERM leaves
no child process running."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bench.__main__ as bench_main
from bench import peer, runner
from bench.workload import Workload

from helpers import wait_until


def nothing_ran(work: Path) -> bool:
    """No model built and no worker started under the work folder (made, at most)."""
    return not work.exists() or not any(work.iterdir())


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--concurrency", "0"], "--concurrency: positive integers, comma-separated"),
        (["--concurrency", "1,four"], "not '1,four'"),
        (["--gen-spread", "-10"], "--gen-spread: at least 0, not -10"),
        (["--agent", "--sessions", "0"], "--sessions: at least 1, not 0"),
        (["--speculation", "--speculation-draft", "nonsense"],
         "--speculation-draft: self or a shape (llama-1b, llama-8b, qwen3-0.6b"),
        (["--speculation", "--speculation-kinds", "right,bogus"],
         "--speculation-kinds: each of right, wrong, half, again; not bogus"),
        (["--agent", "--agent-settings", "default,2gib"], "not 2gib"),
        (["--kv-formats", "16", "--kv-parts", "decode,speed"], "not speed"),
        (["--followups", "4096,-1"], "--followups: positive integers"),
        (["--systems", ""], "--systems: some of engine, ours, peer, 2ranks, not ''"),
        (["--systems", "engine,foo"], "not 'engine,foo'"),
        (["--start-timeout", "0"], "--start-timeout: above 0"),
        (["--host-bound-ms", "nan"], "--host-bound-ms: at least 0, not nan"),
        (["--warmup", "-1"], "--warmup: at least 0"),
        (["--agent-cache-bytes", "abc"], "--agent-cache-bytes: expected a size"),
        (["--kv-formats", "16,3"], "--kv-formats: each of 16 (the model's own), 8, 4; not 16,3"),
        (["--worker-args", '"unbalanced'], "No closing quotation"),
        (["--worker-args", "--port 52430"], "--worker-args: --port the bench sets itself"),
        (["--model", "/nonexistent"], "--model /nonexistent: not a folder"),
        (["--agent", "--followups", "256"], "--agent and --followups: one run at a time"),
        (["--gate", "--speculation"], "--gate and --speculation: one run at a time"),
        (["--mixed", "0"], "--mixed 0: only with --gate"),
        (["--mixed", "1", "--chat-tokens", "0"], "--chat-tokens: at least 1, not 0"),
        (["--long-prompts", "2", "--long-gen-tokens", "0"], "--long-gen-tokens: at least 1"),
    ],
)  # fmt: skip
def test_flags_no_run_can_use_are_refused_before_anything_runs(argv, said, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_main.main([*argv, "--work-dir", str(tmp_path / "work")])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    assert nothing_ran(tmp_path / "work")


def test_an_out_file_or_work_dir_that_cannot_be_written_is_refused_at_the_start(
    tmp_path, capsys
):
    (tmp_path / "f").write_text("a file where a folder should be")
    work = ["--work-dir", str(tmp_path / "work")]
    for argv, said in (
        (["--out", str(tmp_path), *work], "a directory; name a file"),
        (["--out", str(tmp_path / "f" / "x.json"), *work], "cannot write there"),
        (["--out", "/proc/x.json", *work], "cannot write there"),  # (as root too)
        (["--work-dir", str(tmp_path / "f")], "--work-dir " + str(tmp_path / "f")),
    ):
        with pytest.raises(SystemExit) as exited:
            bench_main.main(argv)
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
    assert nothing_ran(tmp_path / "work")


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
        # the gate's throughput part, beside a mixed run of prompts that fit
        (["--gate", "--mixed", "2", "--long-prompt-tokens", "100", "--prompt-tokens", "2000"],
         "--prompt-tokens plus --gen-tokens (and --gen-spread) come to 2064 tokens"),
        (["--followups", "256,2000"], "come to 2216 tokens"),  # the answers and follow-up too
        (["--agent", "--turns", "40"], "an agent session's tokens and answers come to 6944"),
        (["--mixed", "1", "--long-prompt-tokens", "100", "--chat-tokens", "2000"],
         "--chat-tokens plus --long-prompt-tokens (the running stream) come to 2100 tokens"),
    ],
)  # fmt: skip
def test_prompts_past_the_models_context_are_refused_before_anything_runs(
    argv, said, model_dir, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exited:
        bench_main.main([*argv, "--model", str(model_dir), "--work-dir", str(tmp_path / "work")])
    assert exited.value.code == 2
    assert said.format(model=model_dir) in capsys.readouterr().err
    assert nothing_ran(tmp_path / "work")


def test_a_worker_that_refuses_to_start_is_said_in_its_own_words(model_dir, tmp_path):
    ran = subprocess.run(
        [sys.executable, "-m", "bench", "--long-prompts", "1", "--long-prompt-tokens", "100",
         "--model", str(model_dir), "--work-dir", str(tmp_path / "work"),
         "--worker-args", "--bogus-flag 1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ran.returncode == 1
    assert "unrecognized argument --bogus-flag" in ran.stderr
    assert "Traceback" not in ran.stderr


@pytest.mark.parametrize(
    ("script", "argv", "said"),
    [
        ("spec_passes", ["--rows", "0"], "--rows: expected positive integers"),
        ("attention_pass", ["--rows", "4,0"], "--rows: expected positive integers"),
        ("batch_copies", ["--rows", ""], "--rows: expected positive integers"),
        ("lookup_replay", ["--requests", "0"], "--requests: expected a whole number of at least 1"),
        ("lookup_replay", ["--repo", "/"], "--repo /: not a git repository"),
        ("kv_quality", ["--model", "/nonexistent"], "--model /nonexistent: not a folder"),
    ],
)  # fmt: skip
def test_the_side_scripts_refuse_values_no_run_can_use(script, argv, said, capsys):
    main = importlib.import_module(f"bench.{script}").main
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
