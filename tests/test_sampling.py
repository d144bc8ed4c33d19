"""Sampler sharing: what lets mlx-lm sample a whole batch in one call."""

from __future__ import annotations

from smg_mlx.engine.sampling import SamplerCache
from smg_mlx.engine.types import LogitsSettings, SamplingSettings


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
