"""Long prefill passes handed to the device a layer at a time (engine thread).

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
"""

from __future__ import annotations

import mlx.core as mx

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
