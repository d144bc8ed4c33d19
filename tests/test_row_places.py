"""Decoding rows keep their places (engine.batch.row_places): a row joining the
running batch takes the place a finished row left, without copying the batch's
cache, and every row decodes as it does in mlx-lm's own batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache
from test_speculative import tiny_model

from smg_mlx.engine.batch import batch_kv, quantized_attention, quantized_kv
from smg_mlx.engine.batch.ended_rows import EndingGenerationBatch, copied_out
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.batch.row_places import HOLES_KEPT, PlacedGenerationBatch


def _requests(count: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts of 2-60 tokens, each with 1-30 tokens to generate."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 50, size=int(rng.integers(2, 60))).tolist(), int(rng.integers(1, 30)))
        for _ in range(count)
    ]


def _run(model, requests, places: bool, running: int, monkeypatch, rows=None, bits=None) -> dict:
    """Every request through one BatchGenerator (its decoding rows `rows`, or
    `PlacedGenerationBatch` with `places`, else mlx-lm's; caches quantized to
    `bits`), at most `running` at once, a new
    one admitted as soon as one ends (the batch never empties until the last):
    the tokens, logprobs and finished caches of each, how often the batch's
    cache was copied whole, and what the cache held beside its rows."""
    generator = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=4)
    rows = PlacedGenerationBatch if places else rows
    if rows is not None:
        generator._generation_batch = rows.start(model, generator.sampler)
    copies = {"extend": 0, "filter": 0}

    def decoding(cache: BatchKVCache) -> bool:
        return any(cache is c for c in generator._generation_batch.prompt_cache)

    for kind in (BatchKVCache, BatchQuantizedKVCache):

        def counted_extend(self, other, _extend=kind.extend):
            copies["extend"] += decoding(self)
            _extend(self, other)

        def counted_filter(self, indices, *padding, _filter=kind.filter):
            if not isinstance(indices, slice):
                kept = indices.tolist() if isinstance(indices, mx.array) else list(indices)
                copies["filter"] += decoding(self) and kept != list(range(len(kept)))
            _filter(self, indices, *padding)

        monkeypatch.setattr(kind, "extend", counted_extend)
        monkeypatch.setattr(kind, "filter", counted_filter)
    waiting = list(enumerate(requests))
    which, out, spare, widest = {}, {}, 0, 0
    tokens = {i: [] for i in range(len(requests))}
    logprobs = {i: [] for i in range(len(requests))}

    def admit() -> None:
        i, (prompt, max_tokens) = waiting.pop(0)
        caches = None
        if bits is not None:
            caches = [[QuantizedKVCache(group_size=32, bits=bits) for _ in model.layers]]
        which[generator.insert([prompt], [max_tokens], caches=caches)[0]] = i

    for _ in range(running):
        admit()
    while len(out) < len(requests):
        responses = generator.next()[1]
        ended = [r for r in responses if r.finish_reason is not None]
        left = len(ended)
        for r in responses:
            i = which[r.uid]
            tokens[i].append(r.token)
            logprobs[i].append(r.logprobs[r.token].item())
        # every layer's keys and values, as the prefix cache keeps them
        for r, cache in zip(ended, copied_out([r.prompt_cache for r in ended])[0], strict=True):
            kept = [
                np.array(part[..., : c.offset, :])
                for c in cache
                for a in (c.keys, c.values)
                for part in (a if isinstance(a, tuple) else (a,))  # quantized: 3 parts
            ]
            out[which[r.uid]] = (len(r.all_tokens), np.concatenate(kept, axis=-1))
            if waiting:
                admit()
        rows = generator._generation_batch
        if rows.uids and rows.prompt_cache:
            longest = max(len(t) for t in rows.tokens)
            spare = max(spare, rows.prompt_cache[0]._idx - longest)
            # (holes but those the rows that finished in this call left)
            widest = max(widest, rows.prompt_cache[0].offset.shape[0] - len(rows.uids) - left)
    generator.close()
    return dict(tokens=tokens, logprobs=logprobs, finished=out, copies=copies,
                spare_columns=spare, holes=widest)  # fmt: skip


@pytest.mark.parametrize(
    "family, steady, bits, cuda_buffers",
    [("llama", False, None, False), ("qwen3", False, None, False), ("llama", True, None, False),
     ("qwen3", False, 8, False), ("qwen3", False, 4, True)],
    ids=["llama", "qwen3", "llama, steady widths (CUDA)", "qwen3, 8-bit KV",
         "qwen3, 4-bit KV in whole buffers with a 16-bit tail (CUDA)"],
)  # fmt: skip
def test_rows_joining_into_places_left_decode_as_in_mlx_lms_batch(
    family, steady, bits, cuda_buffers, monkeypatch
):
    """Also where several rows attend over their buffers to the next multiple
    of its step (`steady`, as on CUDA), the columns past their ends masked;
    and under --kv-bits, where a decoding pass's newest keys wait in a 16-bit
    tail (flushed before rows join) in buffers of whole steps, as on CUDA."""
    model = tiny_model(family, scale=1.5, head_dim=32 if bits else 16)  # (32: a group a head)
    requests = _requests(40, seed=5)
    monkeypatch.setattr(quantized_kv, "TAILS", cuda_buffers)
    monkeypatch.setattr(quantized_kv, "WHOLE", cuda_buffers)
    if bits:  # the worker's quantized attention, which reads a tail (put back after)
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                            base.quantized_scaled_dot_product_attention)  # fmt: skip
        quantized_attention.install(None)
    theirs = _run(model, requests, places=False, running=8, monkeypatch=monkeypatch, bits=bits)
    monkeypatch.setattr(batch_kv, "_steady", steady)
    ours = _run(model, requests, places=True, running=8, monkeypatch=monkeypatch, bits=bits)
    assert any(len(set(t)) > 3 for t in theirs["tokens"].values()), "output should vary"
    assert ours["tokens"] == theirs["tokens"]
    for i in theirs["logprobs"]:
        assert ours["logprobs"][i] == pytest.approx(theirs["logprobs"][i], abs=1e-4)
    # A finished row's cache holds its tokens, as mlx-lm's batch leaves it.
    for i, (length, keys) in theirs["finished"].items():
        assert ours["finished"][i][0] == length
        np.testing.assert_allclose(ours["finished"][i][1], keys, atol=1e-4)
    # mlx-lm copies the batch's cache for nearly every row leaving and joining;
    # here only a row longer than the batch's cache is appended so.
    assert theirs["copies"]["filter"] + theirs["copies"]["extend"] > 40
    assert sum(ours["copies"].values()) < sum(theirs["copies"].values()) / 3
    assert ours["holes"] <= HOLES_KEPT


@pytest.mark.parametrize("bits", [None, 8], ids=["16-bit", "8-bit in CUDA's buffers"])
def test_rows_joining_holes_side_by_side_are_written_together_and_decode_exactly(
    bits, monkeypatch
):
    """Rows that joined together and end together leave holes side by side;
    the next prompts to join them together are written a run at a time, each
    row ending at the batch's last column however long its prompt."""
    model = tiny_model("qwen3", scale=1.5, head_dim=32)
    rng = np.random.default_rng(9)
    group = lambda lengths, max_tokens: [  # noqa: E731
        (rng.integers(0, 50, size=n).tolist(), max_tokens) for n in lengths
    ]
    # (two rows end together: as many holes as a batch of eight keeps)
    requests = (group((10, 12), 6) + group((40, 45, 50, 55, 44, 51), 30)
                + group((5, 13), 10) + group((8, 3), 8))  # fmt: skip
    monkeypatch.setattr(quantized_kv, "TAILS", bits is not None)
    monkeypatch.setattr(quantized_kv, "WHOLE", bits is not None)
    if bits:
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                            base.quantized_scaled_dot_product_attention)  # fmt: skip
        quantized_attention.install(None)
    theirs = _run(model, requests, places=False, running=8, monkeypatch=monkeypatch, bits=bits)
    joined = []
    write = PlacedGenerationBatch._write_into_holes

    def noted(self, theirs, into, lengths):
        joined.append(sorted(into.values()))
        write(self, theirs, into, lengths)

    monkeypatch.setattr(PlacedGenerationBatch, "_write_into_holes", noted)
    ours = _run(model, requests, places=True, running=8, monkeypatch=monkeypatch, bits=bits)
    assert [0, 1] in joined  # (the case this test is for)
    assert any(len(set(t)) > 3 for t in theirs["tokens"].values()), "output should vary"
    assert ours["tokens"] == theirs["tokens"]
    for i, (length, keys) in theirs["finished"].items():
        assert ours["finished"][i][0] == length
        np.testing.assert_allclose(ours["finished"][i][1], keys, atol=1e-4)


@pytest.mark.parametrize("bits", [None, 8])
def test_rows_that_end_leave_the_others_decoding_as_in_mlx_lms_batch(bits, monkeypatch):
    """Without places, rows ending are filtered out as mlx-lm filters them
    (the padding every row left shares cut off), known without reading the
    cache: the same tokens, the same finished caches, no column to spare."""
    model = tiny_model("qwen3", scale=1.5, head_dim=32)  # a head: one group of 32
    requests = _requests(60, seed=7)
    theirs = _run(model, requests, False, 6, monkeypatch, bits=bits)
    ours = _run(model, requests, False, 6, monkeypatch, rows=EndingGenerationBatch, bits=bits)
    assert any(len(set(t)) > 3 for t in theirs["tokens"].values()), "output should vary"
    assert ours["tokens"] == theirs["tokens"]
    for i, (length, keys) in theirs["finished"].items():
        assert ours["finished"][i][0] == length
        np.testing.assert_allclose(ours["finished"][i][1], keys, atol=1e-4)
    assert ours["spare_columns"] == theirs["spare_columns"] == 0


def test_a_batch_that_never_empties_holds_no_more_columns_than_its_longest_row(monkeypatch):
    """Rows keep joining as others leave for 120 requests: the cache's length
    follows the longest row's, never the batch's age."""
    model = tiny_model("llama", scale=1.5)
    ours = _run(model, _requests(120, seed=6), places=True, running=6, monkeypatch=monkeypatch)
    assert ours["spare_columns"] == 0
    assert ours["holes"] <= HOLES_KEPT


def test_a_row_longer_than_the_batch_joins_at_its_end_and_decodes_exactly(monkeypatch):
    """Where a joining row's cache is longer than the batch's, it cannot take a
    hole's place: the batch grows to hold it, as mlx-lm's does."""
    model = tiny_model("qwen3", scale=1.5)
    requests = [([3, 1, 4], 25), ([1, 5], 4), (list(range(2, 50)), 20), ([9, 2, 6], 20)]
    theirs = _run(model, requests, places=False, running=2, monkeypatch=monkeypatch)
    ours = _run(model, requests, places=True, running=2, monkeypatch=monkeypatch)
    assert ours["tokens"] == theirs["tokens"]
    assert ours["spare_columns"] == 0


def test_the_model_runs_each_row_at_its_own_place(monkeypatch):
    """With a hole in the batch, the model's outputs come back in the rows' order."""
    model = tiny_model("llama", scale=1.5)
    batch = PlacedGenerationBatch.start(model, None)
    batch._placed([2, 0], 3)
    seen = []

    def target(inputs, cache):
        seen.append(inputs.tolist())
        return inputs * 10

    batch._target = target
    assert batch.model(mx.array([[7], [8]]), cache=[]).tolist() == [[70], [80]]
    assert seen == [[[8], [7], [7]]]  # place 1, a hole, runs any row's input
    assert isinstance(batch, GenerationBatch)


def test_counts_taken_back_on_the_device_reach_each_rows_place_with_no_scatter(tmp_path):
    """Chained checking passes take back what each row did not keep, counted on
    the device: each place gets its row's count, a hole none. They are gathered
    by place: mlx's CUDA backend would build a scatter of int32s on first use,
    seconds during which every stream waits (the warm-up builds gathers)."""
    got = []

    class Layer:
        offset = mx.zeros((3,), mx.int32)

        def size(self):
            return 10

        def rewind_ahead(self, counts, ends):
            got.append((counts, ends))

    batch = PlacedGenerationBatch.start(tiny_model("llama", scale=1.5), None)
    batch._placed([2, 0], 3)
    batch.prompt_cache = [Layer(), Layer()]
    batch.rewind_ahead(mx.array([1, 3], dtype=mx.int32))
    graph = tmp_path / "counts.dot"
    mx.export_to_dot(str(graph), got[0][0])  # (before it is evaluated)
    assert "Scatter" not in graph.read_text()
    assert [(c.tolist(), e.tolist()) for c, e in got] == [([3, 0, 1], [7, 10, 9])] * 2


@contextmanager
def _device_reads(reads: list[str]) -> Iterator[None]:
    """Each array read back to the host meanwhile, noted in `reads`."""
    tolist, item = mx.array.tolist, mx.array.item

    def noted(name, real):
        def read(array):
            reads.append(name)
            return real(array)

        return read

    mx.array.tolist, mx.array.item = noted("tolist", tolist), noted("item", item)
    try:
        yield
    finally:
        mx.array.tolist, mx.array.item = tolist, item


@pytest.mark.parametrize("places", [False, True], ids=["filtered", "in places"])
def test_quantized_rows_moving_in_and_out_read_no_padding_from_the_device(places, monkeypatch):
    """Under --kv-bits, prompts moving into the decoding rows, rows leaving them
    (filtered out, or leaving holes that rows join and that are gathered out)
    and rows copied out know their padding on the host: a read from the device
    waits for the pass in flight, and the device then idles while the host
    prepares the next."""
    reads: list[str] = []
    for name in ("filter", "extract"):
        real = getattr(BatchQuantizedKVCache, name)

        def watched(self, *args, _real=real, **kwargs):
            with _device_reads(reads):
                return _real(self, *args, **kwargs)

        monkeypatch.setattr(BatchQuantizedKVCache, name, watched)
    model = tiny_model("qwen3", scale=1.5, head_dim=32)  # a head: one group of 32
    requests = _requests(30, seed=8)
    ours = _run(model, requests, places, 6, monkeypatch, rows=EndingGenerationBatch, bits=8)
    assert len(ours["finished"]) == 30
    assert reads == []
