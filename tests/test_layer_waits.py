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

