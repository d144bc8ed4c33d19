"""The start-up measurement of what a model costs: the memory it may plan with, and a
probe that stays short on a device where the model is slow."""

from __future__ import annotations

import logging
import os
import time

import mlx.core as mx
import pytest
from mlx_lm import load

from smg_mlx.engine.memory import probe as memory_probe

RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize(
    ("v2", "v1", "expected"),
    [
        ("max\n", None, RAM),  # a container without a limit
        ("1073741824\n", None, 1 << 30),
        (None, "536870912\n", 512 << 20),
        (None, "9223372036854771712\n", RAM),  # v1's "no limit"
        (None, None, RAM),  # no cgroup files: not Linux, or no memory controller
    ],
)
def test_the_host_memory_is_the_containers_limit_where_that_is_smaller(tmp_path, v2, v1, expected):
    files = []
    for name, text in (("memory.max", v2), ("memory.limit_in_bytes", v1)):
        files.append(tmp_path / name)
        if text is not None:
            files[-1].write_text(text)
    assert memory_probe.host_memory(files) == expected


def test_a_model_slow_on_its_device_is_probed_in_small_chunks(model_dir, monkeypatch, caplog):
    model = load(str(model_dir))[0]
    stream = mx.new_stream(mx.default_device())
    caplog.set_level(logging.INFO, "smg_mlx.engine.memory.probe")
    full_memory, _ = memory_probe.measure(model, stream, 2048)
    assert "prompts of 2304 tokens in all" in caplog.text
    caplog.clear()
    # As slow as a 120M-parameter float32 model on two CPU cores: 35 ms a token.
    monkeypatch.setattr(memory_probe, "_seconds_per_token", lambda *args: 0.035)
    memory, speed = memory_probe.measure(model, stream, 2048)
    assert "prompts of 144 tokens in all, about 5.0s" in caplog.text
    # The same model still: its weights and KV cache, and a prefill that costs something.
    assert (memory.weights, memory.kv_per_token) == (full_memory.weights, full_memory.kv_per_token)
    assert memory.prefill_per_token >= full_memory.prefill_per_token / 2
    assert speed.per_token > 0


def test_one_slow_look_does_not_shrink_the_probe(model_dir, caplog):
    """A pass that happens to be slow (a kernel built late, another process
    on the device) is not taken for the model's speed: a fast model is still
    probed in full chunks."""
    model = load(str(model_dir))[0]
    calls = 0

    class SlowOnce:
        def __call__(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 3:  # the first timed look (the first call reads the KV shapes)
                time.sleep(1.0)
            return model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    caplog.set_level(logging.INFO, "smg_mlx.engine.memory.probe")
    memory_probe.measure(SlowOnce(), mx.new_stream(mx.default_device()), 2048)
    assert "prompts of 2304 tokens in all" in caplog.text


def test_a_known_attention_working_set_is_taken_and_the_rest_measured(model_dir):
    model = load(str(model_dir))[0]
    stream = mx.new_stream(mx.default_device())
    fitted, _ = memory_probe.measure(model, stream, 2048)
    told = []

    def attention(kv_per_token: float) -> tuple[float, float]:
        told.append(kv_per_token)
        return 4.0, kv_per_token

    memory, _ = memory_probe.measure(model, stream, 2048, attention=attention)
    assert told == [fitted.kv_per_token]
    assert (memory.prefill_per_context, memory.prefill_row_per_key) == (4.0, fitted.kv_per_token)
    # With no slope to take off, a chunk token costs at least what the fit gives at no context.
    assert memory.prefill_per_token >= fitted.prefill_per_token * 0.9


def test_a_budget_past_the_devices_memory_is_taken_with_a_warning(caplog):
    memory, _ = memory_probe.device_memory()
    with caplog.at_level(logging.WARNING):
        assert memory_probe.budget(memory // 2, None) == (memory // 2, "--memory-budget")
        assert caplog.text == ""
        assert memory_probe.budget(4 * memory, None) == (4 * memory, "--memory-budget")
    assert "is more than the device has" in caplog.text
