"""mlx-lm's decoding rows, where a call may check each row's proposals (engine thread only).

Which rows propose, and what (prompt lookup, or a draft model), and whether
a call checks at all: `Pacing` has calls check only where measured runs of
them (`pacing.Block`) say that pays. How a checking call runs its passes and
keeps each row's tokens: `checking`. A cache whose rows ended apart is lined
up again at the end of each checking run, on that run's clock, so that plain
passes run, and are timed, as plain ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from smg_mlx.engine.batch.ended_rows import one_row
from smg_mlx.engine.speculative.checking import CHAIN, CHAIN_POSITIONS, CheckingPasses
from smg_mlx.engine.speculative.draft_model import CatchUp, DraftRows
from smg_mlx.engine.speculative.pacing import Block, Pacing
from smg_mlx.engine.speculative.prompt_lookup import Ahead, RowDrafts
from smg_mlx.engine.speculative.ragged_kv import line_up, ragged
from smg_mlx.engine.speculative.shared_history import SharedHistory


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


class SpeculativeGenerationBatch(CheckingPasses):
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
                if chains or not self._chains(warm_up=True):  # (a second call would not either)
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
        prompt lookup, rows few enough (CHAIN_POSITIONS), no row joining, and no
        row whose processors or sampler's own key look back at the tokens kept
        (they would have to be known before the next pass is recorded); the
        warm-up's, whatever its rows' sampling (its tokens are no client's, and
        it builds the kernels such calls run)."""
        samplers = self.samplers or [None]
        exact = not any(self.logits_processors) and not any(hasattr(s, "ahead") for s in samplers)
        few = len(self.uids) * (1 + self.drafting.most) <= CHAIN_POSITIONS
        return (
            CHAIN > 1 and few and self._draft_rows is None and not self._joining
            and (warm_up or exact)
        )  # fmt: skip
