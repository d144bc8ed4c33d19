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
device as they are recorded: `layer_waits.sent_layer_by_layer`). With prompt
lookup, the first pass of a call may be followed by more (`Drafting.chain`),
each recorded while the one before runs, as if that one kept every proposal:
its first tokens are the device's samples after what each row keeps, its
rows' cache ends the device's (`ragged_kv.Ragged.rewind_ahead`), and its
proposals are looked up past the ones still being checked. Recording a pass
costs the host about what the device spends running one, so this nearly
halves a checking pass's time where proposals are right; where a row keeps
fewer, its pass after is mostly wasted. `Pacing` has passes check, and
chain, only where measured runs of them (`pacing.Block`) say that pays. A
cache whose rows ended apart is lined up again at the end of each checking
run, on that run's clock, so that plain passes run, and are timed, as plain
ones.
"""

from __future__ import annotations

from collections.abc import Collection
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
from smg_mlx.engine.speculative.ragged_kv import line_up, ragged, rewind_layers
from smg_mlx.engine.speculative.shared_history import SharedHistory

# Checking passes one call may send with prompt lookup, each recorded while
# the one before runs on the device (`SpeculativeGenerationBatch._check`).
CHAIN = 4


@dataclass
class DraftStats:
    """What speculation has done since start (metrics)."""

    proposed: int = 0  # tokens proposed and checked
    accepted: int = 0  # of those, tokens kept
    passes: int = 0  # passes that checked proposals
    tokens: int = 0  # tokens those passes returned


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
    # Checking passes one call may send (`_check`); pacing's widest width is
    # `most` proposals a pass for `chain` passes.
    chain: int = CHAIN


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
        for uid, most in zip(other.uids, other.max_tokens, strict=True):
            self.drafting.pacing.admit(uid, most)
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
        self.drafting.pacing.left(left)

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
            self._block = pacing.start(len(self.uids), self.uids)
            if ended.checking and not self._block.checking:
                # The checking run's passes may have left the rows ending apart:
                # lined up for the plain passes, on the run's clock.
                pacing.charge(ended, self._block, self._line_up)
        if self._block is None:
            self._block = pacing.start(len(self.uids), self.uids)
        self._block.begins()
        self._steps += 1
        rows = len(self.uids)
        # Where the run is plain, no row looks for proposals at all.
        if self._block.checking and (likely := self._likely()):
            mx.eval(self._next_tokens)
            pending = self._next_tokens.tolist()
            # The block's width (pacing: what pays at this batch size), else the
            # most allowed: the most a row proposes in this call, over its passes.
            allowed = self._block.width or self.drafting.most * self.drafting.chain
            cap = min(allowed, self.drafting.most)
            drafts = self._proposals(likely, pending, cap)
            if any(drafts):
                most = cap if self.drafting.one_width else max(map(len, drafts))
                width = 1 + most
                if new := pacing.new_shape(rows, width):
                    # Only the pass goes untimed: the proposals (a draft model
                    # catching up on every row's tokens) count.
                    self._block.begins()
                out, made, sent = self._check(pending, drafts, width, self._joined(),
                                              passes=max(1, allowed // cap))  # fmt: skip
                self._block.ran(len(out), new, checked=True, rows=made, sent=sent)
                return out
        responses = super()._decode()
        made = {r.uid: 1 for r in responses if r.finish_reason is None}  # (streams' ledgers)
        self._block.ran(len(responses), pacing.new_shape(rows, 1), rows=made)
        return responses

    def exercise(self) -> list:
        """Each kind of pass speculation adds, once (the warm-up's: mlx builds
        some of their kernels on first use, seconds on CUDA, which would stall
        every stream the first time a row's proposals are checked): a checking
        pass over the rows decoding now (with those joining), then passes
        chained (`_check`), their responses returned; then, on a
        copy of the first row's cache twice, rows ending apart written,
        attended and lined up. Its passes count in no metric."""
        out: list = []
        width = 1 + self.drafting.most
        stats, self.drafting.stats = self.drafting.stats, DraftStats()
        try:
            for passes in (1, self.drafting.chain):
                if not self.uids:  # (every row ended)
                    return out
                mx.eval(self._next_tokens)
                pending = self._next_tokens.tolist()
                drafts = self._proposals(self._likely(), pending, self.drafting.most)
                out += self._check(pending, [d or [y] * self.drafting.most
                                             for d, y in zip(drafts, pending, strict=True)],
                                   width, self._joined(), passes, fill=True)[0]  # fmt: skip
        finally:
            self.drafting.stats = stats
        self._line_up()
        if not self.uids:  # (every row ended in that pass)
            return out
        row = one_row(self.extract_cache(0))
        layers = zip(self.prompt_cache, row, strict=True)
        pair = [ragged(type(c).merge([one] * 2)) for c, one in layers]
        rewind_layers(pair, [1, 0])
        mx.eval(self._target(mx.array([pending[:1] * width] * 2, mx.int32), cache=pair))
        line_up(pair)
        return out

    def _line_up(self) -> None:
        """Rows that ended apart (`ragged_kv`) end together again, copied now
        (where it is timed, not in the pass after it)."""
        line_up(self.prompt_cache)

    def _proposals(self, likely: set[int], pending: list[int], most: int) -> list[list[int]]:
        """Each row's proposals (none for rows not `likely`), at most `most`,
        and no more than the tokens it has left after its pending one: those
        past it are never sent."""
        if self._draft_rows is not None:
            rows = {self.uids[i]: (self.tokens[i], pending[i]) for i in likely}
            proposed = self._draft_rows.propose(rows, most)
            drafts = [proposed.get(uid, []) for uid in self.uids]
        else:
            drafts = [
                self._rows[uid].propose(self._steps, y, most) if i in likely else []
                for i, (uid, y) in enumerate(zip(self.uids, pending, strict=True))
            ]
        return [
            d[: max(0, self.max_tokens[i] - self._num_tokens[i] - 1)]
            for i, d in enumerate(drafts)
        ]

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

    def _check(self, pending: list[int], drafts: list[list[int]], width: int,
               joining: list[int], passes: int = 1,
               fill: bool = False) -> tuple[list, dict[int, int], int]:  # fmt: skip
        """Passes over every row's pending token and proposals (module
        docstring), `width` tokens a row: rows with fewer proposals are padded
        (positions whose tokens are not kept; see `Drafting.one_width`). Rows
        `joining` run their prompts' last tokens: the sample after it is their
        first token, and they return nothing. Where `_chained`, up to `passes`
        passes, each sent while the one before runs (`_guessed`; `fill`: the
        warm-up's, every row proposes). Their responses, the tokens each row
        that decodes on made, by uid, but those joining (`pacing.Block.ran`:
        their first pass makes them none), and the passes sent."""
        rows, joined = len(self.uids), {self.uids[i] for i in joining}
        self.prompt_cache = [ragged(c) for c in self.prompt_cache]
        chain = passes if self._chained(warm_up=fill) else 1
        sent = self._send(mx.array(pending, dtype=mx.int32), drafts, width, pending, joining)
        got = _Got()
        for n in range(1, chain + 1):
            after = None
            if n < chain:
                guessed, guesses = self._guessed(pending, drafts, width - 1, fill, got.ended)
                if any(guessed):
                    counts, first = _kept_on_device(sent)
                    self.rewind_ahead(counts)
                    after = self._send(first, guessed, width)
                    after.guesses = guesses
            current, pending = pending, self._settle(sent, pending, got, ahead=after is not None)
            if after is None:
                break
            sent, drafts = after, after.drafts
        if self._draft_rows is not None:
            self._draft_rows.kept(got.accepted, self.drafting.most)
        out = self._responses([(i, *got.rows[i]) for i in sorted(got.rows)])
        self.drafting.stats.tokens += len(out)
        self._current_tokens = mx.array(current, dtype=self._next_tokens.dtype)
        self._next_tokens = mx.array(pending, dtype=self._current_tokens.dtype)
        if got.ended:
            self.filter([i for i in range(rows) if i not in got.ended])
        return out, {uid: n for uid, n in got.made.items() if uid not in joined}, n

    def _chained(self, warm_up: bool = False) -> bool:
        """Whether a pass may be sent before the host reads the one before it:
        not where its inputs wait on the host (a draft model's proposals,
        logits processors, samplers keeping their own keys), but in the
        warm-up whatever the rows' settings (its tokens are not kept: the
        passes are run for the kernels they build). (Rows joining in the
        first pass decode on in the next, their first token sampled there.)"""
        if self._draft_rows is not None:
            return False
        if warm_up:
            return True
        if any(self.logits_processors):
            return False
        samplers = self.samplers or [None]
        return not any(hasattr(s or self.fallback_sampler, "ahead") for s in samplers)

    def _guessed(self, pending: list[int], drafts: list[list[int]], most: int, fill: bool,
                 ended: set[int]) -> tuple[list[list[int]], list[int | None]]:  # fmt: skip
        """For the pass after the one sent with `pending` and `drafts`, still
        running: each row's proposals, looked up as if it keeps all its own
        (those after the token it would then sample, guessed: the first
        looked up), and that guess. Where it keeps fewer, its next proposals
        follow a token it did not sample: likely wrong, never a wrong token.
        Rows that proposed nothing, or `ended`, propose nothing (`fill`: all
        but those that ended do, repeating their pending token)."""
        out, guesses = [], []
        for i, (y, d) in enumerate(zip(pending, drafts, strict=True)):
            if i in ended:
                out.append([])
                guesses.append(None)
                continue
            # The tokens it has left once these are kept: the sampled one, then these.
            left = self.max_tokens[i] - self._num_tokens[i] - len(d) - 2
            row = self._rows.get(self.uids[i])  # (none for a row joining: it proposed nothing)
            found = row.guess(self.tokens[i], [y, *d], most) if d and row else []
            if fill and len(found) < 2:
                found = [y] * (most + 1)
            out.append(found[1 : 1 + max(0, left)])
            guesses.append(found[0] if out[-1] else None)
        return out, guesses

    def _send(self, first: mx.array, drafts: list[list[int]], width: int,
              pending: list[int] | None = None,
              joining: Collection[int] = ()) -> _Pass:  # fmt: skip
        """A checking pass over each row's `first` token (on the device or the
        host's `pending`) and `drafts`, sent to the device, not waited for."""
        rest = mx.array([[*d, *[0] * (width - 1 - len(d))] for d in drafts], dtype=mx.int32)
        inputs = mx.concatenate([first[:, None].astype(mx.int32), rest], axis=1)
        # int32, as every token array is (engine.batch.sampling: kernels).
        with sent_layer_by_layer():  # (the device starts on it as it is recorded)
            logits = self.model(inputs, cache=self.prompt_cache)
        if pending is not None:  # (processors chain no pass: `_chained`)
            proposals = [[] if i in joining else d for i, d in enumerate(drafts)]
            logits = self._processed(logits, pending, proposals)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled, keeps = self._sample(logprobs)
        mx.async_eval(sampled, logprobs)
        return _Pass(drafts, width, sampled, logprobs, keeps, set(joining), [None] * len(drafts))

    def _settle(self, sent: _Pass, pending: list[int], got: _Got, ahead: bool) -> list[int]:
        """Pass `sent`'s tokens (it is waited for), row by row into `got`: each
        row's pending token and the proposals its samples agree with; its cache
        takes back the rest (`ahead`: the device has, for the pass after it).
        A row that ends takes back what it did not keep as the device counts
        it, and what lies past its end with the call's last pass (`_Got.past`).
        Each row's pending token next."""
        mx.eval(sent.sampled, sent.logprobs, self._next_logprobs)
        sampled = sent.sampled.tolist()
        back, next_tokens, next_logprobs = [], [], []
        for i, (y, proposal) in enumerate(zip(pending, sent.drafts, strict=True)):
            joins = i in sent.joining
            proposal = [] if joins else proposal  # (the warm-up's proposes for every row)
            kept = 0
            while kept < len(proposal) and proposal[kept] == sampled[i][kept]:
                kept += 1
            back.append(sent.width - 1 - kept)  # (as `_kept_on_device` counts)
            next_tokens.append(sampled[i][kept])
            if i in got.ended:  # (in a pass sent before it ended)
                got.past[i] += 1 + kept
                next_logprobs.append(self._next_logprobs[i])
                continue
            next_logprobs.append(sent.logprobs[i, kept])
            tokens = [y, *proposal[:kept]]
            if kept and self.logits_processors and self.logits_processors[i]:
                # What its processors look back at next (its pending token went in
                # as the pass was built, `_processed`).
                self._token_context[i].update_and_fetch(mx.array(proposal[:kept], mx.int32))
            chosen = [self._next_logprobs[i], *(sent.logprobs[i, j] for j in range(kept))]
            finish = None if joins else self._finish(i, tokens)
            if finish is not None:
                tokens = tokens[: finish[1] + 1]
                got.ended.add(i)
                got.past[i] = 1 + kept - len(tokens)
            if proposal:
                # (proposals after a guess the row did not sample say nothing of its drafter)
                if self._draft_rows is None and sent.guesses[i] in (None, y):
                    self._rows[self.uids[i]].fared(self._steps, len(proposal), kept)
                got.accepted[self.uids[i]] = kept
                self.drafting.stats.proposed += len(proposal)
                # (those sent: none past a stop token)
                self.drafting.stats.accepted += len(tokens) - 1
            self.tokens[i].extend(tokens)
            if not joins:
                got.add(i, self.uids[i], tokens, chosen, finish)
            if sent.keeps[i] is not None:  # the draws kept: the proposals and the next token
                sent.keeps[i](kept + 1)
        if not ahead:  # (the call's last pass: before the rows that ended hand their caches over)
            for i, n in got.past.items():
                back[i] += n
        self.rewind(back, ahead)
        self._next_logprobs = next_logprobs
        self.drafting.stats.passes += 1
        return next_tokens

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


@dataclass
class _Pass:
    """A checking pass sent to the device (`_send`)."""

    drafts: list[list[int]]  # each row's proposals
    width: int
    sampled: mx.array  # (rows, width): each position's sample
    logprobs: mx.array  # (rows, width, vocabulary)
    keeps: list  # `_sample`'s
    joining: set[int]
    guesses: list[int | None]  # each row's first token, as its proposals took it (`_guessed`)


@dataclass
class _Got:
    """What one call's checking passes returned (`_check`)."""

    rows: dict[int, list] = field(default_factory=dict)  # row: [tokens, logprobs, finish]
    ended: set[int] = field(default_factory=set)  # rows that ended
    made: dict[int, int] = field(default_factory=dict)  # tokens, by uid, of rows decoding on
    accepted: dict[int, int] = field(default_factory=dict)  # proposals kept, by uid (last pass)
    # Entries each row that ended holds past its end (its last pass's beyond its
    # stop, and what passes sent before it ended kept), taken back with the last pass.
    past: dict[int, int] = field(default_factory=dict)

    def add(self, i: int, uid: int, tokens: list[int], chosen: list, finish: Any) -> None:
        row = self.rows.setdefault(i, [[], [], None])
        row[0] += tokens
        row[1] += chosen[: len(tokens)]
        if finish is not None:
            row[2] = finish[0]
            self.made.pop(uid, None)
        else:
            self.made[uid] = self.made.get(uid, 0) + len(tokens)


def _kept_on_device(sent: _Pass) -> tuple[mx.array, mx.array]:
    """For each row of `sent`, before the host reads it: the entries its
    cache takes back, and its next pending token (the sample after the
    proposals it keeps)."""
    proposed = [[*d, *[-1] * (sent.width - 1 - len(d))] for d in sent.drafts]
    same = mx.array(proposed, dtype=mx.int32) == sent.sampled[:, :-1]
    kept = mx.cumprod(same.astype(mx.int32), axis=1).sum(axis=1)
    first = mx.take_along_axis(sent.sampled, kept[:, None], axis=1)[:, 0]
    return sent.width - 1 - kept, first
