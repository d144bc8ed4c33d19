"""engine.batch.layer_waits: long prefill passes go to the device a layer at a
time (what a long pass holds is in test_quantized_kv)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from smg_mlx.engine.batch.layer_waits import WAIT_KEYS, LayerWaits


def test_a_pass_that_failed_leaves_nothing_for_the_next_to_wait_for(monkeypatch):
    """A layer whose work fails (out of memory, say) fails its pass once: the
    next pass does not wait for it again, and runs."""
    waits = LayerWaits()
    failing = mx.ones((4,)) * 2
    assert waits.after(failing, WAIT_KEYS) is failing
    evaluate = mx.eval

    def out_of_memory(*arrays):
        if any(a is failing for a in arrays):
            raise RuntimeError("out of memory")
        return evaluate(*arrays)

    monkeypatch.setattr(mx, "eval", out_of_memory)
    with pytest.raises(RuntimeError):
        waits.after(mx.ones((4,)) * 3, WAIT_KEYS)
    for n in range(3):  # the next pass's layers
        out = waits.after(mx.ones((4,)) + n, WAIT_KEYS)
    assert out.tolist() == [3.0] * 4



def _tiny_llama(layers: int):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=layers,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=100)  # fmt: skip
    return llama.Model(args)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_waited_for_pass_goes_to_the_device_a_layer_at_a_time(monkeypatch, bits):
    """Inside `sent_layer_by_layer` each layer's attention output is sent as it
    is recorded (16-bit or quantized keys), the outputs are the pass's own, and
    attention is mlx-lm's again after."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from smg_mlx.engine.batch.layer_waits import sent_layer_by_layer

    model = _tiny_llama(layers=3)
    tokens = mx.array([[1, 2, 3, 4, 5]])

    def caches():
        return [KVCache() if bits is None else QuantizedKVCache(bits=bits, group_size=32)
                for _ in model.layers]  # fmt: skip

    expected = model(tokens, cache=caches())
    before = (mx.fast.scaled_dot_product_attention, base.quantized_scaled_dot_product_attention)
    sent, send = [], mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (sent.append(a), send(*a)))
    with sent_layer_by_layer():
        out = model(tokens, cache=caches())
        assert len(sent) == 3  # before the pass is evaluated
    assert mx.array_equal(out, expected).item()
    with pytest.raises(ValueError), sent_layer_by_layer():
        raise ValueError
    after = (mx.fast.scaled_dot_product_attention, base.quantized_scaled_dot_product_attention)
    assert after == before
