"""How a call of the decoding rows checks proposals: its passes, and the tokens each row keeps
(engine thread only).

mlx-lm's `GenerationBatch` keeps, for each row, its tokens in the cache and
one token sampled but not yet returned (`_next_tokens`), and it starts each
pass before it returns the last one's tokens. A pass that checks proposals
keeps that state exact: it runs each row's pending token y and proposals
d1..dk (rows with fewer are padded; their extra positions are not kept),
samples every position with the row's own sampler, and keeps d1..da for as
long as each equals the sample before it. The row returns y, d1..da; the
sample after da becomes its pending token; its cache takes back the rest.
Each token returned is thus one the row's sampler drew from the model's own
distribution given the tokens before it, as plain decoding draws it: greedy
decoding gives the same tokens, sampling the same distribution, and every
logprob returned is the model's.

Such a pass must see its rows' latest tokens before it is recorded, so it
waits for the pass before it, where mlx-lm would overlap them (its layers
go to the device as they are recorded: `layer_waits.sent_layer_by_layer`).
Under prompt lookup a call records up to CHAIN passes, each after the first
while the one before runs, on the guess that every row keeps all its
proposals (`CheckingPasses._check`): the device waits for the host once a
call, not once a pass. When and what rows propose: `decoding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from smg_mlx.engine.batch.layer_waits import sent_layer_by_layer
from smg_mlx.engine.batch.row_places import PlacedGenerationBatch
from smg_mlx.engine.batch.sampling import CONTEXT
from smg_mlx.engine.speculative.ragged_kv import ragged

# Checking passes a call runs at most, each after the first recorded while the
# one before runs, on the guess that every row keeps all its proposals there.
CHAIN = 2
# Positions (rows x tokens a row) a call runs in more than one pass, at most:
# each pass in flight holds its logits over the vocabulary at every position,
# and large batches, which wait on the host least, would hold the most.
CHAIN_POSITIONS = 256


@dataclass
class CheckedPass:
    """A checking pass as recorded (`CheckingPasses._check`)."""

    drafts: list[list[int]]  # each row's proposals
    width: int  # tokens a row
    sampled: mx.array  # each position's sample, by row
    logprobs: mx.array
    keeps: list  # by row, where its sampler keeps its own key (`_sample`)
    counts: list[bool]  # whether each row's part counts, as far as known


class CheckingPasses(PlacedGenerationBatch):
    """`PlacedGenerationBatch` whose calls may check proposals, several tokens a
    row; what proposes them is the subclass's (`decoding.SpeculativeGenerationBatch`)."""

    drafting: Any  # `decoding.Drafting`: the stats, the most proposed, one width
    _rows: dict[int, Any]  # prompt lookup's rows (`prompt_lookup.RowDrafts`), by uid
    _draft_rows: Any  # the draft model's rows (`draft_model.DraftRows`); None: prompt lookup
    _steps: int

    def _check(self, pending: list[int], drafts: list[list[int]], width: int, joining: list[int],
               later: list[list[list[int]]] = ()) -> tuple[list, dict[int, int]]:  # fmt: skip
        """One pass over every row's pending token and proposals (module
        docstring), `width` tokens a row: rows with fewer proposals are padded
        (positions whose tokens are not kept; see `Drafting.one_width`). Rows
        `joining` run their prompts' last tokens: the sample after it is their
        first token, and they return nothing.

        Then a pass for each of `later`'s proposals (by row), each recorded
        while the one before runs, so that the device does not wait for the
        host between them: a row's first token there is the previous pass's
        sample after its last proposal, its part counting only where that
        pass kept all its proposals and it did not end there; a row whose part
        does not count takes back what the pass wrote, and in the passes
        recorded after that runs its pending token alone.
        Its responses, and the tokens each row that decodes on made, by uid
        (`pacing.Block.ran`)."""
        rows = len(self.uids)
        self.prompt_cache = [ragged(c) for c in self.prompt_cache]
        # int32, as every token array is (engine.batch.sampling: kernels).
        padded = [
            [y, *d, *[y] * (width - 1 - len(d))] for y, d in zip(pending, drafts, strict=True)
        ]
        inputs = mx.array(padded, dtype=mx.int32)
        proposals = [[] if i in joining else d for i, d in enumerate(drafts)]
        passes = [self._record(inputs, proposals, pending)]
        beyond = [width] * rows  # each row's entries past its tokens (written, not kept yet)
        ended = [False] * rows
        next_tokens, next_logprobs = list(pending), list(self._next_logprobs)
        kept_tokens: list[list[int]] = [[] for _ in range(rows)]
        kept_logprobs: list[list] = [[] for _ in range(rows)]
        finishes: list[str | None] = [None] * rows
        accepted: dict[int, int] = {}  # proposals kept, by row
        for at in range(1 + len(later)):
            current = passes[at]
            if at < len(later):
                passes.append(self._guessed(current, later[at], next_tokens, ended, beyond))
            mx.eval(current.sampled, current.logprobs, next_logprobs)
            sampled = current.sampled.tolist()
            for i in range(rows):
                if not current.counts[i]:
                    continue
                y, proposal = next_tokens[i], current.drafts[i]
                kept = 0
                while kept < len(proposal) and proposal[kept] == sampled[i][kept]:
                    kept += 1
                tokens = [y, *proposal[:kept]]
                if kept and self.logits_processors and self.logits_processors[i]:
                    # What its processors look back at next (its pending token went in
                    # as the pass was built, `_processed`).
                    self._token_context[i].update_and_fetch(mx.array(proposal[:kept], mx.int32))
                chosen = [next_logprobs[i], *(current.logprobs[i, j] for j in range(kept))]
                finish = None if i in joining else self._finish(i, tokens)
                if finish is not None:
                    tokens = tokens[: finish[1] + 1]
                    ended[i], finishes[i] = True, finish[0]
                if proposal:
                    if self._draft_rows is None:
                        self._rows[self.uids[i]].fared(self._steps, len(proposal), kept)
                    accepted[self.uids[i]] = kept
                    self.drafting.stats.proposed += len(proposal)
                    # (those sent: none past a stop token)
                    self.drafting.stats.accepted += len(tokens) - 1
                self.tokens[i].extend(tokens)
                beyond[i] -= len(tokens)
                kept_tokens[i] += tokens
                kept_logprobs[i] += chosen[: len(tokens)]
                if current.keeps[i] is not None:  # the draws kept: the proposals and the next token
                    current.keeps[i](kept + 1)
                next_tokens[i], next_logprobs[i] = sampled[i][kept], current.logprobs[i, kept]
                if (finish is not None or kept < len(proposal)) and at + 1 < len(passes):
                    passes[at + 1].counts[i] = False  # its first token there was not this
        # (a row that ended keeps its entries until the filter below drops them)
        self.rewind(beyond)
        if self._draft_rows is not None:
            self._draft_rows.kept(accepted, self.drafting.most)
        out = self._responses([(i, kept_tokens[i], kept_logprobs[i], finishes[i])
                               for i in range(rows) if i not in joining])  # fmt: skip
        made = {self.uids[i]: len(kept_tokens[i])
                for i in range(rows) if not ended[i] and i not in joining}  # fmt: skip
        self.drafting.stats.passes += len(passes)
        self.drafting.stats.tokens += len(out)
        self._current_tokens = mx.array(pending, dtype=self._next_tokens.dtype)
        self._next_tokens = mx.array(next_tokens, dtype=self._current_tokens.dtype)
        self._next_logprobs = next_logprobs
        if any(ended):
            self.filter([i for i in range(rows) if not ended[i]])
        return out, made

    def _record(self, inputs: mx.array, drafts: list[list[int]],
                pending: list[int] | None = None) -> CheckedPass:  # fmt: skip
        """A checking pass over `inputs` (each row's first token and proposals
        `drafts`, padded), sent to the device; `pending`: the first tokens,
        where known (the logits processors' context)."""
        with sent_layer_by_layer():  # (waited for later: the device starts on it meanwhile)
            logits = self.model(inputs, cache=self.prompt_cache)
        if pending is not None:
            logits = self._processed(logits, pending, drafts)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled, keeps = self._sample(logprobs)
        mx.async_eval(sampled, logprobs)
        return CheckedPass(drafts, inputs.shape[1], sampled, logprobs, keeps, [True] * len(drafts))

    def _guessed(self, before: CheckedPass, drafts: list[list[int]], pending: list[int],
                 ended: list[bool], beyond: list[int]) -> CheckedPass:  # fmt: skip
        """The pass after `before`, recorded before `before` is checked: rows
        whose part in `before` counts (as far as known) run the sample after
        their proposals there and `drafts`; rows whose part does not take back
        what they wrote past their tokens and run their `pending` token alone
        (`beyond`: those entries, by row, updated; rows `ended` count no more)."""
        rows = len(drafts)
        guessing = [before.counts[i] and not ended[i] for i in range(rows)]
        drafts = [d if guessing[i] else [] for i, d in enumerate(drafts)]
        # A guessing row takes back its padding; a row running its pending token alone, all.
        back = [before.width - 1 - len(d) if guessing[i] else (not ended[i]) * beyond[i]
                for i, d in enumerate(before.drafts)]  # fmt: skip
        self.rewind(back)
        width = before.width if self.drafting.one_width else 1 + max(map(len, drafts))
        last = mx.array([len(d) for d in before.drafts])[:, None]
        first = mx.where(
            mx.array(guessing)[:, None],
            mx.take_along_axis(before.sampled, last, axis=1).astype(mx.int32),
            mx.array(pending, dtype=mx.int32)[:, None],
        )
        if width > 1:
            padded = [[*d, *[0] * (width - 1 - len(d))] for d in drafts]
            first = mx.concatenate([first, mx.array(padded, dtype=mx.int32)], axis=1)
        guessed = self._record(first, drafts)
        for i in range(rows):
            beyond[i] += width - back[i]
            guessed.counts[i] = not ended[i]
        return guessed

    def _processed(self, logits: mx.array, pending: list[int], drafts: list[list[int]]) -> mx.array:
        """The logits with each row's processors (penalties, logit bias) applied
        at its pending token's position and at each of its proposals', each
        after the tokens before it, as decoding them one at a time applies
        them; a row's padding positions are left as they are (never kept)."""
        if not any(self.logits_processors):
            return logits
        rows = []  # (slices: an int index would be a uint32 array to mlx)
        for i, processors in enumerate(self.logits_processors):
            if not processors:
                rows.append(logits[i : i + 1])
                continue
            context = self._token_context[i].update_and_fetch(mx.array(pending[i : i + 1]))
            recent = context[-CONTEXT:]  # (all the penalties look back at)
            proposal = drafts[i]
            positions = []
            for j in range(len(proposal) + 1):
                before = recent if j == 0 else mx.concatenate(
                    [recent, mx.array(proposal[:j], dtype=recent.dtype)]
                )  # fmt: skip
                position = logits[i, j : j + 1]
                for processor in processors:
                    position = processor(before, position)
                positions.append(position)
            rows.append(mx.concatenate([*positions, logits[i, len(proposal) + 1 :]])[None])
        return mx.concatenate(rows)

    def _sample(self, logprobs: mx.array) -> tuple[mx.array, list]:
        """Every position of every row, by the row's sampler (one call where all
        share one); and for each row whose sampler keeps its own random key
        (`ahead`, engine.batch.sampling), the call that moves it on by the
        tokens kept, so its draws are those of decoding token by token."""
        rows, width = logprobs.shape[:2]
        samplers = [self.fallback_sampler if s is None else s
                    for s in (self.samplers or [None] * rows)]  # fmt: skip
        keeps: list = [None] * rows
        if all(s is samplers[0] for s in samplers) and not hasattr(samplers[0], "ahead"):
            return samplers[0](logprobs.reshape(rows * width, -1)).reshape(rows, width), keeps
        draws = []
        for i, sample in enumerate(samplers):
            row = logprobs[i : i + 1].squeeze(0)  # (x[i] would gather by a uint32 index)
            if hasattr(sample, "ahead"):
                drawn, keeps[i] = sample.ahead(row)
                draws.append(drawn)
            else:
                draws.append(sample(row))
        return mx.stack(draws), keeps

    def _finish(self, i: int, tokens: list[int]) -> tuple[str, int] | None:
        """Why row i ends and at which of `tokens`, as mlx-lm decides it a token at a time."""
        for at, token in enumerate(tokens):
            self._num_tokens[i] += 1
            reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
            if self._matchers[i].advance(token):
                reason = "stop"
            if reason is not None:
                return reason, at
        return None

    def _responses(self, rows: list[tuple[int, list[int], list, str | None]]) -> list:
        """mlx-lm's responses, a token each, in order; a row that ends hands its cache over."""
        out = []
        for i, tokens, chosen, finish in rows:
            for token, logprobs in zip(tokens[:-1], chosen[: len(tokens) - 1], strict=True):
                out.append(self.Response(self.uids[i], token, logprobs, None, None, None))
            last = (finish, self.extract_cache(i), self.tokens[i]) if finish else (None, None, None)
            out.append(self.Response(self.uids[i], tokens[-1], chosen[len(tokens) - 1], *last))
        return out
