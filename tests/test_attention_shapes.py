"""Prefill attention in few shapes (engine.batch.attention_shapes), on the CPU: the
shapes chosen, what counts as built, and outputs equal to mlx's own."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from smg_mlx.engine.batch import attention_shapes
from smg_mlx.engine.batch.attention_shapes import (
    MASK_BYTES,
    AttentionShapes,
    shape_key,
    windows_for,
)
from smg_mlx.engine.batch.layer_waits import IN_FLIGHT

OWN = mx.fast.scaled_dot_product_attention  # mlx's, as no wrapper has it yet


def test_one_row_runs_causal_as_the_full_chunk_at_its_window_end():
    windows = windows_for(2048)
    follow_ups = {shape_key(1, n, 32_768 + 64 + n, True, windows) for n in (30, 200, 440)}
    assert follow_ups == {(1, 512, 33_280, True)}
    assert shape_key(1, 1000, 32_768 + 1100, True, windows) == (1, 2048, 34_816, True)
    assert shape_key(1, 2048, 16_384, True, windows) == (1, 2048, 16_384, True)  # planned
    # A last piece across a boundary: the spanning window, ending on the smallest's grid.
    assert shape_key(1, 2048, 16_384 + 100, True, windows) == (1, 2560, 16_896, True)
    crossing = shape_key(1, 2500, 16_384 + 100, True, windows)  # more than a chunk: masked
    assert crossing == (1, 4096, 20_480, False)
    assert shape_key(1, 600, 700, True, windows) == (1, 2048, 2048, True)  # not before key 0
    assert not shape_key(4, 2048, 4096, False, windows)[3]  # several rows come with a mask


def test_a_chunk_larger_than_mlx_lms_keeps_its_window_for_what_fits_it():
    assert [w.queries for w in windows_for(2048)] == [512, 2048, 2560]
    assert [w.queries for w in windows_for(4096)] == [512, 2048, 4096, 4608]
    assert [w.queries for w in windows_for(128)] == [128]  # no spanning window: 2x the graphs
    shapes = AttentionShapes(4096)
    # A turn of 4,096 tokens after 28,864, in one pass across the 32,768
    # boundary: as many queries as to the boundary (4,096) and the rest (512).
    assert shapes.attended(1, 4096, 28_864) == 4608
    assert shapes.attended(1, 32_768 - 28_864, 28_864) == 4096
    assert shapes.attended(1, 1000, 8192 + 1024) == 2048  # not padded to 4,096
    assert shapes.attended(3, 300, 1000) == 512  # several rows: the query bucket


@pytest.fixture
def shapes():
    shapes = AttentionShapes(512)
    shapes.install()
    yield shapes
    shapes.uninstall()


def attend(rows: int, queries: int, keys: int, mask) -> tuple[mx.array, mx.array]:
    """The wrapped attention's output and mlx's own, on random bfloat16 inputs."""
    q = mx.random.normal((rows, 4, queries, 16)).astype(mx.bfloat16)
    k = mx.random.normal((rows, 2, keys, 16)).astype(mx.bfloat16)
    v = mx.random.normal((rows, 2, keys, 16)).astype(mx.bfloat16)
    wrapped = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    return wrapped, OWN(q, k, v, scale=0.25, mask=mask)


def test_padded_attention_equals_attention_in_its_own_shape(shapes):
    mx.random.seed(3)
    rows = mx.random.uniform(shape=(3, 1, 50, 300)) > 0.3
    rows = rows | (mx.arange(300) == 0)  # every query sees a key
    for n, (batch, queries, keys, mask) in enumerate([
        (1, 200, 1000, "causal"),  # padded to the window's end
        (1, 512, 1024, "causal"),  # a full chunk
        (1, 400, 1100, "causal"),  # across two windows: the spanning one
        (1, 900, 1100, "causal"),  # more than a chunk: masked
        (1, 40, 90, None),
        (3, 50, 300, rows),
        (3, 50, 300, mx.where(rows, 0.0, -1e9).astype(mx.bfloat16)),
    ]):  # fmt: skip
        wrapped, own = attend(batch, queries, keys, mask)
        assert wrapped.shape == own.shape
        assert mx.allclose(wrapped, own, atol=1e-2).item(), n


def test_a_shape_builds_once_and_the_warm_up_builds_what_one_row_meets(shapes):
    assert shapes.builds(1, 200, 800)
    attend(1, 200, 1000, "causal")
    assert not shapes.builds(1, 200, 800)
    assert not shapes.builds(1, 100, 900)  # the same window
    assert shapes.builds(1, 200, 5000)
    shapes.queue(4600, 2)
    shapes.build_queued(math.inf)
    assert not shapes.queued
    windows = [(n, c) for n in (16, 300, 512) for c in (0, 2048, 4096)]
    assert not any(shapes.builds(1, n, c) for n, c in windows)
    assert not shapes.builds(2, 100, 1000)
    assert shapes.builds(2, 100, 6000) and shapes.builds(3, 100, 1000)  # built on first use


def test_the_planner_is_told_the_copies_only_while_every_prefill_is_padded(shapes):
    attend(1, 200, 1000, "causal")
    attend(3, 50, 300, None)
    # Of 30 layers' copies, those of the layers in flight (engine.batch.layer_waits).
    assert shapes.working_set(1000.0, 30) == (MASK_BYTES, 1000.0 * IN_FLIGHT / 30)
    assert shapes.working_set(1000.0, 2) == (MASK_BYTES, 1000.0)
    one = mx.zeros((1, 4, 1, 16))  # a float32 decode step runs mlx's own: no prefill
    shapes.attention(one, one[:, :2], one[:, :2], scale=0.25, mask=None)
    assert shapes.working_set(1000.0, 30) is not None
    # A float32 prefill runs mlx's own attention, whose working set only the probe knows.
    q = mx.zeros((1, 4, 64, 16))
    shapes.attention(q, q[:, :2], q[:, :2], scale=0.25, mask="causal")
    assert shapes.working_set(1000.0, 30) is None


def test_a_few_queries_a_row_attend_as_the_fused_kernel_does():
    """A pass checking proposals (a few queries a row, a mask) gives what mlx's attention gives."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32))
               for s in ((3, 8, 5, 16), (3, 2, 40, 16), (3, 2, 40, 16)))  # fmt: skip
    ends = mx.array([30, 35, 39])[:, None, None, None]
    mask = mx.arange(40)[None, None, None, :] <= (ends - 4 + mx.arange(5)[None, None, :, None])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = attention_shapes.attend_few(q, k, v, 0.25, mask)
    assert mx.allclose(got, want, atol=1e-5).item()
    additive = mx.where(mask, 0.0, -mx.inf)
    assert mx.allclose(attention_shapes.attend_few(q, k, v, 0.25, additive), want, atol=1e-5).item()
