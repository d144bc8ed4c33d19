"""What a pass costs besides its compute, on the CPU: mlx-lm's clears of MLX's
buffer cache skipped inside `engine.memory.buffer_cache.kept`; a lone row's decode
step run with no mask array, and a filter that keeps every row copying
nothing (`engine.batch.batch_kv`), their results unchanged."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

import smg_mlx.engine.batch.batch_kv  # noqa: F401 - installs itself
from smg_mlx.engine.memory import buffer_cache

from helpers import prompt


def cached_bytes() -> int:
    """Frees a 4 MiB array into MLX's buffer cache; what the cache holds then."""
    mx.eval(mx.zeros((1 << 20,)) + 1)
    return mx.get_cache_memory()


def test_clears_inside_kept_leave_the_buffer_cache_and_clears_outside_empty_it():
    held = cached_bytes()
    assert held > 0
    with buffer_cache.kept():
        mx.clear_cache()  # as mlx-lm calls it after each prefill chunk
        assert mx.get_cache_memory() == held
    mx.clear_cache()
    assert mx.get_cache_memory() == 0


def test_the_clear_comes_back_when_a_pass_fails():
    clear = mx.clear_cache
    with pytest.raises(RuntimeError), buffer_cache.kept():
        raise RuntimeError("a failed step")
    assert mx.clear_cache is clear
    cached_bytes()
    mx.clear_cache()
    assert mx.get_cache_memory() == 0


def mlx_lm_mask(self: BatchKVCache, N: int, return_array: bool = False, **kwargs):
    """mlx-lm's own BatchKVCache mask: an array for every step."""
    return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)


def test_a_lone_row_decodes_with_no_mask_array_and_the_same_logits(model_dir, monkeypatch):
    model, _ = load(str(model_dir))
    caches = []
    for n, length in enumerate((40, 25)):
        cache = make_prompt_cache(model)
        model(mx.array([prompt(length, n)]), cache=cache)
        caches.append(cache)
    one = [BatchKVCache.merge([layer]) for layer in caches[0]]
    two = [BatchKVCache.merge(list(layers)) for layers in zip(*caches, strict=True)]
    assert one[0].make_mask(1) is None  # every key, as an all-true mask would say
    assert isinstance(two[0].make_mask(1), mx.array)  # padded rows keep the array
    assert one[0].make_mask(8) == "causal"

    def decode(cache: list, rows: int) -> mx.array:
        logits = model(mx.array([[7]] * rows), cache=copy.deepcopy(cache))
        mx.eval(logits)
        return logits

    ours = decode(one, 1), decode(two, 2)
    monkeypatch.setattr(BatchKVCache, "make_mask", mlx_lm_mask)
    theirs = decode(one, 1), decode(two, 2)
    for a, b in zip(ours, theirs, strict=True):
        assert mx.allclose(a, b, atol=1e-5).item()
    assert mx.argmax(ours[0][0, -1]).item() == mx.argmax(ours[1][0, -1]).item()


def filled(rows: int) -> BatchKVCache:
    """A cache of `rows` rows, each with leading padding (2 at least)."""
    cache = BatchKVCache([2, 3, 4][:rows])
    keys = mx.random.normal((rows, 2, 9, 8), key=mx.random.key(rows))
    cache.update_and_fetch(keys, keys + 1)
    mx.eval(cache.keys, cache.values)
    return cache


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_a_filter_that_keeps_every_row_copies_nothing_and_changes_nothing(rows):
    """mlx-lm moves prompts into the decoding rows by filtering their cache;
    when every row moves, the arrays stay (the padding all rows share is
    dropped, as mlx-lm's gather drops it)."""
    ours, theirs = filled(rows), filled(rows)
    # An array, not a list, takes mlx-lm's gather.
    for cache, rows_kept in ((ours, list(range(rows))), (theirs, mx.arange(rows))):
        held = mx.get_active_memory()
        mx.reset_peak_memory()
        cache.filter(rows_kept)
        mx.eval(cache.keys, cache.values, cache.left_padding)
        copied = mx.get_peak_memory() - held >= cache.keys.nbytes
        assert copied == (cache is theirs)
    assert ours._idx == theirs._idx == 7
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    for a, b in zip(ours.keys_and_values(), theirs.keys_and_values(), strict=True):
        assert mx.array_equal(a, b).item()


def test_a_filter_that_drops_rows_gathers_those_left():
    cache = filled(3)
    cache.filter([0, 2])
    assert cache.keys.shape[0] == 2
    assert cache.left_padding.tolist() == [0, 2]
