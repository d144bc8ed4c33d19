"""mlx-lm's decoding rows, where one pass may check each row's proposals (engine thread only).

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

Such a pass must see its rows' latest tokens before it is built, so it waits
for the pass before it, where mlx-lm would overlap them (its layers go to the
device as they are recorded: `layer_waits.sent_layer_by_layer`). Under prompt
lookup a call records CHAIN passes, each after the first while the one before
runs, on the guess that every row keeps all its proposals (`_check`): the
device waits for the host once a call, not once a pass. `Pacing` has passes
check only where measured runs of them (`pacing.Block`) say that pays. A
cache whose rows ended apart is lined up again at the end of each checking
run, on that run's clock, so that plain passes run, and are timed, as plain
ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from smg_mlx.engine.batch.ended_rows import one_row
from smg_mlx.engine.batch.layer_waits import sent_layer_by_layer
from smg_mlx.engine.batch.row_places import PlacedGenerationBatch
from smg_mlx.engine.batch.sampling import CONTEXT
from smg_mlx.engine.speculative.draft_model import CatchUp, DraftRows
from smg_mlx.engine.speculative.pacing import Block, Pacing
from smg_mlx.engine.speculative.prompt_lookup import Ahead, RowDrafts
from smg_mlx.engine.speculative.ragged_kv import line_up, ragged
from smg_mlx.engine.speculative.shared_history import SharedHistory

# Checking passes a call runs at most, each after the first recorded while the
# one before runs, on the guess that every row keeps all its proposals there
# (`SpeculativeGenerationBatch._check`).
CHAIN = 2


@dataclass
class DraftStats:
    """What speculation has done since start (metrics)."""

    proposed: int = 0  # tokens proposed and checked
    accepted: int = 0  # of those, tokens kept
    passes: int = 0  # passes that checked proposals
    tokens: int = 0  # tokens those passes returned


@dataclass
class _Pass:
    """A checking pass as recorded (`SpeculativeGenerationBatch._check`)."""

    drafts: list[list[int]]  # each row's proposals
    width: int  # tokens a row
    sampled: mx.array  # each position's sample, by row
    logprobs: mx.array
    keeps: list  # by row, where its sampler keeps its own key (`_sample`)
    counts: list[bool]  # whether each row's part counts, as far as known


@dataclass
class Drafting:
    """What both lanes' decoding rows share."""

    most: int  # proposed tokens a row may have checked in one pass
    pacing: Pacing
    stats: DraftStats
    draft: Any = None  # the draft model (engine.speculative.draft_model); None: prompt lookup
    draft_caches: Any = None  # what makes a draft row's fresh caches (--kv-bits); None: its own
    # Checking passes as wide as `most` allows, whatever the rows propose: where
    # each new pass shape costs a kernel build (mlx's CUDA backend), one shape
    # a batch size. Elsewhere a pass is as wide as its rows' proposals need.
    one_width: bool = False
    # Finished streams' last tokens, where rows look up proposals (prompt lookup).
    shared: SharedHistory | None = None
    # How much a draft model's row catching up is fed a pass (within the memory budget).
    catch_up: CatchUp = field(default_factory=CatchUp)


class SpeculativeGenerationBatch(PlacedGenerationBatch):
    """`PlacedGenerationBatch` whose `next` may return several tokens a row."""

    drafting: Drafting
    _rows: dict[int, RowDrafts]
    _ahead: dict[int, Ahead]  # rows not decoding yet: their prompts' cached continuations
    _draft_rows: DraftRows | None
    _steps: int
    _block: Block | None  # the run of passes under way (pacing)

    @classmethod
    def start(cls, model: Any, sampler: Any, drafting: Drafting) -> SpeculativeGenerationBatch:
        """An empty batch, as a lane's BatchGenerator starts with."""
        batch = super().start(model, sampler)
        batch.drafting = drafting
        batch._rows = {}
        batch._ahead = {}
        batch._draft_rows = (
            DraftRows(drafting.draft, drafting.draft_caches, drafting.catch_up)
            if drafting.draft is not None
            else None
        )
        batch._steps = 0
        batch._block = None
        return batch

    @property
    def checking(self) -> bool:
        """Whether its passes run in a checking run that has found proposals to
        check: each waits for the one before. (Where the rows find none, its
        passes run plain, overlapping as mlx-lm's do.)"""
        return self._block is not None and self._block.checked > 0

    def disturbed(self) -> None:
        """The other lane's passes ran between two of these: the run under way
        says nothing of this batch's own."""
        if self._block is not None:
            self._block.void()

    def extend(self, other: GenerationBatch) -> None:
        if not self.uids:
            self._block = None  # the batch stood empty, waiting for requests, since
        super().extend(other)

    def expect(self, uid: int, ahead: Ahead) -> None:
        """Row `uid`, when it decodes, proposes from `ahead` (prompt lookup) while
        its tokens follow it."""
        if self.drafting.draft is None:
            self._ahead[uid] = ahead

    def forget(self, uids: list[int]) -> None:
        """Rows that left: their cached continuations, where not taken yet."""
        for uid in uids:
            self._ahead.pop(uid, None)

    def filter(self, keep: list[int]) -> None:
        kept = {self.uids[i] for i in keep}
        gone = [i for i, u in enumerate(self.uids) if u not in kept]
        left = [self.uids[i] for i in gone]
        if self.drafting.shared is not None:
            for i in gone:
                self.drafting.shared.add(self.tokens[i])
        super().filter(keep)
        for uid in [u for u in self._rows if u not in kept]:
            del self._rows[uid]
        self.forget(left)

    def _decode(self) -> list:
        if not self.uids:
            return []
        pacing = self.drafting.pacing
        # Rows joined or left across a size class: the run's rate is of neither size.
        if resized := self._block is not None and not self._block.fits(len(self.uids)):
            self._block.void()
        if self._block is not None and (resized or self._block.over or pacing.losing(self._block)):
            ended = self._block
            pacing.ended(ended)
            self._block = pacing.start(len(self.uids))
            if ended.checking and not self._block.checking:
                # The checking run's passes may have left the rows ending apart:
                # lined up for the plain passes, on the run's clock.
                pacing.charge(ended, self._block, self._line_up)
        if self._block is None:
            self._block = pacing.start(len(self.uids))
        self._block.begins()
        self._steps += 1
        rows = len(self.uids)
        # Where the run is plain, no row looks for proposals at all.
        if self._block.checking and (likely := self._likely()):
            mx.eval(self._next_tokens)
            pending = self._next_tokens.tolist()
            # The block's width (pacing: what pays at this batch size), else the most allowed.
            cap = self._block.width or self.drafting.most
            passes = self._proposals(likely, pending, cap, CHAIN if self._chains() else 1)
            drafts = passes[0]
            if any(drafts):
                most = cap if self.drafting.one_width else max(map(len, drafts))
                width = 1 + most
                if new := pacing.new_shape(rows, width):
                    # Only the pass goes untimed: the proposals (a draft model
                    # catching up on every row's tokens) count.
                    self._block.begins()
                out, made = self._check(pending, drafts, width, self._joined(), passes[1:])
                self._block.ran(len(out), new, checked=True, rows=made)
                return out
        responses = super()._decode()
        made = None  # (a checking run's measure of its slowest row counts each row's token)
        if self._block.checking:
            made = {r.uid: 1 for r in responses if r.finish_reason is None}
        self._block.ran(len(responses), pacing.new_shape(rows, 1), rows=made)
        return responses

    def exercise(self) -> list:
        """Each kind of pass speculation adds, once (the warm-up's: mlx builds
        some of their kernels on first use, seconds on CUDA, which would stall
        every stream the first time a row's proposals are checked): a checking
        call over the rows decoding now, rows joining included, and where that
        one could not run a pass after its first (`_check`), another that does;
        their responses returned; then, on a copy of the first row's cache
        twice, rows ending apart written, attended and lined up. Its passes
        count in no metric."""
        width = 1 + self.drafting.most
        out: list = []
        stats, self.drafting.stats = self.drafting.stats, DraftStats()
        try:
            for _ in range(2):
                if not self.uids:  # (every row ended)
                    return out
                mx.eval(self._next_tokens)
                pending = self._next_tokens.tolist()
                drafts = self._proposals(self._likely(), pending, self.drafting.most)[0]
                chains = self._chains(warm_up=True)
                later = [[[] for _ in pending]] * (CHAIN - 1) if chains else []
                out += self._check(pending, [d or [y] * self.drafting.most
                                             for d, y in zip(drafts, pending, strict=True)],
                                   width, self._joined(), later)[0]  # fmt: skip
                if chains or CHAIN == 1 or self._draft_rows is not None:
                    break
        finally:
            self.drafting.stats = stats
        self._line_up()
        if not self.uids:  # (every row ended in those passes)
            return out
        row = one_row(self.extract_cache(0))
        layers = zip(self.prompt_cache, row, strict=True)
        pair = [ragged(type(c).merge([one] * 2)) for c, one in layers]
        for cache in pair:
            cache.rewind([1, 0])
        mx.eval(self._target(mx.array([pending[:1] * width] * 2, mx.int32), cache=pair))
        line_up(pair)
        return out

    def _line_up(self) -> None:
        """Rows that ended apart (`ragged_kv`) end together again, copied now
        (where it is timed, not in the pass after it)."""
        line_up(self.prompt_cache)

    def _proposals(self, likely: set[int], pending: list[int], most: int,
                   passes: int = 1) -> list[list[list[int]]]:  # fmt: skip
        """Each row's proposals (none for rows not `likely`), at most `most`,
        and no more than the tokens it has left after its pending one: those
        past it are never sent; for each of `passes` passes (prompt lookup:
        those after the first propose where the passes before kept all their
        proposals, the token each samples last taken to be the continuation's
        next; see `_check`)."""
        if self._draft_rows is not None:
            rows = {self.uids[i]: (self.tokens[i], pending[i]) for i in likely}
            proposed = self._draft_rows.propose(rows, most)
            found = [(proposed.get(uid, []), []) for uid in self.uids]
        else:
            further = (1 + most) * (passes - 1)
            found = [
                self._rows[uid].propose(self._steps, y, most, further) if i in likely else ([], [])
                for i, (uid, y) in enumerate(zip(self.uids, pending, strict=True))
            ]
        by_pass: list[list[list[int]]] = [[] for _ in range(passes)]
        for i, (first, rest) in enumerate(found):
            left = self.max_tokens[i] - self._num_tokens[i] - 1  # after its pending token
            proposal = first
            for p in range(passes):
                proposal = proposal[: max(0, left)]
                by_pass[p].append(proposal)
                left -= 1 + len(proposal)  # this pass's tokens, and the next pass's first
                # The next pass's first token is this one's last sample, not rest[0].
                proposal, rest = rest[1 : 1 + most], rest[1 + most :]
        return by_pass

    def _likely(self) -> set[int]:
        """Rows that may propose (not those joining); with prompt lookup, those
        whose tokens so far suggest a proposal."""
        likely = set()
        for i, uid in enumerate(self.uids):
            if uid in self._joining:
                continue
            if self._draft_rows is not None:
                likely.add(i)
                continue
            row = self._rows.get(uid)
            if row is None:
                row = self._rows[uid] = RowDrafts(
                    self.drafting.most, self._ahead.pop(uid, None), self.drafting.shared
                )
            if row.likely(self._steps, self.tokens[i]):
                likely.add(i)
        return likely

    def _chains(self, warm_up: bool = False) -> bool:
        """Whether a checking call may run passes after its first (`_check`):
        prompt lookup, no row joining, and no row whose processors or sampler's
        own key look back at the tokens kept (they would have to be known before
        the next pass is recorded); the warm-up's, whatever its rows' sampling
        (its tokens are no client's, and it builds the kernels such calls run)."""
        samplers = self.samplers or [None]
        exact = not any(self.logits_processors) and not any(hasattr(s, "ahead") for s in samplers)
        return CHAIN > 1 and self._draft_rows is None and not self._joining and (warm_up or exact)

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
        inputs = mx.array(padded, dtype=mx.int32)  # fmt: skip
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
            mx.eval(current.sampled, current.logprobs)
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
                pending: list[int] | None = None) -> _Pass:  # fmt: skip
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
        return _Pass(drafts, inputs.shape[1], sampled, logprobs, keeps, [True] * len(drafts))

    def _guessed(self, before: _Pass, drafts: list[list[int]], pending: list[int],
                 ended: list[bool], beyond: list[int]) -> _Pass:  # fmt: skip
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
