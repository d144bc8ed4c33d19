"""The lanes: a BatchGenerator of mlx-lm's for short prompts and one for long
ones, and what they hand back, read where mlx-lm keeps it (engine thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator

from smg_mlx.engine.batch.ended_rows import EndingGenerationBatch, one_row
from smg_mlx.engine.batch.joining import join_ready
from smg_mlx.engine.batch.sampling import batch_generator
from smg_mlx.engine.schedule.step_plan import LONG, SHORT
from smg_mlx.engine.speculative.decoding import Drafting, DraftStats, SpeculativeGenerationBatch
from smg_mlx.engine.speculative.prompt_lookup import Ahead
from smg_mlx.engine.types import SpeculationStats, TokenLogprobs

# Prompt tokens a lane may prefill in a call (a question joining) beside the
# decoding passes speculation's pacing times; more (a document) and the run
# of passes under way is left out of its measures.
PROMPT_TOKENS_TIMED = 256


class Sampled(NamedTuple):
    """A token mlx-lm has sampled but not returned yet (see `Lanes.pending`)."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: None = None


class Lanes:
    """A BatchGenerator for each lane, indexed by SHORT and LONG, all on one
    stream; `buffers()` wraps each pass (`engine.memory.buffer_cache`)."""

    def __init__(
        self, model: nn.Module, stream: mx.Stream, max_chunk: int,
        buffers: Callable[[], AbstractContextManager[None]], drafting: Drafting | None,
    ) -> None:  # fmt: skip
        self._model = model
        self._stream = stream
        self._max_chunk = max_chunk
        self._buffers = buffers
        self._generators: tuple[BatchGenerator, ...] = ()
        self.drafting = drafting  # speculative decoding's (engine.speculative); None: off

    def open(self, batch_size: int, prefill_rows: int) -> None:
        """Fresh generators (the old ones closed): empty lanes of these sizes."""
        self.close()
        self._generators = tuple(
            batch_generator(
                self._model,
                completion_batch_size=batch_size,
                prefill_batch_size=prefill_rows,
                prefill_step_size=self._max_chunk,
                stream=self._stream,
            )
            for _ in (SHORT, LONG)
        )
        self._joined: list[list] = [[], []]  # by lane: the prompts `next` says ended next
        if self.drafting is not None:  # (the rows of lanes closed left without a word)
            self.drafting.pacing.left()
        for generator in self._generators:  # the decoding rows prompts move into
            generator._generation_batch = (
                EndingGenerationBatch.start(self._model, generator.sampler)
                if self.drafting is None
                else SpeculativeGenerationBatch.start(self._model, generator.sampler, self.drafting)
            )

    @property
    def speculation(self) -> SpeculationStats:
        """What speculative decoding has done since start."""
        if self.drafting is None:
            return SpeculationStats()
        drafter = "prompt_lookup" if self.drafting.draft is None else "draft_model"
        return SpeculationStats(**vars(self.drafting.stats), drafter=drafter)

    def uncount_speculation(self) -> None:
        if self.drafting is not None:
            self.drafting.stats = DraftStats()
            if self.drafting.shared is not None:  # (the warm-up's streams: no client's)
                self.drafting.shared.clear()

    def __getitem__(self, lane: int) -> BatchGenerator:
        return self._generators[lane]

    def __iter__(self) -> Iterator[BatchGenerator]:
        return iter(self._generators)

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes the lanes hold now."""
        return sum(generator.prompt_cache_nbytes for generator in self._generators)

    def next(self, lane: int, chunk: int) -> tuple[list, list]:
        """One call of a lane's BatchGenerator, prefilling at most `chunk`
        tokens a row: its prompt and generation responses. Prompts it leaves
        with their last token to go join the decoding rows now, without a pass
        of their own (`engine.batch.joining`): the call after says they ended."""
        generator = self._generators[lane]
        generator.prefill_step_size = chunk
        with self._buffers(), generator.stats() as work:
            prefilling, responses = generator.next()
            with mx.stream(self._stream):
                joined, self._joined[lane] = self._joined[lane], join_ready(generator)
        if self.drafting is not None:
            # Speculation's pacing times each lane's own decoding passes: not beside
            # the other lane's, nor beside its own prefill of more than a question.
            for other in self._generators:
                if other is not generator or work.prompt_tokens > PROMPT_TOKENS_TIMED:
                    other._generation_batch.disturbed()
        return prefilling + joined, responses

    def checking(self, lane: int) -> bool:
        """Whether the lane's decoding rows run checking passes now (speculation),
        which wait for the pass before them anyway."""
        return self.drafting is not None and self._generators[lane]._generation_batch.checking

    def exercise_speculation(self, lane: int) -> list:
        """Each kind of pass speculation adds, once, on the lane's decoding rows
        (the warm-up's; see `SpeculativeGenerationBatch.exercise`): their
        responses, as `next` gives them."""
        if self.drafting is None:
            return []
        with self._buffers():
            return self._generators[lane]._generation_batch.exercise()

    def expect(self, lane: int, uid: int, ahead: Ahead) -> None:
        """Row `uid` of the lane has a cached continuation of its prompt to
        propose from (speculation by prompt lookup; nothing where it is off)."""
        if self.drafting is not None:
            self._generators[lane]._generation_batch.expect(uid, ahead)

    def forget(self, lane: int, uids: list[int]) -> None:
        """Rows of the lane removed (those not decoding yet may have been expected)."""
        if self.drafting is not None:
            self._generators[lane]._generation_batch.forget(uids)

    def move_to_long(
        self, lane: int, uid: int, token: int, left: int, options: tuple
    ) -> tuple[int, list[int]]:
        """Take row `uid` out of `lane` with its cache as it is, and put it in
        the long lane again with `token` still to process and `left` tokens to
        go (`options`: its sampler, processors and stop sequences): its uid
        there, and the tokens its cache holds."""
        row, tokens = self._generators[lane].remove([uid], return_prompt_caches=True)[uid]
        cache = one_row(row)
        sampler, processors, stop = options
        (moved,) = self._generators[LONG].insert(
            [[token]],
            max_tokens=[left],
            caches=[cache],
            all_tokens=[list(tokens)],
            samplers=[sampler],
            logits_processors=[processors],
            stop_sequences=[stop],
        )
        return moved, tokens

    def pending(self, lane: int, uids: list[int]) -> list[Sampled]:
        """The tokens mlx-lm has sampled for these decoding rows of the lane
        and not returned yet (its own state: read here alone)."""
        rows = self._generators[lane]._generation_batch  # mlx-lm's decoding rows
        tokens = rows._next_tokens.tolist()
        where = {uid: i for i, uid in enumerate(rows.uids)}
        return [Sampled(uid, tokens[where[uid]], rows._next_logprobs[where[uid]]) for uid in uids]

    def close(self) -> None:
        for generator in self._generators:
            generator.close()
        self._generators = ()


def logprobs(responses: list, wanted: list[int | None]) -> list[TokenLogprobs | None]:
    """Each response's logprobs: its token's and the top `wanted` (None: not asked)."""
    found: list[TokenLogprobs | None] = [None] * len(responses)
    rows, lazy = [], []
    # Build every row's top-n lazily, then evaluate them all at once.
    for i, (r, n) in enumerate(zip(responses, wanted, strict=True)):
        if n is None:
            continue
        # int32 indices, as the tokens are (engine.batch.sampling: kernels).
        top = mx.array([], dtype=mx.int32)
        if n:
            top = mx.argpartition(-r.logprobs, kth=n - 1)[:n].astype(mx.int32)
            top = top[mx.argsort(-r.logprobs[top]).astype(mx.int32)]
        rows.append(i)
        # A slice, not x[i]: mlx takes that with i made a uint32 array.
        lazy.append((r.logprobs[r.token : r.token + 1], top, r.logprobs[top]))
    if lazy:
        mx.eval(lazy)
    for i, (chosen, top, values) in zip(rows, lazy, strict=True):
        found[i] = TokenLogprobs(chosen.item(), tuple(top.tolist()), tuple(values.tolist()))
    return found
