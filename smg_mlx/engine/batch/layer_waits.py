"""Passes handed to the device a layer at a time (engine thread): long prefill
passes, so that they hold few layers' copies, and passes the host waits for,
so that the device starts on them while the host records the rest.

MLX records a pass's work ahead of the device, and a buffer let go on the way
returns to the allocator only once the device has run the work that read it.
A long prefill pass recorded whole therefore holds every layer's transient
copies at once: attention's padded keys and values (`attention_shapes`, CUDA)
and quantized keys and values dequantized (`quantized_attention`), as many
bytes as the KV cache of the keys the pass attends to, and each layer's
activations besides. Here, after each layer's attention of such a pass, the
work so far is sent to the device and the host waits for the layer before it:
the host stays a layer ahead (the device never waits for it), and only the
layers in flight hold their copies.

A pass whose results the host waits for before it can record the next (one
checking speculative proposals) cannot overlap the pass before it as decoding
passes do: recorded whole, it leaves the device idle while the host records
it. `sent_layer_by_layer` sends each layer's attention output as it is
recorded, without waiting for any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

# Layers whose attention copies are held at once: the one the device runs, the
# one the host records, and one more for what a layer's end leaves (measured).
IN_FLIGHT = 3
# A pass goes layer by layer where a layer's attention reads at least this many
# keys over all its rows (padded): below, every layer's copies together are small.
WAIT_KEYS = 2048


def copies_per_key(kv_per_token: float, layers: int) -> float:
    """Bytes a long prefill pass holds per key it attends to, for copies that
    take `kv_per_token` over all `layers` (see module doc)."""
    return kv_per_token * min(1.0, IN_FLIGHT / max(layers, 1))


class LayerWaits:
    """Where a model's attention calls of one pass come, one layer after another."""

    def __init__(self) -> None:
        # The last layer's attention output, sent to the device and not waited
        # for. Kept past its pass's end (one small array, already computed
        # when the next pass comes): no call says where a pass ends.
        self._ahead: mx.array | None = None

    def after(self, out: mx.array, row_keys: int) -> mx.array:
        """A layer's attention output `out`, over `row_keys` keys in all its
        rows: for a long pass, sent to the device, the layer before waited for."""
        if row_keys < WAIT_KEYS:
            return out
        ahead, self._ahead = self._ahead, None
        # A pass that fails (out of memory) leaves nothing held here for the next.
        mx.async_eval(out)
        if ahead is not None:
            mx.eval(ahead)
        self._ahead = out
        return out


@contextmanager
def sent_layer_by_layer() -> Iterator[None]:
    """Inside, each attention call's output (16-bit or quantized keys, through
    whatever attention is installed) goes to the device as it is recorded."""
    fused = mx.fast.scaled_dot_product_attention
    quantized = base.quantized_scaled_dot_product_attention

    def sent(attention: Callable[..., mx.array]) -> Callable[..., mx.array]:
        def call(*args: Any, **kwargs: Any) -> mx.array:
            out = attention(*args, **kwargs)
            mx.async_eval(out)
            return out

        return call

    mx.fast.scaled_dot_product_attention = sent(fused)
    base.quantized_scaled_dot_product_attention = sent(quantized)
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = fused
        base.quantized_scaled_dot_product_attention = quantized
