"""`python -m bench --kv-formats`: what one memory budget holds with each KV format."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.kv_formats import KvFormats, format_kv_formats, run_kv_formats

from conftest import REPO, build_once


def test_quantized_kv_holds_as_many_more_tokens_as_its_bytes_allow(models_root, tmp_path):
    """Filled until the memory tier drops an entry: 8-bit KV holds about as many
    times more tokens as a token's bytes shrink, and both formats stream."""
    model = build_once(models_root / "tiny-head64", ["--head-dim", "64"])
    run = KvFormats(formats=(16, 8), fill_tokens=256, context_tokens=256, concurrency=4,
                    gen_tokens=8)  # fmt: skip
    result = run_kv_formats(Path(model), tmp_path, run, ["--memory-budget", "10MiB"], 120)
    own, eight = result["formats"]["16"], result["formats"]["8"]
    for figures in (own, eight):
        assert figures["filled"] and figures["errors"] == 0
        assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
        assert figures["decode_cached_tokens"] >= 256  # the streams decode over one context
    smaller = own["kv_bytes_per_token"] / eight["kv_bytes_per_token"]
    assert smaller > 3  # float32 keys and values at 8 bits, group 64
    assert eight["tokens_held"] / own["tokens_held"] > 0.9 * smaller
    assert "8 bits: holds" in format_kv_formats(result)


def test_a_format_the_model_cannot_take_is_skipped_with_the_workers_reason(model_dir, tmp_path):
    """Heads narrower than any quantization group (the tiny model's 16): the
    worker refuses --kv-bits, and the model's own KV is still measured."""
    model = model_dir  # the tiny model of conftest, built once a run: heads of 16
    run = KvFormats(formats=(16, 8), context_tokens=64, concurrency=2, gen_tokens=4,
                    parts=("decode",))  # fmt: skip
    result = run_kv_formats(Path(model), tmp_path, run, [], 120)
    # (a run measures the parts asked for alone: here decode, not capacity)
    assert result["formats"]["16"]["decode_tok_s"] > 0
    assert "tokens_held" not in result["formats"]["16"]
    reason = result["formats"]["8"]["skipped"]
    assert "--kv-bits 8: this model's head sizes (16)" in reason
    assert "8 bits: skipped, the worker refused it: cannot serve" in format_kv_formats(result)


def test_a_bench_stopped_by_sigterm_stops_the_worker_it_started(models_root, tmp_path):
    """A timeout or a supervisor stops the bench with SIGTERM: the worker it
    started (in a session of its own) goes with it, as on Ctrl-C."""
    model = build_once(models_root / "tiny-head64", ["--head-dim", "64"])
    cache_dir = str(tmp_path / "prompt-cache-kv16")  # in the worker's command line only

    def workers() -> list[int]:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                if cache_dir in cmdline.read_bytes().decode(errors="replace"):
                    found.append(int(cmdline.parent.name))
        return found

    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--model", str(model), "--kv-formats", "16",
         "--kv-parts", "capacity", "--kv-fill-tokens", "64", "--work-dir", str(tmp_path)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in bench.stderr:  # the default budget: far more prompts than this test waits for
            if "capacity: up to" in line:
                break
        assert workers(), "the worker should be running"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert workers() == []
    finally:
        bench.kill()
        for pid in workers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
