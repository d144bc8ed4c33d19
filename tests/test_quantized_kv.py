"""The batched quantized KV cache (`engine.batch.quantized_kv`), on the CPU: mlx-lm's
BatchGenerator decodes with it as each prompt alone decodes with mlx-lm's own
QuantizedKVCache; rows keep their quantized keys and values through merge,
filter, extend, extract and ragged prefill; and what a token costs at 8 and 4 bits."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.base import quantized_scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from smg_mlx.engine.batch import quantized_attention, quantized_kv
from smg_mlx.engine.batch.attention_shapes import AttentionShapes, key_bucket
from smg_mlx.engine.batch.layer_waits import IN_FLIGHT, LayerWaits
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache

from conftest import build_once
from helpers import prompt

GROUP = 64


@pytest.fixture(scope="module")
def model(models_root):
    # Heads of 64 so that a head is one quantization group of 64.
    path = build_once(models_root / "tiny-head64", ["--head-dim", "64"])
    return load(str(path))[0]


def use_tails(monkeypatch, tails: bool) -> None:
    """Decoding passes write into 16-bit tails, as on CUDA (`quantized_kv.TAILS`),
    read by the worker's attention (mlx-lm's takes no tail), as solo rows are too."""
    monkeypatch.setattr(quantized_kv, "TAILS", tails)
    if tails:
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                            quantized_attention.attention)  # fmt: skip


def quantized_caches(model, bits: int) -> list[QuantizedKVCache]:
    return [QuantizedKVCache(group_size=GROUP, bits=bits) for _ in model.layers]


def alone(model, ids: list[int], n: int, bits: int | None, prefill_step: int = 2048) -> list[int]:
    """Greedy tokens of `ids` through mlx-lm's single-sequence path."""
    cache = quantized_caches(model, bits) if bits else [KVCache() for _ in model.layers]
    steps = generate_step(
        mx.array(ids), model, max_tokens=n, prompt_cache=cache, prefill_step_size=prefill_step
    )
    return [t for t, _ in steps]


def batched(
    model, waves: list[list[tuple[list[int], int]]], bits: int, prefill_step: int = 2048
) -> list[list[int]]:
    """Greedy tokens of each (prompt, max_tokens) through mlx-lm's BatchGenerator,
    a wave inserted after each of the earlier waves' first 3 steps (so batches are
    extended mid-decode, and filtered as rows of different lengths finish)."""
    gen = BatchGenerator(
        model, stop_tokens=[], prefill_batch_size=4, prefill_step_size=prefill_step
    )
    out: dict[int, list[int]] = {}
    uids: list[int] = []
    try:
        for wave in waves:
            ids, max_tokens = zip(*wave, strict=True)
            new = gen.insert(
                list(ids),
                max_tokens=list(max_tokens),
                caches=[quantized_caches(model, bits) for _ in ids],
            )
            uids += new
            out.update({u: [] for u in new})
            for _ in range(3):
                step(gen, out)
        while len(gen._generation_batch) or gen._unprocessed_sequences or len(gen._prompt_batch):
            step(gen, out)
    finally:
        gen.close()
    return [out[u] for u in uids]


def step(gen: BatchGenerator, out: dict[int, list[int]]) -> None:
    _, responses = gen.next()
    for cache in gen._generation_batch.prompt_cache:
        assert isinstance(cache, BatchQuantizedKVCache)
    for r in responses:
        out[r.uid].append(r.token)


@pytest.mark.parametrize("tails", [False, True], ids=["", "16-bit tails (CUDA)"])
@pytest.mark.parametrize("bits", [8, 4])
def test_batched_decoding_matches_each_prompt_alone(model, bits, tails, monkeypatch):
    """Also where decoding passes write into a 16-bit tail (as on CUDA,
    `quantized_kv.TAILS`): quantized as it would have been, whenever it is."""
    use_tails(monkeypatch, tails)
    waves = [
        [(prompt(5, 0), 20), (prompt(37, 1), 12), (prompt(12, 2), 25)],
        [(prompt(70, 3), 15), (prompt(1, 4), 10)],
    ]
    got = batched(model, waves, bits)
    want = [alone(model, ids, n, bits) for wave in waves for ids, n in wave]
    assert got == want
    # The weights make greedy output vary, so a wrong key would show.
    assert all(len(set(tokens)) > 3 for tokens in want)


@pytest.mark.parametrize(
    "whole, tails", [(False, False), (True, False), (True, True), (False, True)],
    ids=["views", "whole buffers (CUDA)", "whole buffers and 16-bit tails (CUDA)", "views, tails"],
)  # fmt: skip
@pytest.mark.parametrize("bits", [8, 4])
def test_long_prompts_prefilled_in_ragged_chunks_match_too(model, bits, whole, tails, monkeypatch):
    """Chunks of 16 (each right-padded, then rolled into left padding) and caches
    that grow past an allocation step (256 positions) while prefilling and decoding;
    attention reading views of the positions written, or (as on CUDA) the whole
    buffers with the rest masked, and the newest positions in a 16-bit tail."""
    monkeypatch.setattr(quantized_kv, "WHOLE", whole)
    use_tails(monkeypatch, tails)
    waves = [
        [(prompt(5, 0), 20), (prompt(300, 1), 12), (prompt(40, 2), 250)],
        [(prompt(270, 3), 15), (prompt(1, 4), 10)],
    ]
    got = batched(model, waves, bits, prefill_step=16)
    assert got == [alone(model, ids, n, bits, 16) for wave in waves for ids, n in wave]


def test_on_cuda_attention_reads_the_caches_own_buffers_with_the_unwritten_rest_masked(
    monkeypatch,
):
    """mlx's CUDA quantized matmul refuses views: attention gets the whole
    buffers (not a copy made every step), and the mask hides every position not
    yet written, also after a filter cut the buffers; but for one row's prompt.
    The buffers hold a whole number of steps, after rows leave or join too: on
    CUDA each key count off a tile's end builds a kernel of its own (a minute)."""
    monkeypatch.setattr(quantized_kv, "WHOLE", True)
    monkeypatch.setattr(quantized_kv, "TAILS", False)
    cache = BatchQuantizedKVCache([0, 2], group_size=GROUP, bits=8)

    def write(n: int) -> tuple[mx.array, mx.array]:
        mask = cache.make_mask(n)
        kv = mx.random.normal((cache.offset.shape[0], 2, n, GROUP), key=mx.random.key(n))
        keys, _ = cache.update_and_fetch(kv, kv)
        return mask, keys

    mask, keys = write(5)
    assert all(k is b for k, b in zip(keys, cache.keys, strict=True))
    assert mask.shape[-1] == keys[0].shape[2] == BatchQuantizedKVCache.step
    assert mask[..., :5].any() and not mask[..., 5:].any()
    buffers = cache.keys
    write(1)  # written in place: no new array made for attention
    assert cache.keys is buffers
    cache.filter(mx.array([1]))  # the kept row's 2 padding positions are cut off
    mask, keys = write(1)
    assert keys[0].shape[2] == BatchQuantizedKVCache.step == mask.shape[-1]
    assert mask[0, 0, 0, :5].all() and not mask[..., 5:].any()
    assert all(k is b for k, b in zip(keys, cache.keys, strict=True))
    # One row's prompt chunk is dequantized for attention anyway: it reads the
    # positions written and runs causal, with no mask array (faster).
    mask, keys = write(40)
    assert mask == "causal" and keys[0].shape[2] == 5 + 40
    mask, keys = write(1)  # decoding again: the whole buffers
    assert all(k is b for k, b in zip(keys, cache.keys, strict=True))
    # A row of 300 positions joins (a prompt's cache, merged, then extended in).
    single = QuantizedKVCache(group_size=GROUP, bits=8)
    single.update_and_fetch(*[mx.random.normal((1, 2, 300, GROUP), key=mx.random.key(9))] * 2)
    joining = BatchQuantizedKVCache.merge([single])
    assert joining.keys[0].shape[2] == 2 * BatchQuantizedKVCache.step
    cache.extend(joining)
    joined = cache.keys
    mask, keys = write(1)  # in place: the join left room (no copy to grow them)
    assert cache.keys is joined
    assert keys[0].shape[2] == 2 * BatchQuantizedKVCache.step == mask.shape[-1]
    assert mask[1, 0, 0, :301].all() and not mask[..., 301:].any()
    own = cache.offset[0].item()  # the first row's positions: its last ones, up to 301
    assert mask[0, 0, 0, 301 - own : 301].all() and not mask[0, ..., : 301 - own].any()


def test_on_cuda_decoding_writes_a_16_bit_tail_quantized_when_full_or_rows_join(monkeypatch):
    """A decoding pass's keys go into the 16-bit tail (attention reads it after
    the buffers, the mask as wide as both), not into the quantized buffers; a
    pass that would overfill it quantizes it into them first, as a row joining
    does; what the buffers then hold is the keys quantized, as written."""
    monkeypatch.setattr(quantized_kv, "WHOLE", True)
    monkeypatch.setattr(quantized_kv, "TAILS", True)
    cache = BatchQuantizedKVCache([0, 2], group_size=GROUP, bits=8)
    written = []

    def write(n: int) -> tuple[mx.array, tuple]:
        mask = cache.make_mask(n)
        kv = mx.random.normal((cache.offset.shape[0], 2, n, GROUP), key=mx.random.key(len(written)))
        written.append(kv)
        keys, _ = cache.update_and_fetch(kv, -kv)
        return mask, keys

    write(5)  # a prompt: quantized
    before = [mx.array(a) for a in cache.keys]
    for n in range(1, quantized_kv.TAIL + 1):
        mask, keys = write(1)
        assert len(keys) == 4 and keys[3].shape[2] == quantized_kv.TAIL
        assert mask.shape[-1] == keys[0].shape[2] + quantized_kv.TAIL
        width = keys[0].shape[2]  # the buffers', then the tail's n positions in use
        assert mask[..., width : width + n].all() and mask[0, ..., :5].all()
        assert not mask[..., 5:width].any() and not mask[..., width + n :].any()
        assert cache.size() == 5 + n
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, cache.keys, strict=True))
    mask, keys = write(1)  # the tail is full: quantized first
    assert mask[..., 2 : 5 + quantized_kv.TAIL].all() and mask[..., keys[0].shape[2]].all()
    tail = mx.concatenate(written[1:-1], axis=2)
    want = mx.quantize(tail, group_size=GROUP, bits=8)
    for got, part in zip(cache.keys, want, strict=True):
        assert mx.array_equal(got[:, :, 5 : 5 + quantized_kv.TAIL], part).item()
    single = QuantizedKVCache(group_size=GROUP, bits=8)
    single.update_and_fetch(*[mx.random.normal((1, 2, 3, GROUP), key=mx.random.key(9))] * 2)
    cache.extend(BatchQuantizedKVCache.merge([single]))  # a row joins: the tail goes in first
    assert cache.size() == cache._idx == 5 + quantized_kv.TAIL + 1
    last = mx.quantize(written[-1], group_size=GROUP, bits=8)
    for got, part in zip(cache.keys, last, strict=True):
        assert mx.array_equal(got[:2, :, cache._idx - 1 : cache._idx], part).item()


@pytest.mark.parametrize("cuda", [False, True], ids=["keys quantized", "keys dequantized (CUDA)"])
@pytest.mark.parametrize("length", [1, 16, 17, 512])
def test_quantized_attention_is_mlx_lms_for_few_queries_and_long_chunks(length, cuda, monkeypatch):
    """engine.batch.quantized_attention: a few queries a row read the keys
    quantized, heads folded; a longer chunk attends them dequantized. Either
    way the result is mlx-lm's (which the CUDA backend gets wrong). Heads of
    one quantization group each: on CUDA their keys' product is no quantized
    matmul (mlx's Hopper kernel returns NaN there), only the values' is."""
    monkeypatch.setattr(quantized_attention, "WHOLE_GROUP_KEYS_DEQUANTIZED", cuda)
    products = []
    quantized_matmul = mx.quantized_matmul

    def recorded(*args, transpose: bool = True, **kwargs):
        products.append("keys" if transpose else "values")
        return quantized_matmul(*args, transpose=transpose, **kwargs)

    monkeypatch.setattr(mx, "quantized_matmul", recorded)
    B, heads, kv_heads, S, D = 2, 8, 4, 1024, 64
    queries = mx.random.normal((B, heads, length, D), key=mx.random.key(1))
    q_keys = mx.quantize(mx.random.normal((B, kv_heads, S, D), key=mx.random.key(2)), GROUP, 8)
    q_values = mx.quantize(mx.random.normal((B, kv_heads, S, D), key=mx.random.key(3)), GROUP, 8)
    # Each row's left padding hidden, and the last 100 keys unwritten, as the cache masks them.
    mask = create_causal_mask(length, offset=S - 100 - length, left_padding=mx.array([0, 37]))
    mask = mx.pad(mask, [(0, 0), (0, 0), (0, 0), (0, 100)])
    ours = quantized_attention.attention(queries, q_keys, q_values, 0.125, mask, GROUP, 8)
    # A copy: mlx-lm scales its queries in place.
    monkeypatch.setattr(mx, "quantized_matmul", quantized_matmul)
    theirs = mlx_lm_attention(mx.array(queries), q_keys, q_values, 0.125, mask, GROUP, 8)
    assert mx.allclose(ours, theirs, atol=1e-4)
    if length <= 16:
        assert products == (["values"] if cuda else ["keys", "values"])


def test_the_layers_of_a_pass_share_its_launch_and_each_reads_its_own_keys(monkeypatch):
    """Few-query passes, as the worker installs them (on CUDA the fused
    kernel's launch is worked out once a pass): every layer of a pass (the
    same mask, the same shapes) attends its own keys and values, and a new
    pass, or the same mask over keys of other shapes, is worked out again."""
    launches = []

    def launcher(queries, q_keys, q_values, scale, mask, group_size, bits):
        launches.append(q_keys[0].shape[1])
        return lambda q, k, v: mlx_lm_attention(mx.array(q), k, v, scale, mask, group_size, bits)

    monkeypatch.setattr(quantized_attention.fused, "fits", lambda *a: True)
    monkeypatch.setattr(quantized_attention.fused, "launcher", launcher)
    # (mlx-lm's own attention put back after the test)
    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", mlx_lm_attention)
    quantized_attention.install(None)
    attend = partial(base.quantized_scaled_dot_product_attention, scale=0.125, group_size=GROUP,
                     bits=8)  # fmt: skip

    def layer(seed: int, kv_heads: int = 2) -> tuple:
        parts = (mx.random.normal((1, kv_heads, 48, 64), key=mx.random.key(seed + k))
                 for k in (1, 2))  # fmt: skip
        return tuple(mx.quantize(x, GROUP, 8) for x in parts)

    queries = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    mask = mx.ones((1, 1, 1, 48), mx.bool_)
    outs = []
    for seed in (10, 20, 30):  # three layers of one pass
        q_keys, q_values = layer(seed)
        outs.append(attend(queries, q_keys, q_values, mask=mask))
        want = mlx_lm_attention(mx.array(queries), q_keys, q_values, 0.125, mask, GROUP, 8)
        assert mx.allclose(outs[-1], want, atol=1e-5)
    assert not mx.allclose(outs[0], outs[1]) and launches == [2]
    q_keys, q_values = layer(40, kv_heads=1)
    out = attend(queries, q_keys, q_values, mask=mask)
    want = mlx_lm_attention(mx.array(queries), q_keys, q_values, 0.125, mask, GROUP, 8)
    assert launches == [2, 1] and mx.allclose(out, want, atol=1e-5)
    q_keys, q_values = layer(50, kv_heads=1)
    attend(queries, q_keys, q_values, mask=mx.ones((1, 1, 1, 48), mx.bool_))
    assert launches == [2, 1, 1]


def test_prefill_in_few_shapes_pads_keys_while_quantized(monkeypatch):
    """Where prefills run in few shapes (CUDA), a chunk's quantized keys and
    values are padded to the shape before they are dequantized (one full-size
    copy, not two), and attention is still exact over the dequantized keys."""
    B, heads, kv_heads, S, D, length = 2, 8, 4, 1000, 64, 300
    queries = mx.random.normal((B, heads, length, D), key=mx.random.key(1)).astype(mx.bfloat16)
    q_keys, q_values = (
        mx.quantize(mx.random.normal((B, kv_heads, S, D), key=mx.random.key(n)).astype(
            mx.bfloat16), GROUP, 8) for n in (2, 3)
    )  # fmt: skip
    mask = create_causal_mask(length, offset=S - 100 - length, left_padding=mx.array([0, 37]))
    mask = mx.pad(mask, [(0, 0), (0, 0), (0, 0), (0, 100)])
    # In float32: mlx-lm's own path rounds its scores to bfloat16.
    keys, values = (dequantized(q, 8).astype(mx.float32) for q in (q_keys, q_values))
    exact = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), keys, values, scale=0.125, mask=mask
    )
    dequantized_lengths = []
    dequantize = mx.dequantize

    def recorded(w, *rest, **kw):
        dequantized_lengths.append(w.shape[2])
        return dequantize(w, *rest, **kw)

    monkeypatch.setattr(mx, "dequantize", recorded)
    shapes = AttentionShapes(512)
    shapes.install()
    try:
        quantized_attention.install(shapes)
        ours = base.quantized_scaled_dot_product_attention(
            queries, q_keys, q_values, scale=0.125, mask=mask, group_size=GROUP, bits=8
        )
        mx.eval(ours)
    finally:
        shapes.uninstall()
        quantized_attention.install(None)
    assert dequantized_lengths and set(dequantized_lengths) == {key_bucket(S)} != {S}
    assert mx.allclose(ours, exact, atol=2e-2)


def test_a_long_pass_holds_the_dequantized_copies_of_the_layers_in_flight_only():
    """engine.batch.layer_waits: a prompt's chunk over many keys, through 12
    layers, holds the dequantized keys and values of the layers in flight (as
    the memory planner counts it), and gives what the pass recorded whole
    gives. (Recorded whole on a GPU, where buffers return only once the work
    reading them has run, it held every layer's copies: measured on CUDA.)"""
    layers, kv_heads, keys, D = 12, 4, 4096, 64
    caches = [
        [mx.quantize(mx.random.normal((1, kv_heads, keys, D), key=mx.random.key(n)), GROUP, 8)
         for n in (2 * layer, 2 * layer + 1)]
        for layer in range(layers)
    ]  # fmt: skip
    copies = 2 * kv_heads * keys * D * 4  # a layer's keys and values, dequantized (float32)
    mx.eval(caches)

    def long_pass(waits: LayerWaits | None) -> tuple[mx.array, int]:
        x = mx.random.normal((1, 8, 64, D), key=mx.random.key(99))
        mx.eval(x)
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        for q_keys, q_values in caches:  # each layer's queries made from the last one's output
            out = quantized_attention.attention(
                x, q_keys, q_values, 0.125, "causal", GROUP, 8, waits=waits
            )
            x = out * 1.5
        mx.eval(x)
        return x, mx.get_peak_memory() - before

    waited, peak = long_pass(LayerWaits())
    # The copies of the layers in flight, the attention's own work and the output.
    assert peak <= (IN_FLIGHT + 2) * copies
    assert mx.array_equal(waited, long_pass(None)[0])


def test_four_bits_change_what_is_generated(model):
    """The quantized path is in use: somewhere 4-bit keys change the greedy choice."""
    ids = [prompt(n, i) for i, n in enumerate((5, 37, 12, 70))]
    assert any(alone(model, p, 40, 4) != alone(model, p, 40, None) for p in ids)


# -- rows through the cache's operations -----------------------------------------------


def single(length: int, seed: int, bits: int) -> tuple[QuantizedKVCache, mx.array, mx.array]:
    """A QuantizedKVCache holding `length` random tokens, and those keys and values."""
    mx.random.seed(seed)
    keys = mx.random.normal((1, 2, length, 64))
    values = mx.random.normal((1, 2, length, 64))
    cache = QuantizedKVCache(group_size=GROUP, bits=bits)
    if length:
        cache.update_and_fetch(keys, values)
    return cache, keys, values


def dequantized(q, bits: int) -> mx.array:
    return mx.dequantize(*q, group_size=GROUP, bits=bits)


def assert_row(batch: BatchQuantizedKVCache, row: int, want: QuantizedKVCache) -> None:
    """Row `row` of `batch` holds exactly `want`'s tokens, in place and when extracted."""
    bits = batch.bits
    n = want.offset
    assert batch.offset[row].item() == n
    assert batch.left_padding[row].item() == batch.size() - n
    got = batch.extract(row)
    assert got.offset == n and (got.group_size, got.bits) == (GROUP, bits)
    if n == 0:
        return
    keys, values = batch.keys_and_values()
    for q_batch, q_got, q_want in ((keys, got.keys, want.keys), (values, got.values, want.values)):
        expected = dequantized(q_want, bits)[..., :n, :]
        in_place = dequantized(tuple(x[row : row + 1, :, -n:] for x in q_batch), bits)
        assert mx.array_equal(in_place, expected)
        assert mx.array_equal(dequantized(q_got, bits), expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_merge_filter_extend_extract_keep_each_row(bits):
    rows = [single(n, seed, bits)[0] for seed, n in enumerate((7, 0, 300, 31))]
    batch = BatchQuantizedKVCache.merge(rows)
    assert isinstance(QuantizedKVCache.merge(rows), BatchQuantizedKVCache)  # as mlx-lm calls it
    for i, c in enumerate(rows):
        assert_row(batch, i, c)

    batch.filter([3, 0])  # the longest row leaves: their shared padding goes with it
    assert batch.size() == 31 and batch.left_padding.tolist() == [0, 24]
    assert_row(batch, 0, rows[3])
    assert_row(batch, 1, rows[0])

    other = BatchQuantizedKVCache.merge([rows[2], rows[1]])
    batch.extend(other)
    assert batch.size() == 300
    for i, c in enumerate((rows[3], rows[0], rows[2], rows[1])):
        assert_row(batch, i, c)

    # A decode step after the round trip: each row's new token lands after its own.
    mx.random.seed(99)
    k, v = mx.random.normal((4, 2, 1, 64)), mx.random.normal((4, 2, 1, 64))
    batch.update_and_fetch(k, v)
    for i, c in enumerate((rows[3], rows[0], rows[2], rows[1])):
        c.update_and_fetch(k[i : i + 1], v[i : i + 1])
        assert_row(batch, i, c)

    assert batch.trim(2) == 2
    assert batch.offset.tolist() == [30, 6, 299, -1]  # the empty row's offset goes negative too


def test_ragged_prefill_rolls_right_padding_into_left_padding():
    """How BatchGenerator prefills prompts of different lengths: right-padded chunks."""
    lengths = [3, 9, 6]
    mx.random.seed(5)
    keys, values = mx.random.normal((3, 2, 9, 64)), mx.random.normal((3, 2, 9, 64))
    batch = BatchQuantizedKVCache([0, 0, 0], group_size=GROUP, bits=8)
    batch.prepare(lengths=lengths, right_padding=[9 - n for n in lengths])
    batch.update_and_fetch(keys, values)
    batch.finalize()
    assert batch.left_padding.tolist() == [6, 0, 3]
    for i, n in enumerate(lengths):
        want = QuantizedKVCache(group_size=GROUP, bits=8)
        want.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
        assert_row(batch, i, want)


def test_incompatible_formats_are_not_batched():
    with pytest.raises(ValueError):
        BatchQuantizedKVCache.merge([single(4, 0, 8)[0], single(4, 1, 4)[0]])
    with pytest.raises(ValueError):
        BatchQuantizedKVCache([0], bits=8).extend(BatchQuantizedKVCache([0], bits=4))


# -- memory -----------------------------------------------------------------------


def bytes_per_token(cache, tokens: int) -> float:
    return cache.nbytes / tokens


@pytest.mark.parametrize(("bits", "ratio"), [(8, 0.53125), (4, 0.28125)])
def test_bytes_per_token_against_bf16(bits, ratio):
    """8 bits: a byte per value and a bf16 scale and bias per 64; 4 bits: half a byte."""
    shape = (2, 8, 256, 128)  # two rows, 8 kv heads of 128, a whole allocation step
    keys = mx.random.normal(shape).astype(mx.bfloat16)
    plain = KVCache()
    plain.update_and_fetch(keys, keys)
    quantized = BatchQuantizedKVCache([0, 0], group_size=GROUP, bits=bits)
    quantized.update_and_fetch(keys, keys)
    measured = bytes_per_token(quantized, 512) / bytes_per_token(plain, 512)
    print(f"{bits} bits: {measured:.5f}x bf16 bytes per token")
    assert measured == pytest.approx(ratio)


def test_a_ragged_quantized_cache_holds_each_row_as_the_16_bit_one_quantized():
    """Speculative decoding's per-row ends (engine.speculative.ragged_kv) over
    quantized rows: after writes, different take-backs per row (far enough apart
    to be compacted), filter and extend, each row holds exactly its own positions,
    quantized, and the mask lets each query see the same keys."""
    from mlx_lm.models.cache import BatchKVCache

    from smg_mlx.engine.speculative.ragged_kv import ragged, rewind_layers

    mx.random.seed(3)
    pairs = [(ragged(BatchKVCache([0, 2, 1])), ragged(BatchQuantizedKVCache([0, 2, 1], GROUP, 4)))]

    def write(n: int, rows: int, takeback: list[int]) -> None:
        keys, values = mx.random.normal((rows, 2, n, GROUP)), mx.random.normal((rows, 2, n, GROUP))
        for cache in pairs[0]:
            cache.update_and_fetch(keys, values)
            rewind_layers([cache], takeback)

    write(5, 3, [0, 2, 4])
    write(300, 3, [0, 290, 10])  # ends more than SPREAD apart: lined up again
    assert pairs[0][1]._ends is None
    write(4, 3, [1, 0, 3])
    for cache in pairs[0]:
        cache.filter([0, 2])
    others = (ragged(BatchKVCache([1])), ragged(BatchQuantizedKVCache([1], GROUP, 4)))
    keys, values = mx.random.normal((1, 2, 7, GROUP)), mx.random.normal((1, 2, 7, GROUP))
    for mine, other in zip(pairs[0], others, strict=True):
        other.update_and_fetch(keys, values)
        other.rewind([2])
        mine.extend(other)
    write(3, 3, [2, 0, 1])
    plain, quantized = pairs[0]
    assert plain._ends is not None and quantized._row_ends() == plain._row_ends()
    assert mx.array_equal(quantized.make_mask(2), plain.make_mask(2))
    for i in range(3):
        p, q = plain.extract(i), quantized.extract(i)
        assert q.offset == p.offset > 0
        for mine, theirs in ((q.keys, p.keys), (q.values, p.values)):
            expected = mx.quantize(theirs[..., : p.offset, :], group_size=GROUP, bits=4)
            assert all(mx.array_equal(a, b) for a, b in zip(mine, expected, strict=True))
