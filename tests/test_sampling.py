"""Sampler sharing (what lets mlx-lm sample a whole batch in one call), and the
sampling filters: what they keep, and that new values cost no memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from smg_mlx.engine.batch.sampling import SamplerCache, make_sampler
from smg_mlx.engine.types import LogitsSettings, SamplingSettings

# The child imports helpers (the tests' folder), which imports bench (the repository's).
TESTS = Path(__file__).resolve().parent
CHILD_PATH = [str(TESTS), str(TESTS.parent)]


def test_equal_settings_share_one_sampler_and_seeded_ones_do_not():
    cache = SamplerCache()
    warm = SamplingSettings(temperature=0.7, top_p=0.9)
    assert cache.sampler(warm) is cache.sampler(SamplingSettings(temperature=0.7, top_p=0.9))
    assert cache.sampler(warm) is not cache.sampler(SamplingSettings(temperature=0.8, top_p=0.9))
    seeded = SamplingSettings(temperature=0.7, seed=3)
    assert cache.sampler(seeded) is not cache.sampler(seeded)
    # Greedy ignores the seed, so greedy requests always share.
    assert cache.sampler(SamplingSettings(temperature=0.0, seed=3)) is cache.sampler(
        SamplingSettings(temperature=0.0)
    )


def test_logits_processors_only_when_asked_and_shared():
    cache = SamplerCache()
    assert cache.processors(LogitsSettings()) == []
    penalty = LogitsSettings(repetition_penalty=1.2)
    assert len(cache.processors(penalty)) == 1
    assert cache.processors(penalty) is cache.processors(LogitsSettings(repetition_penalty=1.2))


def test_top_k_samples_only_among_the_k_most_likely_tokens():
    # Nearly flat log-probabilities: without the filter, every token comes up.
    scores = mx.arange(64, dtype=mx.float32)[None] / 100
    logprobs = scores - mx.logsumexp(scores)
    for k in (1, 3, 10):
        sample = make_sampler(SamplingSettings(temperature=1.0, top_k=k, seed=k))
        drawn = {sample(logprobs).item() for _ in range(200)}
        assert drawn <= set(range(64 - k, 64)), (k, sorted(drawn))
        assert len(drawn) == k  # and every one of them


@pytest.mark.parametrize("temperature", [1.1e-5, 3e-5, 5e-5])
def test_a_low_temperature_over_float16_log_probabilities_is_nearly_greedy(temperature):
    # A flat distribution (each log-probability near -4) tempered by 1/temperature
    # (20,000 to 90,000) leaves float16's range (up to 65504) for every token.
    scores = (mx.arange(64)[None] / 100).astype(mx.float16)
    logprobs = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
    sample = make_sampler(SamplingSettings(temperature=temperature, seed=7))
    assert {sample(logprobs).item() for _ in range(50)} == {63}


# Samples with thousands of top_k values none of which came before, past a
# warm-up, and prints how much the process grew (MiB). mlx-lm's own top-k filter
# compiles a graph per value and keeps it: about 4 KiB each.
NEW_TOP_K_VALUES = textwrap.dedent(
    """
    import mlx.core as mx
    from helpers import rss_mb
    from smg_mlx.engine.batch.sampling import make_sampler
    from smg_mlx.engine.types import SamplingSettings

    logprobs = mx.random.normal((2, 4400))  # wider than any top_k drawn (the cost: its width)
    def draw(values):
        for k in values:
            mx.eval(make_sampler(SamplingSettings(temperature=1.0, top_k=k))(logprobs))

    draw(range(2, 200))
    before = rss_mb()
    draw(range(200, 4200))
    print(rss_mb() - before)
    """
)


def test_new_top_k_values_leave_no_memory_behind():
    # helpers' rss_mb asks ps, as on macOS too (Linux alone has /proc).
    path = os.pathsep.join(filter(None, (*CHILD_PATH, os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", NEW_TOP_K_VALUES], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) < 4, f"grew {float(run.stdout):.1f} MiB over 4000 new top_k values"
