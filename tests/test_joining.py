"""Prompts join the decoding rows without a pass of their own (engine.batch.joining)."""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from test_speculative import tiny_model

from smg_mlx.engine.batch.ended_rows import one_row
from smg_mlx.engine.batch.lanes import Lanes
from smg_mlx.engine.schedule.step_plan import SHORT
from smg_mlx.engine.speculative.decoding import Drafting, DraftStats, SpeculativeGenerationBatch
from smg_mlx.engine.speculative.pacing import Pacing


def _requests(count: int) -> list[tuple[list[int], int]]:
    """Prompts of 3-40 tokens (prefilled two or more a row: passes of one token
    a row decode), each with 1-24 tokens to generate (1: the first token ends it)."""
    rng = np.random.default_rng(3)
    return [
        (rng.integers(0, 50, size=int(rng.integers(3, 40))).tolist(), int(rng.integers(1, 25)))
        for _ in range(count)
    ]


def _serve(model, requests, running: int, call, generator: BatchGenerator, monkeypatch) -> dict:
    """Every request through `generator` by `call()` (a call of it: prompt and
    decoding responses), at most `running` at once, the next admitted as one
    ends: each request's tokens and logprobs, the call in which each prompt was
    said to end, and the model's passes of one token a row: all, and those over
    rows joining alone (mlx-lm's, as it moves prefilled rows to decoding)."""
    passes = {"one token": 0, "joining alone": 0}
    forward, step = type(model).__call__, GenerationBatch._step

    def counted(self, inputs, *args, **kwargs):
        passes["one token"] += inputs.shape[1] == 1
        return forward(self, inputs, *args, **kwargs)

    def joining_alone(self):
        passes["joining alone"] += self is not generator._generation_batch
        return step(self)

    monkeypatch.setattr(type(model), "__call__", counted)
    monkeypatch.setattr(GenerationBatch, "_step", joining_alone)
    waiting, which = list(enumerate(requests)), {}
    tokens = {i: [] for i in range(len(requests))}
    logprobs = {i: [] for i in range(len(requests))}
    prompt_ended: dict[int, int] = {}
    done, calls = 0, 0

    def admit() -> None:
        i, (prompt, max_tokens) = waiting.pop(0)
        which[generator.insert([prompt], [max_tokens])[0]] = i

    for _ in range(running):
        admit()
    while done < len(requests):
        calls += 1
        prefilling, responses = call()
        for r in prefilling:
            if r.end_of_prompt:
                assert which[r.uid] not in prompt_ended, "a prompt ended twice"
                prompt_ended[which[r.uid]] = calls
        for r in responses:
            i = which[r.uid]
            tokens[i].append(r.token)
            logprobs[i].append(r.logprobs[r.token].item())
            if r.finish_reason is not None:
                done += 1
                if waiting:
                    admit()
    monkeypatch.undo()
    return dict(tokens=tokens, logprobs=logprobs, prompt_ended=prompt_ended, passes=passes)


@pytest.mark.parametrize("speculative", [False, True])
def test_prompts_join_the_decoding_rows_without_a_pass_of_their_own(speculative, monkeypatch):
    """(Speculating, a row joins in a call's first checking pass, and decodes
    on in the passes chained after it.)"""
    model = tiny_model("llama", scale=1.5)
    requests = _requests(30)
    chained_on = []  # calls whose first pass had rows joining, and a pass after it
    check, ahead = SpeculativeGenerationBatch._check, SpeculativeGenerationBatch.rewind_ahead

    def checked(self, pending, drafts, width, joining, *rest, **more):
        self.chains = 0
        out = check(self, pending, drafts, width, joining, *rest, **more)
        chained_on.append(bool(joining) and self.chains > 0)
        return out

    def counted(self, counts):
        self.chains += 1
        return ahead(self, counts)

    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=4)
    theirs = _serve(model, requests, 6, generator.next, generator, monkeypatch)

    drafting = Drafting(most=4, pacing=Pacing(always=True), stats=DraftStats())
    lanes = Lanes(model, mx.default_stream(mx.default_device()), 512, nullcontext,
                  drafting if speculative else None)  # fmt: skip
    lanes.open(batch_size=8, prefill_rows=4)
    monkeypatch.setattr(SpeculativeGenerationBatch, "_check", checked)
    monkeypatch.setattr(SpeculativeGenerationBatch, "rewind_ahead", counted)
    ours = _serve(model, requests, 6, lambda: lanes.next(SHORT, 512), lanes[SHORT], monkeypatch)

    assert any(len(set(t)) > 3 for t in theirs["tokens"].values()), "output should vary"
    assert ours["tokens"] == theirs["tokens"]
    for i in theirs["logprobs"]:
        assert ours["logprobs"][i] == pytest.approx(theirs["logprobs"][i], abs=1e-4)
    # Each prompt is said to end (its first token sampled) in the call mlx-lm
    # says so, or sooner: rows joining leave room for the next prompts a call
    # earlier.
    ended = [(ours["prompt_ended"][i], theirs["prompt_ended"][i]) for i in theirs["prompt_ended"]]
    assert all(o <= t for o, t in ended) and len(ended) == len(requests)
    assert theirs["passes"]["joining alone"] >= 10
    assert ours["passes"]["joining alone"] == 0
    if not speculative:  # (checking passes run several tokens a row)
        fewer = theirs["passes"]["one token"] - ours["passes"]["one token"]
        assert fewer >= theirs["passes"]["joining alone"] / 2
    else:
        assert any(chained_on)


def test_a_row_removed_while_joining_leaves_the_others_exact_and_its_cache_whole():
    """A request aborted between the call that prefilled it (it joined the
    decoding rows, its last prompt token not run yet) and the next pass."""
    model = tiny_model("llama", scale=1.5)
    first, second = _requests(2)
    alone = BatchGenerator(model)
    (uid,) = alone.insert([first[0]], [24])
    expected = []
    while len(expected) < 24:
        expected += [r.token for r in alone.next()[1] if r.uid == uid]

    lanes = Lanes(model, mx.default_stream(mx.default_device()), 512, nullcontext, None)
    lanes.open(batch_size=8, prefill_rows=4)
    lane = lanes[SHORT]
    (kept,) = lane.insert([first[0]], [24])
    tokens = []
    for _ in range(3):
        tokens += [r.token for r in lanes.next(SHORT, 512)[1]]
    (left,) = lane.insert([second[0]], [24])
    tokens += [r.token for r in lanes.next(SHORT, 512)[1]]  # it prefills, then joins
    assert left in lane._generation_batch.uids
    cache, held = lane.remove([left], return_prompt_caches=True)[left]
    # Its cache holds what was prefilled, all but the last prompt token, as its tokens say.
    assert list(held) == second[0][:-1]
    assert one_row(cache)[0].offset == len(held)
    for _ in range(24):
        responses = lanes.next(SHORT, 512)[1]
        assert all(r.uid == kept for r in responses)
        tokens += [r.token for r in responses]
    assert tokens == expected
