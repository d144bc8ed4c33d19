"""Speculative decoding in the running batch, at mlx-lm's BatchGenerator: the
tokens are the ones plain decoding gives (greedy), drawn from the same
distribution (sampling), and a finished row's cache holds exactly its tokens."""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import shutil
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base, llama, qwen3
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.sample_utils import make_sampler

from smg_mlx.demo_model import build_model
from smg_mlx.engine.batch import (  # (quantized_kv: QuantizedKVCache's merge)
    batch_kv,
    quantized_attention,
    quantized_kv,
)
from smg_mlx.engine.batch.batch_kv import steady_mask
from smg_mlx.engine.batch.ended_rows import one_row
from smg_mlx.engine.batch.sampling import make_processors
from smg_mlx.engine.batch.sampling import make_sampler as seeded
from smg_mlx.engine.speculative.decoding import Drafting, DraftStats, SpeculativeGenerationBatch
from smg_mlx.engine.speculative.draft_model import DraftRows, PaddedOtherwise
from smg_mlx.engine.speculative.pacing import Block, Pacing
from smg_mlx.engine.speculative.prompt_lookup import lookup
from smg_mlx.engine.types import LogitsSettings, SamplingSettings

import helpers

VOCAB = 50


def tiny_model(family: str, scale: float, vocab: int = VOCAB, seed: int = 0, head_dim: int = 16):
    """A float32 random model; `scale` sets how often its greedy output repeats itself."""
    mx.random.seed(seed)
    shape = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                 vocab_size=vocab, rope_theta=10000.0)  # fmt: skip
    if family == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", **shape))
    else:
        args = qwen3.ModelArgs(model_type="qwen3", head_dim=head_dim, tie_word_embeddings=True,
                               max_position_embeddings=4096, **shape)  # fmt: skip
        model = qwen3.Model(args)
    model.update(tree_map(lambda p: p * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short phrase: prompt lookup has something to find."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(0, VOCAB, size=rng.integers(3, 10)).tolist()
        prompts.append((phrase * 8)[: rng.integers(6, 50)])
    return prompts


def generate(model, prompts, max_tokens, speculative: bool, stagger: bool = False,
             stop=None, sampler=None, rows: int = 32, seeds=None, draft=None,
             pacing=None, caches=None, one_width=False, processors=None):  # fmt: skip
    """Each prompt's tokens (and logprobs of them, and the finished caches' sizes);
    with `stagger` half the prompts join while the first half decode; `caches`
    makes each row's fresh caches (mlx-lm's own by default); `processors`, a
    prompt's logits processors by its index."""
    generator = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows // 8,
                               stop_tokens=stop, sampler=sampler)  # fmt: skip
    stats = DraftStats()
    if speculative:
        drafting = Drafting(most=4, pacing=pacing or Pacing(always=True), stats=stats,
                            draft=draft, one_width=one_width)  # fmt: skip
        generator._generation_batch = SpeculativeGenerationBatch.start(
            model, generator.sampler, drafting
        )
    order = list(enumerate(prompts))
    now = order[: len(order) // 2] if stagger else order
    later = order[len(now) :]
    which: dict[int, int] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    chosen: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    cached: dict[int, tuple[int, int]] = {}

    def insert(i: int, prompt: list[int]) -> None:
        own = None if seeds is None else [seeded(SamplingSettings(temperature=1.0, seed=seeds[i]))]
        fresh = None if caches is None else [caches()]
        its = None if processors is None else [processors(i)]
        which[generator.insert([prompt], [max_tokens[i]], samplers=own, caches=fresh,
                               logits_processors=its)[0]] = i  # fmt: skip

    for i, prompt in now:
        insert(i, prompt)
    calls = 0
    while len(cached) < len(prompts):
        calls += 1
        assert calls < 2000
        if later and calls % 3 == 0:
            insert(*later.pop(0))
        for r in generator.next()[1]:
            i = which[r.uid]
            tokens[i].append(r.token)
            chosen[i].append(r.logprobs[r.token].item())
            if r.finish_reason is not None:
                cache = one_row(r.prompt_cache)
                cached[i] = (cache[0].offset, len(r.all_tokens))
    generator.close()
    return [tokens[i] for i in range(len(prompts))], chosen, cached, stats


@pytest.mark.parametrize(
    "family, bits, whole, one_width",
    [("llama", None, False, False), ("llama", None, False, True), ("qwen3", None, False, False),
     ("qwen3", 8, False, False), ("qwen3", 4, False, False), ("qwen3", 8, True, True),
     ("qwen3", 4, "tails", True), ("llama", None, "steady", True),
     ("qwen3", None, "steady", False)],
    ids=["llama", "llama, one width (CUDA)", "qwen3", "qwen3 8-bit KV", "qwen3 4-bit KV",
         "qwen3 8-bit KV, whole buffers, one width (CUDA)",
         "qwen3 4-bit KV, whole buffers and 16-bit tails, one width (CUDA)",
         "llama, steady widths and one width (CUDA)", "qwen3, steady widths"],
)  # fmt: skip
def test_greedy_tokens_are_plain_decodings_solo_and_in_batches(
    family, bits, whole, one_width, monkeypatch
):
    """Checking passes are sent while the one before runs, where they can be,
    rows that ended among them. With --kv-bits (`bits`), rows keep their keys
    and values quantized and each takes back its own rejected proposals as
    from 16-bit caches (ragged_kv); attention reading, as on CUDA, the whole
    buffers, masked past each row's end,
    and (`tails`) plain passes writing into 16-bit tails, quantized before a
    pass checks proposals. A checking pass is as wide as its rows' proposals
    need, or (`one_width`, as on CUDA, where each new shape costs a kernel
    build) as the most allowed. With `steady` widths (CUDA) several rows
    attend over their buffers to the next multiple of its step, each row's
    end and the rest masked, in plain and in checking passes alike: the
    tokens are still mlx-lm's own plain decoding's."""
    monkeypatch.setattr(quantized_kv, "WHOLE", whole is True or whole == "tails")
    monkeypatch.setattr(batch_kv, "_steady", False)
    steady = whole == "steady"
    widened = []
    monkeypatch.setattr(batch_kv, "steady_mask",
                        lambda *a, **k: widened.append(a) or steady_mask(*a, **k))  # fmt: skip
    if whole == "tails":
        monkeypatch.setattr(quantized_kv, "TAILS", True)
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                            quantized_attention.attention)  # fmt: skip
    widths = set()
    check = SpeculativeGenerationBatch._check

    def recorded(self, pending, drafts, width, *rest, **more):
        widths.add(width)
        return check(self, pending, drafts, width, *rest, **more)

    monkeypatch.setattr(SpeculativeGenerationBatch, "_check", recorded)
    chained = []  # passes sent while the one before ran (decoding.CHAIN)
    ahead = SpeculativeGenerationBatch.rewind_ahead
    monkeypatch.setattr(SpeculativeGenerationBatch, "rewind_ahead",
                        lambda self, counts: chained.append(1) or ahead(self, counts))  # fmt: skip
    past_an_end = []  # passes settled with one after them sent, once a row had ended
    settle = SpeculativeGenerationBatch._settle

    def settled(self, sent, pending, got, ahead):
        past_an_end.append(ahead and bool(got.ended))
        return settle(self, sent, pending, got, ahead)

    monkeypatch.setattr(SpeculativeGenerationBatch, "_settle", settled)
    model = tiny_model(family, scale=1.5, head_dim=16 if bits is None else 64)

    def quantized() -> list[QuantizedKVCache]:
        return [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]

    caches = None if bits is None else quantized
    proposed = accepted = 0
    for seed, stagger in ((1, False), (2, True), (3, True)):
        prompts = repetitive_prompts(8, seed)
        max_tokens = [int(n) for n in np.random.default_rng(seed).integers(1, 40, len(prompts))]
        batch_kv.steady_widths(False)
        plain, plain_logprobs, _, _ = generate(model, prompts, max_tokens, False, stagger,
                                               caches=caches)  # fmt: skip
        batch_kv.steady_widths(steady)
        ours, logprobs, cached, stats = generate(model, prompts, max_tokens, True, stagger,
                                                 caches=caches, one_width=one_width)  # fmt: skip
        if steady:  # and plain decoding so, too
            assert generate(model, prompts, max_tokens, False, stagger)[0] == plain
        assert ours == plain
        assert all(len(t) == n for t, n in zip(ours, max_tokens, strict=True))
        for i in range(len(prompts)):  # the logprobs of accepted tokens are the model's
            assert logprobs[i] == pytest.approx(plain_logprobs[i], abs=1e-4)
        # A finished row's cache holds its prompt and every token it returned.
        assert all(size == tokens for size, tokens in cached.values())
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
    assert any(len(set(t)) > 3 for t in plain), "the model's output should vary"
    assert 0 < accepted < proposed, "some proposals right, some wrong"
    assert widths == {5} if one_width else len(widths) > 1 and max(widths) <= 5
    assert bool(widened) == steady
    assert chained and any(past_an_end)  # (and the rows that ended hold their tokens only)
    if bits is not None:  # the quantized caches were the ones in use: 16-bit ones differ
        _, own_logprobs, _, _ = generate(model, prompts, max_tokens, False, stagger)
        pairs = [zip(own_logprobs[i], plain_logprobs[i], strict=True) for i in own_logprobs]
        assert max(abs(a - b) for row in pairs for a, b in row) > 1e-6


def test_rows_with_penalties_or_a_logit_bias_propose_and_keep_plain_decodings_tokens():
    """Penalties look back at the tokens before each position, proposals among
    them, and a logit bias moves every position: a row with either (a model's
    generation_config.json may give every request a repetition penalty) still
    proposes, and its tokens and logprobs are plain decoding's, beside rows
    with none and rows of other settings."""
    model = tiny_model("llama", scale=1.5)
    kinds = [
        LogitsSettings(repetition_penalty=1.3),
        LogitsSettings(presence_penalty=0.5, frequency_penalty=0.3),
        LogitsSettings(logit_bias=((3, 2.0), (7, -1.5))),
        LogitsSettings(),
    ]

    for seed, stagger, used in ((4, False, kinds[:3]), (5, True, kinds)):
        # (the first run's rows all have processors: what they proposed is theirs)
        def processors(i: int, used: list = used) -> list:
            return make_processors(used[i % len(used)])

        prompts = repetitive_prompts(8, seed)
        max_tokens = [int(n) for n in np.random.default_rng(seed).integers(8, 40, len(prompts))]
        plain, plain_logprobs, _, _ = generate(model, prompts, max_tokens, False, stagger,
                                               processors=processors)  # fmt: skip
        ours, logprobs, _, stats = generate(model, prompts, max_tokens, True, stagger,
                                            processors=processors)  # fmt: skip
        assert ours == plain
        for i in range(len(prompts)):
            assert logprobs[i] == pytest.approx(plain_logprobs[i], abs=1e-4)
        assert 0 < stats.accepted <= stats.proposed
        # The processors were in use: without them the tokens differ.
        assert generate(model, prompts, max_tokens, False, stagger)[0] != plain
    assert any(len(set(t)) > 3 for t in plain), "the model's output should vary"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_draft_models_proposals_leave_greedy_tokens_as_plain_decodings(family):
    """Drafts from a model of the same vocabulary: itself (every proposal
    right), another (most wrong); rows joining mid-flight, long prompts the
    draft catches up on alone, stop at max_tokens."""
    model = tiny_model(family, scale=1.5)
    other = tiny_model(family, scale=1.5, seed=5)
    rng = np.random.default_rng(4)
    prompts = repetitive_prompts(6, 4) + [rng.integers(0, VOCAB, 1200).tolist()]
    max_tokens = [int(n) for n in rng.integers(1, 40, len(prompts))]
    plain, plain_logprobs, _, _ = generate(model, prompts, max_tokens, False, True)
    assert any(len(set(t)) > 3 for t in plain), "the model's output should vary"
    for draft, right in ((model, True), (other, False)):
        ours, logprobs, cached, stats = generate(model, prompts, max_tokens, True, True,
                                                 draft=draft)  # fmt: skip
        assert ours == plain
        for i in range(len(prompts)):
            assert logprobs[i] == pytest.approx(plain_logprobs[i], abs=1e-4)
        assert all(size == tokens for size, tokens in cached.values())
        assert stats.proposed > 0
        if right:
            assert stats.accepted == stats.proposed
        else:
            assert stats.accepted < stats.proposed / 2


def test_a_draft_rows_proposals_grow_while_kept_and_shrink_after_misses():
    rows = DraftRows(tiny_model("llama", scale=1.5))
    tokens = repetitive_prompts(1, 3)[0]
    lengths = []
    for kept in (0, 0, 1, 9, 9, 9):  # each pass keeps this many (at most all)
        proposal = rows.propose({7: (tokens, 1)}, most=4)[7]
        lengths.append(len(proposal))
        kept = min(kept, len(proposal))
        rows.kept({7: kept}, most=4)
        tokens = tokens + [1] + proposal[:kept]
    assert lengths == [4, 2, 1, 2, 3, 4]


class Now(Pacing):
    """Checks proposals in every `every`th run of passes only."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every, self.runs = every, 0

    def start(self, rows: int, uids=()) -> Block:
        self.runs += 1
        return Block(rows, self.runs % self.every == 0)


def test_a_draft_that_fell_behind_plain_passes_catches_up_and_stays_exact():
    model = tiny_model("llama", scale=1.5)
    prompts = repetitive_prompts(4, 9)
    max_tokens = [150, 90, 200, 120]
    plain, _, _, _ = generate(model, prompts, max_tokens, False)
    ours, _, cached, stats = generate(model, prompts, max_tokens, True, draft=model,
                                      pacing=Now(every=9))  # fmt: skip
    assert ours == plain
    assert all(size == tokens for size, tokens in cached.values())
    assert stats.passes >= 2 and stats.accepted == stats.proposed


def test_solo_stream_gains_where_its_proposals_are_right():
    model = tiny_model("llama", scale=1.0)  # repeats itself: lookups are right
    prompts = repetitive_prompts(1, 7)
    plain, _, _, _ = generate(model, prompts, [60], False)
    ours, _, _, stats = generate(model, prompts, [60], True)
    assert ours == plain
    assert stats.accepted > 30 and stats.tokens / stats.passes > 2


def test_stop_tokens_end_a_row_inside_its_accepted_tokens():
    model = tiny_model("llama", scale=1.0)
    prompts = repetitive_prompts(6, 11)
    plain, _, _, _ = generate(model, prompts, [50] * 6, False)
    stop = sorted({t[len(t) // 2] for t in plain if t})[:2]
    plain, _, _, _ = generate(model, prompts, [50] * 6, False, stop=[[s] for s in stop])
    ours, _, cached, stats = generate(model, prompts, [50] * 6, True, stop=[[s] for s in stop])
    assert ours == plain
    assert any(t[-1] in stop and len(t) < 50 for t in ours)
    assert all(size == tokens for size, tokens in cached.values())
    assert stats.accepted > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_row_proposes_no_more_than_it_has_tokens_left(max_tokens):
    """The model as its own draft (every proposal right): a request of a few
    tokens has no more proposed than it can send, and every accepted one is sent."""
    model = tiny_model("llama", scale=1.5)
    prompts = repetitive_prompts(3, 5)
    plain, _, _, _ = generate(model, prompts, [max_tokens] * 3, False)
    ours, _, _, stats = generate(model, prompts, [max_tokens] * 3, True, draft=model)
    assert ours == plain
    assert stats.proposed <= 3 * (max_tokens - 1)
    assert stats.accepted == stats.proposed


@pytest.mark.parametrize("after", [2, 3, 5])
def test_accepted_proposals_count_only_the_tokens_sent(after):
    """Proposals kept past a stop token are not sent, nor counted as accepted:
    a lone row's checking passes each send its pending token and those accepted."""
    model = tiny_model("llama", scale=2.0)  # its output varies: a stop token part-way
    prompts = [np.random.default_rng(3).integers(0, 50, 20).tolist()]
    plain, _, _, _ = generate(model, prompts, [50], False)
    out = plain[0]
    at = next(i for i in range(after, len(out)) if out[i] not in out[:i])
    stop = [[out[at]]]
    plain, _, _, _ = generate(model, prompts, [50], False, stop=stop)
    ours, _, _, stats = generate(model, prompts, [50], True, draft=model, stop=stop)
    assert ours == plain and stats.accepted > 0
    assert stats.tokens == stats.passes + stats.accepted


def test_prompt_lookup_finds_what_a_plain_scan_of_every_occurrence_finds():
    """On any tokens (repetitive or not, few or many distinct): the longest
    suffix of 4 down to 2 tokens that occurred before; of its occurrences the
    latest followed by `most` tokens, else the one followed by the most."""

    def scanned(tokens: list[int], n: int, most: int) -> list[int]:
        for size in range(min(4, n - 1), 1, -1):
            found = [s for s in range(n - size) if tokens[s : s + size] == tokens[n - size : n]]
            if found:
                full = [s for s in found if n - s - size >= most]
                start = full[-1] if full else found[0]
                return tokens[start + size : min(start + size + most, n)]
        return []

    rng = np.random.default_rng(5)
    found = 0
    for case in range(3000):
        length = int(rng.integers(2, 200))
        tokens = rng.integers(0, int(rng.choice([2, 3, 7, 500])), size=length)
        if case % 3 == 0:  # a phrase repeated, as the tokens models repeat
            tokens = np.resize(tokens[: rng.integers(1, 9)], length)
        n, most = int(rng.integers(2, length + 1)), int(rng.integers(1, 16))
        expected = scanned(tokens.tolist(), n, most)
        assert lookup(tokens.astype(np.int64), n, most) == expected, (tokens.tolist(), n, most)
        found += bool(expected)
    assert 1000 < found < 2900  # (both kinds of case met)


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    tokens = np.array([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7, 0], dtype=np.int64)
    # ...5 6 7 last followed by 9 2 (the latest earlier occurrence, not 8 1)
    assert lookup(tokens, 13, 3) == [9, 2, 5]
    assert lookup(tokens, 13, 1) == [9]
    assert lookup(np.array([1, 2, 3, 4]), 4, 3) == []  # nothing recurs


def test_other_streams_tokens_propose_what_followed_the_longest_latest_match():
    from smg_mlx.engine.speculative.shared_history import SharedHistory

    shared = SharedHistory(held=32)
    shared.add([1, 2, 3, 4, 5, 6])
    shared.add([9, 3, 4, 7, 8])
    mine = np.array([0, 2, 3, 4], dtype=np.int64)
    assert shared.lookup(mine, 4, 3, longest=4) == [5, 6]  # 2 3 4 (not 3 4 alone): 5 6, its end
    assert shared.lookup(mine, 3, 2, longest=4) == [4, 5]
    assert shared.lookup(np.array([0, 3, 4]), 3, 3, longest=4) == [7, 8]  # the latest
    assert shared.lookup(np.array([6, 9]), 2, 3, longest=4) == []  # never across two streams
    for i in range(6):  # the oldest go as newer streams come
        shared.add([20 + i, 21 + i, 22 + i])
    assert shared.lookup(mine, 4, 3, longest=4) == []
    assert shared.lookup(np.array([25, 26]), 2, 3, longest=4) == [27]


class Clock:
    """Stands in for the pacing's clock: time moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def paced(monkeypatch) -> tuple[Pacing, Clock, Callable]:
    """A Pacing on a clock that moves only when told, and `run(rows, plain,
    checking)`: `run_block` on both."""
    from smg_mlx.engine.speculative import pacing

    clock = Clock()
    monkeypatch.setattr(pacing.time, "perf_counter", clock)
    paced = Pacing()
    return paced, clock, functools.partial(run_block, paced, clock)


def run_block(
    pacing: Pacing, clock: Clock, rows: int, plain: tuple[float, int], checking: tuple[float, int]
) -> bool:
    """One run of passes, each taking (seconds, tokens) as its kind does:
    whether it checked."""
    block = pacing.start(rows)
    seconds, tokens = checking if block.checking else plain
    while not block.over:
        block.begins()
        new = pacing.new_shape(rows, 5 if block.checking else 1)
        clock.now += 1.0 if new else seconds  # a first pass builds kernels: counts nowhere
        block.ran(tokens, new, checked=block.checking)
    pacing.ended(block)
    return block.checking


def test_pacing_checks_proposals_only_where_that_pays(paced, caplog):
    """And with --log-level debug it says what each run of passes made, beside
    each kind's rate: why it checks where it does (and at info, a pass that
    stalled every stream while its kernels were built)."""
    caplog.set_level(logging.DEBUG, logger="smg_mlx.engine.speculative.pacing")
    pacing, _, run = paced
    plain, paying, losing = (0.010, 8), (0.012, 20), (0.030, 9)
    assert not run(8, plain, paying)  # plain first: the measure to hold against
    # (a shape's first pass, kernels built in a second, untimed: said, a stall every stream saw)
    assert caplog.messages[0] == (
        "speculation, batches of 5 to 8 streams: a plain pass of a new shape took 1.0 s "
        "(mlx building its kernels; every stream waited)"
    )
    assert run(8, plain, paying)  # checking not measured yet: tried
    assert caplog.messages[-2:] == [
        "speculation, batches of at most 8: 8 checking passes made 160 tokens in 96.0 ms; "
        "tokens a second, checking 1667, plain 800",
        "speculation, batches of 5 to 8 streams: checking proposals pays (1667 tokens a "
        "second against 800 plain)",
    ]
    assert run(8, plain, paying)  # 20 tokens in 12 ms beat 8 in 10
    assert run(8, plain, paying)
    for _ in range(8):
        run(8, plain, losing)  # compute-bound, or proposals mostly wrong
    assert not run(8, plain, losing)
    assert not pacing.start(2).checking  # another batch size has its own measures: none yet
    checks = sum(run(8, plain, losing) for _ in range(200))
    assert 1 <= checks <= 4  # a losing checking run is tried again now and then, less often


def test_while_checking_keeps_winning_plain_passes_are_timed_ever_more_rarely(paced):
    """Where checking makes several tokens a pass, each plain block timed to see
    whether it still pays costs most of its passes' worth: the longer checking
    keeps winning, the rarer they get, but never gone for good; when plain
    passes win, checking is tried again after RETRY blocks as before."""
    from smg_mlx.engine.speculative import pacing as paced_module

    pacing, _, run = paced
    plain, paying, losing = (0.010, 8), (0.012, 40), (0.030, 9)
    ran = [run(8, plain, paying) for _ in range(400)]
    plain_blocks = [i for i, checked in enumerate(ran) if not checked]
    assert plain_blocks[0] == 0 and 4 <= len(plain_blocks) <= 10  # (every 9th: 45)
    gaps = [b - a for a, b in zip(plain_blocks[1:], plain_blocks[2:], strict=False)]
    assert gaps == sorted(gaps) and max(gaps) == paced_module.MOST_PLAIN_RETRY
    ran = [run(8, plain, losing) for _ in range(40)]
    turned = ran.index(False)  # once its moving average sinks below plain's
    assert turned <= 8 and sum(ran[turned:]) <= 3  # then trials now and then


def test_where_checking_turns_to_pay_or_not_the_log_says_so_now_and_then(paced, caplog):
    """An operator sees (info) whether speculation pays at each batch size,
    and when that changes, but not at every run: rates near each other may
    cross back and forth."""
    caplog.set_level(logging.INFO, logger="smg_mlx.engine.speculative.pacing")
    _, clock, run = paced
    plain, paying, losing = (0.010, 8), (0.012, 20), (0.030, 9)
    for _ in range(4):
        run(8, plain, paying)
    for _ in range(40):
        run(8, plain, losing)
    said = [m for m in caplog.messages if "checking proposals" in m]
    assert said == [
        "speculation, batches of 5 to 8 streams: checking proposals pays (1667 tokens a "
        "second against 800 plain)"
    ]  # the turn came within ten seconds of that line
    clock.now += 10
    for _ in range(12):
        run(8, plain, losing)
    said = [m for m in caplog.messages if "checking proposals" in m]
    assert len(said) == 2 and said[1].startswith(
        "speculation, batches of 5 to 8 streams: checking proposals does not pay ("
    )
    assert said[1].endswith("plain); plain passes, a trial now and then")


def test_checking_that_stops_at_a_width_says_so(paced, caplog):
    """Where the width checking ran at loses and the narrower one waits for
    its trial, checking has stopped: the log says so then, not only once a
    trial has measured the narrower width."""
    caplog.set_level(logging.INFO, logger="smg_mlx.engine.speculative.pacing")
    _, clock, _ = paced
    pacing = Pacing(most=8)
    plain = (0.010, 8)
    for _ in range(4):
        run_widths(pacing, clock, 8, plain, dict.fromkeys((8, 4, 2, 1), (0.012, 40)))
    clock.now += 10
    wrong = dict.fromkeys((8, 4, 2, 1), (0.100, 8))  # (sinks before a narrower one is probed)
    ran = []
    while ran[-2:] != [0, 0]:  # until checking stopped: plain passes until a trial
        ran.append(run_widths(pacing, clock, 8, plain, wrong))
    said = [m for m in caplog.messages if "checking proposals" in m]
    assert len(said) == 2 and said[1].startswith(
        "speculation, batches of 5 to 8 streams: checking proposals does not pay ("
    ) and "up to 8 proposed a stream, against 800 plain);" in said[1], said


def serve_one_at_a_time(pacing: Pacing, clock: Clock, requests: int, wrong_first: int) -> float:
    """Requests of 64 tokens one after another, as at one stream: a plain
    pass takes 10 ms, a checking one 15 and makes three tokens, but one only
    over a stream's first `wrong_first` tokens (its proposals wrong there). A
    run under way when a stream ends is never timed (the batch stood empty).
    The tokens a second served."""
    for width in range(10):
        pacing.new_shape(1, width)  # (no pass here builds kernels)
    started, tokens = clock.now, 0
    for _ in range(requests):
        made = 1  # (the prefill's)
        while made < 64:
            block = pacing.start(1)
            while not block.over and not pacing.losing(block) and made < 64:
                block.begins()
                clock.now += 0.015 if block.checking else 0.010
                n = 1 if not block.checking or made < wrong_first else min(3, 64 - made)
                made += n
                block.ran(n, False, checked=block.checking, rows={0: n} if made < 64 else {})
            if made < 64:
                pacing.ended(block)
        tokens += 63
    return tokens / (clock.now - started)


@pytest.mark.parametrize("most", [4, 8])
def test_one_stream_keeps_checking_where_only_its_first_proposals_are_wrong(paced, most):
    """One stream at a time, each answer's first dozen proposals wrong and
    the rest right: checking gains 1.45x over the answers in all. Its runs at
    an answer's start end two passes in (they lose there); those must weigh
    as the passes they ran, not as whole runs, and a trial after checking lost
    must not fall at an answer's start every time (each answer runs as many
    runs): else the worker decodes plainly for good."""
    _, clock, _ = paced
    always = serve_one_at_a_time(Pacing(always=True), clock, 50, wrong_first=12)
    plain = serve_one_at_a_time(Pacing(), clock, 50, wrong_first=64)
    pacing = Pacing(most=most)
    serve_one_at_a_time(pacing, clock, 50, wrong_first=12)
    served = serve_one_at_a_time(pacing, clock, 200, wrong_first=12)
    assert always > 1.4 * plain
    assert served >= 0.95 * always, (served, always, plain)


def run_widths(pacing: Pacing, clock: Clock, rows: int, plain: tuple[float, int],
               widths: dict[int, tuple[float, int]]) -> int:  # fmt: skip
    """One run of passes, each taking (seconds, tokens) as its kind does, a
    checking one as its width does: the width it checked at (0: plain)."""
    block = pacing.start(rows)
    seconds, tokens = widths[block.width] if block.checking else plain
    while not block.over and not pacing.losing(block):
        block.begins()
        new = pacing.new_shape(rows, 1 + block.width)
        clock.now += 1.0 if new else seconds
        block.ran(tokens, new, checked=block.checking)
    pacing.ended(block)
    return block.width


def test_checking_runs_at_the_width_that_pays_most_as_the_batch_turns_compute_bound(paced):
    """A pass checking more proposals a row keeps more where they are right,
    and costs more once the device computes rather than waits. Where the
    widest checking passes lose to plain ones but narrower ones win, the
    worker checks at the narrower width that makes the most tokens a second,
    and follows as that changes: where passes cost the same at any width
    again, it goes back to the widest."""
    _, clock, _ = paced
    pacing = Pacing(most=8)
    plain = (0.010, 8)  # 800 tokens a second
    busy = {8: (0.060, 40), 4: (0.030, 30), 2: (0.012, 20), 1: (0.011, 14)}  # 2: 1667
    ran = [run_widths(pacing, clock, 8, plain, busy) for _ in range(200)]
    assert ran[:3] == [0, 8, 0]  # plain first; the widest loses: plain passes...
    assert [w for w in ran if w][:2] == [8, 4]  # ...until a trial is due, at the next width
    late = Counter(ran[100:])
    assert late[2] >= 75 and late[8] <= 5, late  # neighbours now and then, and plain
    waiting = {w: (0.012, 8 + 4 * w) for w in busy}  # the widest: 3333
    ran = [run_widths(pacing, clock, 8, plain, waiting) for _ in range(300)]
    late = Counter(ran[200:])
    assert late[8] >= 70, late


def test_checking_sends_passes_while_the_one_before_runs_only_where_that_pays(paced):
    """A call may send several checking passes, each built while the one before
    runs (where the host's time, not the device's, bounds a pass), each
    proposing as if the one before kept all: its widest width. Where wrong
    proposals waste the passes after them and that loses to one pass a call,
    checking runs one pass a call; where it wins, it keeps to it."""
    _, clock, _ = paced
    pacing = Pacing(most=8, chain=4)
    plain = (0.010, 8)  # 800 tokens a second
    one = {8: (0.012, 14), 4: (0.011, 11), 2: (0.011, 9), 1: (0.010, 8)}  # 8: 1167
    wasted = {**one, 32: (0.048, 30)}  # 625
    ran = [run_widths(pacing, clock, 8, plain, wasted) for _ in range(200)]
    assert [w for w in ran if w][0] == 32  # tried first, then...
    late = Counter(ran[100:])
    assert late[8] >= 75 and late[32] <= 8, late  # ...now and then only
    pays = {**one, 32: (0.040, 80)}  # 2000
    ran = [run_widths(pacing, clock, 8, plain, pays) for _ in range(300)]
    late = Counter(ran[200:])
    assert late[32] >= 70, late


def test_once_proposals_turn_right_checking_is_tried_at_the_widest_width_again(paced):
    """Proposals wrong at first (a conversation that did not repeat itself)
    make every width lose, down to the narrowest; once they turn right (the
    answer asked for again) the wide passes that now pay most are found, not
    only the narrowest that lost before (at 16 streams on the GPU checking
    stayed at one proposal a stream while eight were right)."""
    _, clock, _ = paced
    pacing = Pacing(most=8)
    plain = (0.010, 8)  # 800 tokens a second
    wrong = {w: (0.030, 9) for w in (8, 4, 2, 1)}
    ran = [run_widths(pacing, clock, 8, plain, wrong) for _ in range(120)]
    assert [w for w in ran if w][:4] == [8, 4, 2, 1]
    right = {8: (0.014, 72), 4: (0.013, 40), 2: (0.013, 10), 1: (0.012, 9)}
    ran = [run_widths(pacing, clock, 8, plain, right) for _ in range(400)]
    late = Counter(ran[300:])
    assert late[8] >= 70, late


@pytest.mark.parametrize("drafter", ["prompt lookup", "draft model"])
def test_the_width_a_checking_pass_runs_at_bounds_each_rows_proposals(drafter):
    """A block's width is the most proposals a row has checked in one pass
    (where the batch's passes turned compute-bound), and the tokens are the
    plain ones still."""

    class Narrow(Pacing):
        def start(self, rows: int, uids=()) -> Block:
            return Block(rows, True, 2)

    model = tiny_model("llama", scale=1.5)
    prompts = repetitive_prompts(6, 3)
    max_tokens = [40, 33, 50, 45, 38, 47]
    plain, _, _, _ = generate(model, prompts, max_tokens, False)
    widths = []
    check = SpeculativeGenerationBatch._check

    def counted(self, pending, drafts, width, *rest, **more):
        widths.append(max(map(len, drafts)))
        return check(self, pending, drafts, width, *rest, **more)

    SpeculativeGenerationBatch._check = counted
    try:
        draft = model if drafter == "draft model" else None
        ours, _, _, stats = generate(model, prompts, max_tokens, True, pacing=Narrow(), draft=draft)
    finally:
        SpeculativeGenerationBatch._check = check
    assert ours == plain
    assert widths and max(widths) == 2 and stats.accepted > 0


def test_trials_that_lose_cost_a_small_share_of_the_time_however_much_each_costs(
    monkeypatch,
):
    """A draft model that fell behind while plain passes ran catches up on
    every row's tokens in a trial's first pass: a trial can cost as much as a
    second of plain passes. Trials that lose are then spaced out so that
    what they lose is a few percent of the time, not a trial every few runs."""
    from smg_mlx.engine.speculative import pacing as paced

    clock = Clock()
    monkeypatch.setattr(paced.time, "perf_counter", clock)
    pacing = Pacing()
    pacing.new_shape(8, 1), pacing.new_shape(8, 5)  # (no pass here builds kernels)
    plain_pass, catching_up, checking_pass = 0.010, 1.0, 0.030
    started, tokens = clock.now, 0
    for _ in range(1500):
        block = pacing.start(8)
        first = True
        while not block.over and not pacing.losing(block):
            block.begins()
            if block.checking:
                clock.now += (catching_up if first else 0.0) + checking_pass
            else:
                clock.now += plain_pass
            first = False
            block.ran(8, False, checked=block.checking)
            tokens += 8
        pacing.ended(block)
    rate = tokens / (clock.now - started)
    # Plain passes alone: 800 tokens a second (trials spaced by doubling waits
    # alone: 748); each trial here loses about a second.
    assert rate >= 0.96 * 8 / plain_pass


def test_runs_of_passes_are_timed_only_where_nothing_else_ran_beside_them(
    model_dir, monkeypatch, caplog
):
    """Pacing times decoding passes: a run during which the batch grew past
    its size, or its lane prefilled a document, says nothing of either size's
    passes (a one-stream run had 'made 15 tokens in 8 passes' and a prompt's
    prefill in its time); a question joining stays in the run."""
    from contextlib import nullcontext

    from mlx_lm import load

    from smg_mlx.engine.batch.lanes import PROMPT_TOKENS_TIMED, Lanes
    from smg_mlx.engine.schedule.step_plan import SHORT
    from smg_mlx.engine.speculative import pacing as paced

    caplog.set_level(logging.DEBUG, logger=paced.__name__)
    model = load(str(model_dir))[0]
    drafting = Drafting(most=4, pacing=Pacing(), stats=DraftStats())
    lanes = Lanes(model, mx.default_stream(mx.default_device()), 512, nullcontext, drafting)
    lanes.open(batch_size=8, prefill_rows=4)
    lane = lanes[SHORT]
    lane.insert([helpers.prompt(20, 1)], [200])
    for _ in range(12):
        lanes.next(SHORT, 512)
    rows = lane._generation_batch
    assert rows._block.counted
    lane.insert([helpers.prompt(PROMPT_TOKENS_TIMED // 4, 2)], [200])  # a question: timed
    lanes.next(SHORT, 512)
    assert rows._block.counted
    lane.insert([helpers.prompt(2 * PROMPT_TOKENS_TIMED, 3)], [200])  # a document
    lanes.next(SHORT, 512)
    assert not rows._block.counted
    for _ in range(10):  # (a run of three rows under way)
        lanes.next(SHORT, 512)
    lane.insert([helpers.prompt(8, 4 + i) for i in range(4)], [200] * 4)  # seven rows
    for _ in range(24):
        lanes.next(SHORT, 512)
    lanes.close()
    plain_run = re.compile(r"speculation, batches of at most \d+: \d+ plain")
    runs = [m for m in caplog.messages if plain_run.match(m)]
    assert runs, "no run of plain passes ended"
    for line in runs:  # "... at most N: P plain passes made T tokens ...": T <= N P
        size = int(line.split("at most ")[1].split(":")[0])
        passes, tokens = (int(w) for w in re.findall(r"(\d+) plain passes made (\d+)", line)[0])
        assert tokens <= size * passes, line


def test_pacing_times_plain_passes_again_while_checking_wins(paced):
    """Plain passes timed once in a slow moment (kernels being built, a
    burst of prompts) must not keep a checking run going that loses to
    plain passes as they run now: plain runs again now and then, and once
    its measure is fresh the worker stops checking."""
    _, _, run = paced
    slow_plain, plain, checking = (0.050, 8), (0.010, 8), (0.030, 9)
    assert not run(8, slow_plain, checking)
    assert run(8, plain, checking)  # 9 tokens in 30 ms beat 8 in 50
    ran = [run(8, plain, checking) for _ in range(60)]
    assert not all(ran)  # plain timed again...
    assert sum(ran[-30:]) <= 2  # ...and then checking stops, but for a trial now and then


def test_a_checking_run_with_nothing_to_propose_counts_as_plain(monkeypatch):
    """Runs meant to check whose rows found nothing to propose ran plain
    passes: they time plain decoding, not checking, so the first run that
    has proposals is still tried against plain passes."""
    from smg_mlx.engine.speculative import pacing as paced

    clock = Clock()
    monkeypatch.setattr(paced.time, "perf_counter", clock)
    pacing = Pacing()
    for _ in range(3):
        block = pacing.start(8)
        while not block.over:
            block.begins()
            clock.now += 0.010
            block.ran(8, pacing.new_shape(8, 1))
        pacing.ended(block)
    assert run_block(pacing, clock, 8, (0.010, 8), (0.012, 20))


def run_rows(pacing: Pacing, clock: Clock, plain: float, checking: float,
             made: dict[int, int], void: bool = False) -> Block:  # fmt: skip
    """One run of passes over the rows of `made`, a plain pass taking `plain`
    seconds and making each row a token, a checking one `checking` seconds and
    making each row as many as `made` says (`void`: its time holds other work
    from its first pass on, a prompt prefilled beside it)."""
    block = pacing.start(len(made), made)
    while not block.over and not pacing.losing(block):
        block.begins()
        new = pacing.new_shape(len(made), 5 if block.checking else 1)
        clock.now += 1.0 if new else checking if block.checking else plain
        tokens = made if block.checking else dict.fromkeys(made, 1)
        block.ran(sum(tokens.values()), new, checked=block.checking, rows=tokens)
        if void:
            block.void()
    pacing.ended(block)
    return block


@pytest.mark.parametrize("checking_pass, keeps_checking", [(0.016, False), (0.0102, True)])
def test_checking_runs_only_where_rows_with_nothing_right_to_propose_keep_their_pace(
    paced, caplog, checking_pass, keeps_checking
):
    """Half the streams propose right (five tokens a pass), half have nothing
    right to propose (one a pass). Checking passes that cost 1.6 plain ones
    make more tokens in all, but slow the second half to 62% of their pace
    while they run: the worker checks only as much as keeps those streams
    within 3% of their plain pace over the whole run (the others gain), and
    says why it stops. Passes that cost 2% more keep every stream within 3%
    of its pace: it checks throughout."""
    caplog.set_level(logging.INFO, logger="smg_mlx.engine.speculative.pacing")
    pacing, clock, _ = paced
    made = {uid: 5 if uid % 2 else 1 for uid in range(8)}
    for _ in range(4):  # (each kind's first pass builds kernels: a second that counts nowhere)
        run_rows(pacing, clock, 0.010, checking_pass, made)
    started = clock.now
    runs = [run_rows(pacing, clock, 0.010, checking_pass, made) for _ in range(400)]
    # (each stream's tokens, by the passes of each kind of run)
    tokens = {uid: sum(run.passes * (n if run.checking else 1) for run in runs)
              for uid, n in made.items()}  # fmt: skip
    paces = {uid: tokens[uid] * 0.010 / (clock.now - started) for uid in made}
    checks = [run.checking for run in runs]
    if keeps_checking:
        assert sum(checks[200:]) >= 170
        return
    assert sum(checks), checks
    assert min(paces.values()) >= 0.96, paces
    assert paces[1] > 1.1, paces  # (and the right ones gain)
    said = [m for m in caplog.messages if "checking proposals" in m]
    assert said[1] == (
        "speculation, batches of 5 to 8 streams: checking proposals does not pay (1500 tokens a "
        "second against 800 plain, 4 streams below 97% of plain pace); plain passes until "
        "they catch up"
    ), said


def test_a_slow_plain_pass_now_and_then_does_not_make_checking_look_cheap(paced):
    """Rows end and join far more often once checking has them end apart, and
    the pass where one does takes several plain ones' time: here one pass in
    each plain run takes 80 ms, the others 10. Checking passes take 16 ms: less
    than a plain run's mean pass, but 1.6 usual ones. Half the streams have
    nothing right to propose: they are held within 3% of their pace at the
    usual plain pass (the slow passes' time aside), and the others still gain."""
    pacing, clock, _ = paced
    made = {uid: 5 if uid % 2 else 1 for uid in range(8)}
    stalled = 0.0

    def run() -> Block:
        nonlocal stalled
        block = pacing.start(len(made), made)
        while not block.over and not pacing.losing(block):
            block.begins()
            new = pacing.new_shape(len(made), 5 if block.checking else 1)
            slow = not block.checking and block.passes == 3
            clock.now += 1.0 if new else 0.016 if block.checking else 0.080 if slow else 0.010
            stalled += 0.070 if slow and not new else 0.0
            tokens = made if block.checking else dict.fromkeys(made, 1)
            block.ran(sum(tokens.values()), new, checked=block.checking, rows=tokens)
        pacing.ended(block)
        return block

    for _ in range(4):  # (both kinds measured, first passes aside)
        run()
    started, stalled = clock.now, 0.0
    runs = [run() for _ in range(400)]
    tokens = {uid: sum(r.passes * (n if r.checking else 1) for r in runs)
              for uid, n in made.items()}  # fmt: skip
    paces = {uid: tokens[uid] * 0.010 / (clock.now - started - stalled) for uid in made}
    assert any(r.checking for r in runs)
    assert min(paces.values()) >= 0.96, paces
    assert paces[1] > 1.1, paces


def test_runs_timed_beside_other_work_still_count_what_they_cost_each_stream(paced):
    """Runs whose time holds other work (prompts prefilled beside them) say
    nothing of the rates, but their streams ran their passes: where every run
    is such, streams with nothing right to propose are still held within 3%
    of their plain pace, as checking passes were measured to cost them."""
    pacing, clock, _ = paced
    made = {uid: 5 if uid % 2 else 1 for uid in range(8)}
    for _ in range(4):  # (both kinds measured, first passes aside)
        run_rows(pacing, clock, 0.010, 0.016, made)
    started = clock.now
    runs = [run_rows(pacing, clock, 0.010, 0.016, made, void=True) for _ in range(400)]
    tokens = {uid: sum(run.passes * (n if run.checking else 1) for run in runs)
              for uid, n in made.items()}  # fmt: skip
    paces = {uid: tokens[uid] * 0.010 / (clock.now - started) for uid in made}
    assert any(run.checking for run in runs)
    assert min(paces.values()) >= 0.96, paces


def test_streams_joining_a_checking_batch_are_judged_once_they_could_have_proposed(paced):
    """Every stream's proposals are right, but only from its second checking
    call: its first tokens repeat nothing yet. A call chains four passes, costs
    eight plain ones and makes a stream four tokens, twenty once it proposes
    right. Requests of 128 tokens end and join all along: the streams just
    joined must not stop checking for the batch."""
    pacing, clock, _ = paced
    calls = dict.fromkeys(range(8), 1)  # by stream: its checking calls so far
    checks = []
    for _ in range(200):
        block = pacing.start(8, list(calls))
        while not block.over and not pacing.losing(block):
            block.begins()
            new = pacing.new_shape(8, 9 if block.checking else 1)
            clock.now += 1.0 if new else 0.080 if block.checking else 0.010
            made = {u: (20 if n else 4) if block.checking else 1 for u, n in calls.items()}
            block.ran(sum(made.values()), new, checked=block.checking, rows=made,
                      sent=4 if block.checking else 1)  # fmt: skip
            if block.checking:
                calls = {u: n + 1 for u, n in calls.items()}
        pacing.ended(block)
        checks.append(block.checking)
        gone = min(calls)  # (one request ends, the next joins)
        del calls[gone]
        pacing.left([gone])
        calls[gone + 8] = 0
        pacing.admit(gone + 8, 128)
    assert sum(checks[100:]) >= 90, checks


def test_streams_sampled_beside_repeating_ones_are_not_slowed_by_their_checking(monkeypatch):
    """Two streams repeat themselves (greedy: proposals right), two are sampled
    at temperature 1 (next to nothing right to propose): where a checking pass
    costs 1.6 plain ones, checking makes more tokens in all but would slow the
    sampled streams to about 62% of their pace while it runs, so the worker
    checks only as much as keeps them within 3% of their plain pace (a plain
    pass makes each a token in 10 ms); the greedy ones gain."""
    from smg_mlx.engine.speculative import pacing

    clock = Clock()
    monkeypatch.setattr(pacing.time, "perf_counter", clock)
    hot = make_sampler(temp=1.0)
    made: dict[int, int] = {}
    stats = run_paced(1.0, clock, lambda checked: 0.016 if checked else 0.010, calls=600,
                      samplers=[None, hot, None, hot], made=made)  # fmt: skip
    paces = {i: n * 0.010 / clock.now for i, n in made.items()}
    assert stats.passes > 0 and stats.accepted > 0, stats  # checked, right...
    assert min(paces[0], paces[2]) > 1.05, paces  # ...and the greedy streams gain
    assert min(paces[1], paces[3]) >= 0.96, paces


def run_paced(
    scale: float, clock: Clock, after: Callable[[bool], float], calls: int,
    samplers: list | None = None, made: dict[int, int] | None = None,
) -> DraftStats:  # fmt: skip
    """Four repeating streams through `calls` calls of a paced generator over a
    model of `scale` (`samplers`: each stream's; None: greedy), the clock moved
    on after each call by `after(whether it checked)` seconds for each pass it
    ran (a call checking proposals may run several): what speculation did
    (and in `made`, each stream's tokens by its place in the prompts)."""
    model = tiny_model("llama", scale=scale)
    stats = DraftStats()
    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=4)
    generator._generation_batch = SpeculativeGenerationBatch.start(
        model, generator.sampler, Drafting(most=4, pacing=Pacing(), stats=stats)
    )
    uids = generator.insert(repetitive_prompts(4, 5), [1500] * 4, samplers=samplers)
    for _ in range(calls):
        checked = stats.passes
        for response in generator.next()[1]:
            if made is not None:
                made[uids.index(response.uid)] = made.get(uids.index(response.uid), 0) + 1
        checked = stats.passes - checked
        clock.now += after(True) * checked if checked else after(False)
    generator.close()
    return stats


@pytest.mark.parametrize("after_checking, keeps_checking", [(0.012, True), (0.110, False)])
def test_pacing_counts_what_a_checking_pass_costs_until_the_next_pass(
    monkeypatch, after_checking, keeps_checking
):
    """Passes are timed from one to the next: where the engine's work after
    checking passes (the wait they add, their tokens' handling) eats what
    they gained, the worker stops checking; where it does not, it goes on."""
    from smg_mlx.engine.speculative import pacing

    clock = Clock()
    monkeypatch.setattr(pacing.time, "perf_counter", clock)
    calls = 240
    # (a model that repeats itself: proposals are right)
    stats = run_paced(1.0, clock, lambda checked: after_checking if checked else 0.010, calls)
    assert stats.passes >= 1  # tried
    if keeps_checking:
        assert stats.passes > calls / 2 and stats.accepted > 0
    else:
        # Tried, lost, tried again now and then: each trial ends a few passes in.
        assert stats.passes <= 12, stats.passes


def test_a_first_checking_pass_leaves_out_its_pass_not_its_proposals(monkeypatch):
    """The first pass of a shape goes untimed (the backend may build kernels
    for it), but not what made its proposals: a draft model catching up on
    every row's tokens first costs seconds, and a trial that paid them lost."""
    from smg_mlx.engine.speculative import pacing

    clock = Clock()
    monkeypatch.setattr(pacing.time, "perf_counter", clock)
    proposals = SpeculativeGenerationBatch._proposals
    calls = []

    def catching_up_first(self, likely, pending, most):
        if not calls:
            clock.now += 5.0  # (every row's tokens through the draft)
        calls.append(1)
        return proposals(self, likely, pending, most)

    monkeypatch.setattr(SpeculativeGenerationBatch, "_proposals", catching_up_first)
    stats = run_paced(1.0, clock, lambda checked: 0.010, calls=240)
    assert calls and stats.passes <= 12, stats.passes  # (counted as free: over 200)


def test_layers_whose_rows_drift_far_apart_line_up_together_each_row_intact(monkeypatch):
    """Rows taking back different counts pass after pass drift apart; past
    SPREAD columns a model's layers are lined up again, every one of them, in
    one go (their padding, alike in every layer, read back once): each row
    still holds exactly its own entries in every layer, and the batch no more
    columns than its longest row needs."""
    from mlx_lm.models.cache import BatchKVCache

    from smg_mlx.engine.speculative import ragged_kv

    reads = []
    tolist = mx.array.tolist
    monkeypatch.setattr(mx.array, "tolist", lambda a: reads.append(a.shape) or tolist(a),
                        raising=False)  # fmt: skip
    mx.random.seed(5)
    layers = [ragged_kv.ragged(BatchKVCache([0, 0, 0])) for _ in range(4)]
    kept: list[list[list[mx.array]]] = [[[] for _ in range(3)] for _ in layers]
    for n, back in ((40, [0, 30, 5]), (200, [0, 190, 20]), (100, [0, 90, 40])):
        for layer, rows in zip(layers, kept, strict=True):
            keys = mx.random.normal((3, 2, n, 8))
            layer.update_and_fetch(keys, keys)
            for i, row in enumerate(rows):
                row.append(keys[i, :, : n - back[i], :])
        reads.clear()
        ragged_kv.rewind_layers(layers, back)
    assert all(layer._ends is None for layer in layers)  # lined up, at the last rewind
    assert len(reads) == 1, reads
    for layer, rows in zip(layers, kept, strict=True):
        assert layer._idx == 340  # the longest row's entries, no column more
        for i, row in enumerate(rows):
            mine = layer.extract(i)
            assert mx.array_equal(mine.keys[0, :, : mine.offset], mx.concatenate(row, axis=1))


def test_lining_rows_up_after_checking_counts_as_checking_time(monkeypatch):
    """Checking passes leave rows ending apart, and lining them up again
    before plain passes copies the cache: that copy is what the checking run
    cost. Where it eats what the run gained, the worker stops checking; the
    plain passes after it are not charged with it."""
    from smg_mlx.engine.speculative import pacing, ragged_kv

    clock = Clock()
    monkeypatch.setattr(pacing.time, "perf_counter", clock)
    compact = ragged_kv.Ragged.compact
    lined_up = []

    def slow_compact(self, *args: int | None) -> int | None:
        if self._ends is not None:
            clock.now += 2.0  # a layer (of two): more than a run of checking blocks gains
            lined_up.append(self)
        return compact(self, *args)

    monkeypatch.setattr(ragged_kv.Ragged, "compact", slow_compact)
    # (proposals often right, and rows keep apart)
    stats = run_paced(1.5, clock, lambda checked: 0.010, calls=240)
    assert lined_up  # rows did end apart, and were lined up
    # A run of blocks until plain is timed again, then trials now and then, not
    # kept (where the copy is cheap, checking goes on: over 200 of the 240).
    assert stats.passes <= 100, stats.passes


def test_rows_that_ended_apart_line_up_when_checking_stops_and_stay_exact():
    """A checking pass leaves rows' caches ending at different columns; they
    stay so from one checking block to the next (lining them up copies the
    cache) and, once pacing stops checking, end together again (plain passes
    run plain); every token is still the one plain decoding gives."""

    class First(Pacing):
        def __init__(self, runs: int) -> None:
            super().__init__()
            self.runs = runs

        def start(self, rows: int, uids=()) -> Block:
            self.runs -= 1
            return Block(rows, self.runs >= 0)

    model = tiny_model("llama", scale=1.5)
    prompts = repetitive_prompts(6, 3)
    max_tokens = [60, 45, 80, 52, 70, 66]
    plain, _, _, _ = generate(model, prompts, max_tokens, False)
    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    stats = DraftStats()
    batch = generator._generation_batch = SpeculativeGenerationBatch.start(
        model, generator.sampler, Drafting(most=4, pacing=First(3), stats=stats)
    )
    line_ups = []
    line_up = batch._line_up
    batch._line_up = lambda: line_ups.append(line_up())
    which = dict(zip(generator.insert(prompts, max_tokens), range(len(prompts)), strict=True))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    apart = False
    for call in range(200):
        for r in generator.next()[1]:
            tokens[which[r.uid]].append(r.token)
        ends = [getattr(c, "_ends", None) for c in batch.prompt_cache]
        apart = apart or any(e is not None for e in ends)
        if call == 40:
            assert all(e is None for e in ends)  # checking stopped: lined up again
    generator.close()
    assert apart and stats.accepted < stats.proposed  # rows did end apart
    assert len(line_ups) == 1  # after the third checking block, not after each
    assert [tokens[i] for i in range(len(prompts))] == plain


def test_seeded_requests_draw_the_tokens_they_draw_without_speculation():
    """A seeded request's sampler takes one key a token: a pass checking its
    proposals draws each position with that token's key and moves on by the
    tokens kept, so its output is the same tokens, not only the same distribution."""
    model = tiny_model("llama", scale=0.7, vocab=4, seed=3)
    prompts = [[1] * (8 + i) for i in range(12)]
    seeds = list(range(100, 112))
    plain, _, _, _ = generate(model, prompts, [12] * 12, False, stagger=True, seeds=seeds)
    ours, _, _, stats = generate(model, prompts, [12] * 12, True, stagger=True, seeds=seeds)
    assert ours == plain
    assert len({tuple(t) for t in plain}) > 6, "the draws differ from seed to seed"
    assert 0 < stats.accepted < stats.proposed


def _chi_square_bound(df: int) -> float:
    """The chi-square statistic's 0.999 quantile (Wilson-Hilferty)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_tokens_follow_the_models_distribution():
    vocab = 4
    model = tiny_model("llama", scale=0.7, vocab=vocab, seed=3)
    prompt = [1] * 10  # proposes 1s, which this model samples about half the time
    rows, steps = 512, 3
    sampler = make_sampler(temp=1.0)
    counts: Counter = Counter()
    proposed = accepted = 0
    for _ in range(6):
        outs, _, _, stats = generate(model, [prompt] * rows, [steps] * rows, True,
                                     sampler=sampler, rows=rows)  # fmt: skip
        counts.update(tuple(t) for t in outs)
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
    assert accepted > 0.1 * sum(counts.values()), "proposals were checked and kept"
    # The exact probability of each 3-token continuation, a token at a time.
    expected = {}
    logits = model(mx.array([prompt]))[0, -1]
    first = mx.softmax(logits).tolist()
    for a in range(vocab):
        second = mx.softmax(model(mx.array([prompt + [a]]))[0, -1]).tolist()
        for b in range(vocab):
            third = mx.softmax(model(mx.array([prompt + [a, b]]))[0, -1]).tolist()
            for c in range(vocab):
                expected[(a, b, c)] = first[a] * second[b] * third[c]
    total = sum(counts.values())
    # Cells expected fewer than 5 times are pooled, as the test asks.
    big = [k for k, p in expected.items() if p * total >= 5]
    stat = sum((counts[k] - expected[k] * total) ** 2 / (expected[k] * total) for k in big)
    rest_expected = total - sum(expected[k] * total for k in big)
    rest_seen = total - sum(counts[k] for k in big)
    if rest_expected >= 5:
        stat += (rest_seen - rest_expected) ** 2 / rest_expected
    assert stat < _chi_square_bound(len(big)), (stat, len(big))


# ---- through a worker ----


def _repeating(length: int, seed: int) -> list[int]:
    """A prompt repeating a phrase of ordinary token ids: prompt lookup finds it."""
    phrase = helpers.prompt(5 + seed % 7, seed)
    return (phrase * (length // len(phrase) + 1))[:length]


def _answers_as(stub, cases: list[tuple[list[int], dict]], want: list) -> None:
    """The cases, all at once, twice (the second time from the prefix cache),
    give `want`: tokens, finish reasons and logprobs."""
    for _ in range(2):
        with ThreadPoolExecutor(len(cases)) as pool:
            got = list(pool.map(lambda c: helpers.generate(stub, c[0], **c[1]), cases))
        for g, w in zip(got, want, strict=True):
            assert g.tokens == w.tokens
            assert g.complete.finish_reason == w.complete.finish_reason
            seen = [lp for c in g.chunks for lp in c.output_logprobs.token_logprobs]
            expected = [lp for c in w.chunks for lp in c.output_logprobs.token_logprobs]
            assert seen == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("family", ["demo", "llama", "qwen3"])
def test_a_worker_speculating_answers_as_one_that_does_not(family, model_dir, family_model,
                                                           start_worker):  # fmt: skip
    """Greedy output, logprobs, penalties and logit bias, stop tokens, max_tokens
    edges, concurrent streams, prefix-cache hits and aborts: the same with
    speculation as without. The demo
    model repeats itself (proposals right), the families' models do not (mostly wrong)."""
    model = model_dir if family == "demo" else family_model(family)
    speculating = start_worker(model, speculative="always")
    plain = start_worker(model, speculative="off")
    cases = [(_repeating(40 + 9 * i, i), {"max_tokens": 1 + 7 * i}) for i in range(6)]
    cases.append((_repeating(30, 3), {"max_tokens": 24, "logprobs": 3}))
    cases.append((_repeating(44, 6), {"max_tokens": 24, "repetition_penalty": 1.1}))
    cases.append(
        (
            _repeating(36, 7),
            {"max_tokens": 24, "presence_penalty": 0.4, "logit_bias": {20: 1.5, 30: -1.0}},
        )
    )
    first = helpers.generate(plain.stub, _repeating(50, 4), max_tokens=12).tokens
    cases.append((_repeating(50, 4), {"max_tokens": 30, "stop_token_ids": [first[6]]}))
    hit = _repeating(50, 4) + first + helpers.prompt(3, 2)  # extends a cached entry
    cases.append((hit, {"max_tokens": 20}))
    want = [helpers.generate(plain.stub, ids, **settings) for ids, settings in cases]
    assert any(len(set(w.tokens)) > 3 for w in want) or family == "demo"
    _answers_as(speculating.stub, cases, want)
    helpers.abort_after(speculating.stub, _repeating(60, 5), 5)
    again = helpers.generate(speculating.stub, _repeating(60, 5), max_tokens=16)
    assert again.tokens == helpers.generate(plain.stub, _repeating(60, 5), max_tokens=16).tokens
    stats = speculating.worker.engine.speculation
    assert stats.passes > 0 and stats.proposed > 0
    if family == "demo":
        assert stats.accepted > stats.proposed / 2
    assert plain.worker.engine.speculation.passes == 0


def test_the_same_prompt_again_is_proposed_what_the_cached_answer_said(family_model,
                                                                     start_worker):  # fmt: skip
    """A prompt the prefix cache has seen, with its answer after it (asked again,
    retried): the answer's tokens are proposed, and kept where the model says
    them again; a prompt whose own tokens never recur proposes nothing."""
    model = family_model("llama")  # its greedy output does not repeat itself
    worker = start_worker(model, speculative="always")
    ids = helpers.prompt(40, 3)
    first = helpers.generate(worker.stub, ids, max_tokens=40)
    assert len(set(first.tokens)) > 10, "the model's output should vary"
    stats = worker.worker.engine.speculation
    before = (stats.proposed, stats.accepted)
    again = helpers.generate(worker.stub, ids, max_tokens=40)
    assert again.tokens == first.tokens
    assert again.complete.cached_tokens == len(ids) - 1
    stats = worker.worker.engine.speculation
    assert stats.accepted - before[1] >= 30  # the answer, bar the first tokens
    assert stats.accepted - before[1] == stats.proposed - before[0]
    # A longer answer than the cached one: proposals run out where it ended.
    longer = helpers.generate(worker.stub, ids, max_tokens=60)
    assert longer.tokens[:40] == first.tokens


def test_a_stream_is_proposed_what_another_stream_said(family_model, start_worker):
    """A conversation carried on where its history is not cached (here: no
    prefix cache): its next tokens are proposed from the tokens another
    stream left as it finished, and kept where the model says them again.
    A stream whose tokens occur nowhere before proposes nothing."""
    model = family_model("llama")  # its greedy output does not repeat itself
    worker = start_worker(model, speculative="always", prompt_cache_bytes=0)
    stats = worker.worker.engine.speculation
    question = helpers.prompt(40, 3)
    first = helpers.generate(worker.stub, question, max_tokens=40).tokens
    assert len(set(first)) > 10, "the model's output should vary"
    assert stats.proposed == 0  # nothing recurred: nothing to propose
    on = helpers.generate(worker.stub, [*question, *first[:10]], max_tokens=30)
    assert on.tokens == first[10:]
    assert on.complete.cached_tokens == 0
    stats = worker.worker.engine.speculation
    assert stats.accepted >= 20 and stats.accepted == stats.proposed


def test_a_worker_with_a_draft_model_answers_as_one_without(model_dir, tmp_path, start_worker):
    """Drafts from the model itself (every proposal right) and from another model
    of the same vocabulary (most wrong): greedy output, logprobs, stop tokens,
    prefix-cache hits and aborts as without speculation."""
    other = build_model(tmp_path / "other", ["--seed", "3"])
    plain = start_worker(model_dir, speculative="off")
    cases = [(helpers.prompt(30 + 40 * i, i), {"max_tokens": 2 + 9 * i}) for i in range(5)]
    cases.append((helpers.prompt(20, 7), {"max_tokens": 24, "logprobs": 2}))
    first = helpers.generate(plain.stub, helpers.prompt(50, 4), max_tokens=12).tokens
    cases.append((helpers.prompt(50, 4), {"max_tokens": 30, "stop_token_ids": [first[6]]}))
    want = [helpers.generate(plain.stub, ids, **settings) for ids, settings in cases]
    assert len({t for w in want for t in w.tokens}) > 4, "the model's output should vary"
    for draft in (model_dir, other):
        drafting = start_worker(model_dir, speculative="always", draft_model=draft)
        _answers_as(drafting.stub, cases, want)
        helpers.abort_after(drafting.stub, helpers.prompt(60, 5), 5)
        stats = drafting.worker.engine.speculation
        assert stats.drafter == "draft_model" and stats.proposed > 0
        if draft == model_dir:
            assert stats.accepted > 0.9 * stats.proposed
        else:
            assert stats.accepted < stats.proposed


def test_a_draft_catching_up_on_a_long_prompt_stays_within_the_memory_budget(
    tmp_path, start_worker, caplog
):
    """A row new to the draft model is fed its prompt in chunks: each chunk's
    attention holds scores for every token it attends to, so at a long
    context a full chunk took several times the budget (a 12,700-token prompt
    under 80 MiB peaked at 475 MiB). Its chunks now fit in what the step's
    plan leaves free, and its output is the model's. A draft that reads less
    context than the model is served with a warning at start-up."""
    caplog.set_level(logging.WARNING, "smg_mlx")
    model = build_model(tmp_path / "long", ["--context-length", "4096", "--seed", "5"])
    draft = build_model(tmp_path / "draft", ["--context-length", "2048", "--seed", "6"])
    ids = helpers.prompt(2500, 3)
    plain = start_worker(model, speculative="off")
    want = helpers.generate(plain.stub, ids, max_tokens=24)
    weights = plain.worker.engine.memory.weights
    budget = 2 * weights + 20 * 2**20  # (the draft's weights are the model's size)
    plain.stop()
    before = helpers.memory_in_use()
    drafting = start_worker(model, speculative="always", draft_model=draft,
                            memory_budget_bytes=budget, prompt_cache_bytes=0)  # fmt: skip
    got = helpers.generate(drafting.stub, ids, max_tokens=24)
    assert got.tokens == want.tokens
    engine = drafting.worker.engine
    assert engine.speculation.proposed > 0  # the draft caught up, and proposed
    assert engine.memory.peak - before <= budget
    assert "reads 2048 tokens of context, the model 4096: past that its proposals" in caplog.text


def test_a_draft_whose_ids_are_padded_otherwise_proposes_for_the_model(model_dir, tmp_path,
                                                                      start_worker):  # fmt: skip
    """The same tokenizer, ids padded to another count (as Qwen2.5's 0.5B and
    7B are): served either way round, the model's output as without a draft;
    ids the model writes past the draft's embedding reach it as its last id,
    and it proposes none the model cannot read."""
    wider = build_model(tmp_path / "wider", ["--vocab-size", "1024"])  # the same tokenizer
    cases = [(helpers.prompt(30 + 40 * i, i), {"max_tokens": 8 + 9 * i}) for i in range(4)]
    for model, draft in ((model_dir, wider), (wider, model_dir)):
        plain = start_worker(model, speculative="off")
        want = [helpers.generate(plain.stub, ids, **settings) for ids, settings in cases]
        drafting = start_worker(model, speculative="always", draft_model=draft)
        _answers_as(drafting.stub, cases, want)
        assert drafting.worker.engine.speculation.proposed > 0
    narrow = load(str(model_dir))[0]
    padded = PaddedOtherwise(narrow, reads=384, proposes=None)
    assert mx.array_equal(padded(mx.array([[5, 700]])), narrow(mx.array([[5, 383]])))
    assert PaddedOtherwise(narrow, reads=None, proposes=300)(mx.array([[5]])).shape[-1] == 300


def test_a_draft_model_of_another_vocabulary_is_refused_at_start_up(
    model_dir, tmp_path, refused, caplog
):
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    caplog.set_level(logging.INFO, "smg_mlx")
    # A cache folder of its own: no batch check's verdict remembered from before.
    refusal = refused(model_dir, draft_model=other, speculative="auto",
                      prompt_cache_dir=tmp_path / "cache")  # fmt: skip
    assert refusal.exit_code == 2
    # Refused before the model's weights load (a large model's take a while).
    assert "loading the weights" not in caplog.text, caplog.text
    said = str(refusal)
    assert f"--draft-model {other}: its tokenizer's vocabulary is not the model's (token " in said
    assert " is id 101 there, 100 here)" in said  # the lowest id that differs
    code, lines = helpers.serve("--model", str(model_dir), "--draft-model", str(other),
                                "--speculative", "off")  # fmt: skip
    assert code == 2 and "--speculative off turns off" in lines[-1]
    code, lines = helpers.serve("--model", str(model_dir), "--draft-model", "./no/such/draft",
                                "--port", "0", cwd=tmp_path)  # fmt: skip
    assert code == 2  # a path, never taken for a repo id
    assert f"--draft-model: {tmp_path}/no/such/draft is not a model directory" in lines[-1]


def test_a_draft_model_not_smaller_than_the_model_is_served_with_a_warning(
    model_dir, tmp_path, caplog
):
    """A draft as large as the model (itself) or larger reads as many bytes a
    pass as the model: its proposals cannot pay. Served (benchmarks draft with
    the model itself), but the log says so; a smaller draft gets no warning."""
    from smg_mlx.config import EngineConfig
    from smg_mlx.engine.speculative.choice import draft_for

    model = load(str(model_dir))[0]
    larger = build_model(tmp_path / "larger", ["--hidden-size", "128", "--layers", "3"])
    smaller = build_model(tmp_path / "smaller", ["--hidden-size", "32", "--layers", "1"])
    for draft, warned in ((model_dir, True), (larger, True), (smaller, False)):
        config = EngineConfig(model_path=model_dir, speculative="auto", draft_model=draft)
        with caplog.at_level(logging.WARNING, logger="smg_mlx.engine.speculative.choice"):
            caplog.clear()
            assert draft_for(config, model, None) is not None
        said = f"draft model {draft} is not smaller than the model (its weights "
        assert (said in caplog.text) is warned, caplog.text
        if warned:
            assert "name a smaller draft of the model's family" in caplog.text


def test_speculation_asked_for_but_off_is_a_warning_naming_the_flag_that_turns_it_off(
    start_worker, model_dir, caplog
):
    with caplog.at_level(logging.WARNING, logger="smg_mlx.engine.speculative.choice"):
        start_worker(model_dir, speculative="always", batching="equal-lengths")
    assert (
        "speculative decoding: off (--batching equal-lengths: a checking pass runs streams of "
        "different lengths together, which that mode avoids)" in caplog.text
    )


def test_the_passes_bench_times_plain_and_checking_passes_apart():
    from bench.spec_passes import measure

    model = tiny_model("llama", scale=1.0)  # repeats itself: proposals are right
    plain = measure(model, rows=4, mode="plain", most=4, seconds=0.3)
    always = measure(model, rows=4, mode="always", most=4, seconds=0.3)
    assert plain["checking_passes"] == 0 and plain["tok_s"] > 0
    assert always["checking_passes"] >= always["calls"] > 0
    assert always["accepted"] > 0 and always["tok_s"] * always["ms_per_call"] / 1000 > 4


def test_the_copies_bench_times_each_change_of_rows_on_the_models_cache(model_dir, tmp_path):
    """`python -m bench.batch_copies`: a row leaving and one joining, rows lined
    up, and a row written in place, each timed on a model's cache."""
    from bench.batch_copies import main

    out = tmp_path / "copies.json"
    assert main(["--model", str(model_dir), "--rows", "4", "--runs", "1", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["rows"] == 4
    assert set(result["ms"]) == {
        "a row leaving and one joining",
        "rows lined up",
        "a row written in place",
    }
    assert all(ms > 0 for ms in result["ms"].values())


def test_speculation_is_off_with_the_reason_where_rows_could_not_take_tokens_back_or_ranks_differ(
    model_dir, caplog
):
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from smg_mlx.config import EngineConfig
    from smg_mlx.engine.speculative.choice import drafting_for

    class Model:  # what drafting_for reads of a model: its caches
        def __init__(self, *caches):
            self.caches = caches

        def make_cache(self):
            return list(self.caches)

    class Ranks:
        def size(self):
            return 2

    config = EngineConfig(model_path=model_dir, speculative="always")
    plain = Model(KVCache(), KVCache())
    assert drafting_for(config, plain, None, batched=True, draft=None) is not None
    with caplog.at_level(logging.WARNING, logger="smg_mlx.engine.speculative.choice"):
        for model, group, why in (
            (Model(KVCache(), RotatingKVCache(max_size=64)), None,
             "this model's caches include RotatingKVCache, which cannot take tokens back"),
            (Model(ArraysCache(2), KVCache()), None,
             "this model's caches include ArraysCache, which cannot take tokens back"),
            (plain, Ranks(), "several ranks"),
        ):  # fmt: skip
            caplog.clear()
            assert drafting_for(config, model, group, batched=True, draft=None) is None
            assert f"speculative decoding: off ({why})" in caplog.text
        # A draft model named: the log says it goes unused.
        caplog.clear()
        named = EngineConfig(model_path=model_dir, speculative="auto", draft_model=model_dir)
        assert drafting_for(named, plain, Ranks(), batched=True, draft=None) is None
        assert f"off (several ranks; --draft-model {model_dir} is not used)" in caplog.text
    # No flag given: off, and the log says how to turn it on (not that it was asked off).
    with caplog.at_level(logging.INFO, logger="smg_mlx.engine.speculative.choice"):
        caplog.clear()
        assert drafting_for(EngineConfig(model_path=model_dir), plain, None, True, None) is None
        assert "off (--speculative off, the default; --speculative auto turns on" in caplog.text


def test_a_stream_proposes_up_to_the_drafters_own_default_unless_num_draft_tokens_says(
    model_dir, caplog
):
    """Prompt lookup's proposals cost nothing to make: up to 15 a stream a
    pass by default; a draft model's each cost a pass of the draft: up to 8.
    --num-draft-tokens sets either, and the start-up log says which."""
    from mlx_lm.models.cache import KVCache

    from smg_mlx.config import EngineConfig
    from smg_mlx.engine.speculative.choice import Draft, drafting_for

    class Model:  # what drafting_for reads of a model: its caches
        def make_cache(self):
            return [KVCache(), KVCache()]

    draft = Draft(Model(), None)
    for given, drafter, most in ((None, None, 15), (None, draft, 8), (4, None, 4), (12, draft, 12)):
        config = EngineConfig(model_path=model_dir, speculative="auto", num_draft_tokens=given)
        with caplog.at_level(logging.INFO, logger="smg_mlx.engine.speculative.choice"):
            caplog.clear()
            drafting = drafting_for(config, Model(), None, batched=True, draft=drafter)
        assert drafting is not None and drafting.most == most
        assert f"up to {most} proposed tokens a stream a pass" in caplog.text


@pytest.mark.parametrize("speculative", ["auto", "always", "off"])
def test_on_cuda_a_speculating_worker_keeps_cuda_graphs_and_steady_widths(
    model_dir, monkeypatch, speculative
):
    # Plain passes run slower without CUDA graphs, and one row's checking
    # passes ran faster with them (several rows attend over steady widths on
    # CUDA, so their kernels replay): the worker leaves the setting to mlx.
    from smg_mlx.config import EngineConfig
    from smg_mlx.engine.batch import loading

    monkeypatch.setattr(batch_kv, "_steady", False)
    environ = {"MLX_PTX_CACHE_DIR": "/nonexistent"}
    monkeypatch.setattr(loading.os, "environ", environ)
    monkeypatch.setattr(loading.mx.cuda, "is_available", lambda: True)
    config = EngineConfig(model_path=model_dir, speculative=speculative, completion_batch_size=32)
    loading.load_for(config, None)
    assert "MLX_USE_CUDA_GRAPHS" not in environ
    assert batch_kv._steady
