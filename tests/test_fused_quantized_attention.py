"""The fused few-query attention over quantized KV (CUDA only: CI has no GPU,
so these run on a CUDA machine, `pytest tests/test_fused_quantized_attention.py`)."""

import mlx.core as mx
import pytest

from smg_mlx.engine.batch import fused_quantized_attention as fused

pytestmark = pytest.mark.skipif(not fused.AVAILABLE, reason="the fused kernel is CUDA's")


def reference(queries, q_keys, q_values, scale, mask, group_size, bits):
    """The same attention in float32 over the dequantized keys and values."""
    keys, values = (
        mx.dequantize(*q, group_size=group_size, bits=bits).astype(mx.float32)
        for q in (q_keys, q_values)
    )
    repeats = queries.shape[1] // keys.shape[1]
    keys, values = (mx.repeat(x, repeats, axis=1) for x in (keys, values))
    scores = (queries.astype(mx.float32) * scale) @ keys.swapaxes(-1, -2)
    scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ values


@pytest.mark.parametrize(
    "rows,heads,kv_heads,length,keys,dim,bits,dtype",
    [
        (1, 16, 8, 1, 256, 128, 8, mx.bfloat16),  # a lone decode row: one block a head
        (1, 16, 8, 1, 4096, 128, 8, mx.bfloat16),  # a few thousand keys: still one part
        (1, 16, 8, 1, 17000, 128, 8, mx.bfloat16),  # long: the keys cut into parts
        (16, 16, 8, 1, 1024, 128, 8, mx.bfloat16),
        (64, 16, 8, 1, 512, 128, 4, mx.bfloat16),
        (3, 32, 8, 5, 768, 128, 8, mx.float16),  # checking proposals: a few queries a row
        (4, 8, 8, 2, 512, 64, 8, mx.float32),
        (2, 4, 2, 1, 2048, 64, 4, mx.float32),
        # a block's query vectors: one KV head's heads and queries, the last block part-full
        (2, 8, 8, 3, 600, 64, 8, mx.bfloat16),
        (5, 16, 2, 1, 1000, 128, 4, mx.bfloat16),
        (2, 12, 4, 3, 5000, 128, 8, mx.bfloat16),
        (2, 12, 4, 3, 20000, 128, 8, mx.bfloat16),  # parts, several queries a row
        (1, 8, 4, 1, 700, 256, 8, mx.bfloat16),
    ],
)
def test_the_fused_pass_is_attention_over_the_dequantized_cache(
    rows, heads, kv_heads, length, keys, dim, bits, dtype
):
    # Queries as models hand them over (a transposed view), rows left-padded
    # apart and the buffers' tails unwritten (masked), as the batch cache reads.
    queries = mx.random.normal((rows, length, heads, dim), key=mx.random.key(1)).astype(dtype)
    queries = queries.transpose(0, 2, 1, 3)
    q_keys, q_values = (
        tuple(mx.quantize(mx.random.normal((rows, kv_heads, keys, dim), key=mx.random.key(i))
                          .astype(dtype), group_size=64, bits=bits))
        for i in (2, 3)
    )  # fmt: skip
    padding = mx.array([(7 * r) % (keys // 2) for r in range(rows)])
    written = keys - 37
    positions = mx.arange(keys)
    ends = written - length + 1 + mx.arange(length)  # each query sees up to its own position
    mask = (positions[None, None, None] >= padding[:, None, None, None]) & (
        positions[None, None, None] < ends[None, None, :, None]
    )
    assert fused.fits(queries, q_keys, q_values, mask, 64, bits)
    got = fused.attention(queries, q_keys, q_values, dim**-0.5, mask, 64, bits)
    want = reference(queries, q_keys, q_values, dim**-0.5, mask, 64, bits)
    assert got.shape == queries.shape and got.dtype == dtype
    tolerance = 1e-3 if dtype == mx.float32 else 2e-2  # the reference: CUDA sums float32 in TF32
    assert mx.allclose(got.astype(mx.float32), want, atol=tolerance, rtol=tolerance).item()


def test_a_pass_without_a_mask_reads_every_key():
    queries = mx.random.normal((2, 8, 1, 128), key=mx.random.key(5))
    q_keys, q_values = (
        tuple(mx.quantize(mx.random.normal((2, 4, 300, 128), key=mx.random.key(i)), bits=8))
        for i in (6, 7)
    )
    got = fused.attention(queries, q_keys, q_values, 0.1, None, 64, 8)
    want = reference(queries, q_keys, q_values, 0.1, mx.ones((1, 1, 1, 300), mx.bool_), 64, 8)
    assert mx.allclose(got, want, atol=1e-3).item()


@pytest.mark.parametrize(
    "rows,length,keys,dim,bits",
    [(3, 1, 512, 128, 8), (2, 3, 1000, 128, 4), (64, 1, 256, 64, 8), (1, 1, 4096, 256, 8),
     (1, 1, 17000, 128, 8)],  # (the last: the keys cut into parts)
)
def test_a_16_bit_tail_reads_as_the_same_positions_quantized(rows, length, keys, dim, bits):
    """A decoding pass's newest keys and values come 16-bit, in a tail after the
    quantized ones (`quantized_kv.TAILS`): the kernel quantizes them as
    mx.quantize does, so the pass is the one over them quantized, to the bit."""
    heads, kv_heads, tail = 16, 8, 16
    queries = mx.random.normal((rows, heads, length, dim), key=mx.random.key(1)).astype(
        mx.bfloat16
    )
    new_keys, new_values = (
        (mx.random.normal((rows, kv_heads, tail, dim), key=mx.random.key(i)) * 3 + 0.5).astype(
            mx.bfloat16
        )
        for i in (2, 3)
    )
    q_keys, q_values = (
        tuple(mx.quantize(mx.random.normal((rows, kv_heads, keys, dim), key=mx.random.key(i))
                          .astype(mx.bfloat16), group_size=64, bits=bits))
        for i in (4, 5)
    )  # fmt: skip
    # The quantized positions up to `written`, then 11 of the tail's 16 in use.
    written, used = keys - 100, 11
    positions = mx.arange(keys + tail)
    seen = (positions < written) | ((positions >= keys) & (positions < keys + used))
    mask = mx.broadcast_to(seen, (rows, 1, length, keys + tail))

    def joined(parts, new):
        more = mx.quantize(new, group_size=64, bits=bits)
        return tuple(mx.concatenate([a, b], axis=2) for a, b in zip(parts, more, strict=True))

    got = fused.attention(
        queries, (*q_keys, new_keys), (*q_values, new_values), dim**-0.5, mask, 64, bits
    )
    want = fused.attention(
        queries, joined(q_keys, new_keys), joined(q_values, new_values), dim**-0.5, mask, 64, bits
    )
    assert mx.array_equal(got, want).item()
