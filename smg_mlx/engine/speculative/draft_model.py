"""Proposals from a small model (`--draft-model`; engine thread only).

A draft model that shares the target's vocabulary runs ahead of each row:
fed the row's tokens it has not seen and the token sampled for it, it
proposes its own greedy continuation, one pass a token, every row in the
same passes. Nothing it proposes reaches a client unchecked: the target's
checking pass keeps a proposal only where its own sample agrees.

Its cache follows one lane's decoding rows by uid, in an order of its own
(proposals go back by uid):

- a row new to it, or further behind than one pass may feed (the target ran
  plain passes meanwhile), catches up alone, at most JOIN_TOKENS prompt
  tokens a step among all such rows, in passes whose working set fits the
  memory budget (`CatchUp`), and joins the draft's batch once within
  FEED_MOST tokens: a long prompt never stalls the batch for long;
- a row that left the target's batch leaves the draft's;
- after a checking pass each row takes back the proposals the target did
  not keep (`kept`).

Each row proposes as many tokens as its proposals have earned, as prompt
lookup's rows do: up to the most asked for while they are all kept, one
past the last kept after a miss, half as many after a pass that kept
none; the draft runs as many passes as the row that proposes the most.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from smg_mlx.engine.batch.layer_waits import sent_layer_by_layer
from smg_mlx.engine.memory.costs import MemoryModel
from smg_mlx.engine.memory.planner import draft_pass_bytes
from smg_mlx.engine.speculative.ragged_kv import Ragged, ragged, rewind_layers
from smg_mlx.engine.types import LayerCaches

# A row's unseen tokens one batched pass feeds at most; one further behind
# catches up alone first.
FEED_MOST = 64
# Tokens the rows catching up alone are fed in one step, in all.
JOIN_TOKENS = 2048
# Tokens a row catching up is fed in a pass where memory is short, at least.
SMALLEST_CATCH_UP = 16


class CatchUp:
    """How many tokens a row catching up may be fed in one pass. A pass of n
    tokens attending to c holds scores for n x c pairs in each head, so at a
    long context a full chunk can take several times the memory budget. Its
    working set is estimated as the model's own prefill's (the start-up
    probe's, `engine.memory.planner.draft_pass_bytes`) times how much wider the
    draft is, and kept within the bytes the step's plan leaves spare (`room`,
    where the prefix cache leaves a pass of CATCH_UP_TOKENS room): halved
    until it fits, down to SMALLEST_CATCH_UP (a row always gains ground)."""

    def __init__(self) -> None:
        # What the step's plan leaves spare, as a working set (the planner's
        # margin, which an out-of-memory step widens, taken off).
        self.room = math.inf
        self._memory: MemoryModel | None = None  # None: not measured, nothing bounds it

    def measured(self, memory: MemoryModel) -> None:
        """The model's measures, the draft's width among them."""
        self._memory = memory

    def tokens(self, context: int, most: int) -> int:
        """Tokens a pass may feed a row whose cache holds `context`, `most` at most."""
        n = most
        while n > SMALLEST_CATCH_UP and self.bytes(n, context) > self.room:
            n //= 2
        return n

    def bytes(self, n: int, context: int) -> float:
        """A pass's working set: `n` tokens after `context`."""
        if self._memory is None:
            return 0.0
        return draft_pass_bytes(self._memory, n, context, safety=1.0)


def wider(draft: nn.Module, model: nn.Module) -> float:
    """How many times the model's prefill working set the draft's may be for
    as many tokens: its attention heads and hidden size against the model's
    (1 where it is no wider, or where its configuration does not say)."""
    ratios = [1.0]
    for name in ("num_attention_heads", "hidden_size"):
        mine, theirs = (getattr(getattr(m, "args", None), name, None) for m in (draft, model))
        if isinstance(mine, int) and isinstance(theirs, int) and theirs > 0:
            ratios.append(mine / theirs)
    return max(ratios)


class DraftRows:
    """The draft model's cache for one lane's decoding rows (see the module's doc)."""

    def __init__(
        self, model: nn.Module, caches: LayerCaches | None = None, catch_up: CatchUp | None = None
    ) -> None:
        self._model = model
        self._catch_up_size = catch_up or CatchUp()
        # A row's fresh caches: quantized under --kv-bits, as the model's rows are.
        self._fresh = caches or (lambda: make_prompt_cache(model))
        self._cache: list[Ragged] | None = None  # per layer; None: no row
        self._uids: list[int] = []  # the draft batch's rows, in its order
        self._seen: dict[int, int] = {}  # tokens of each row its cache holds
        self._joining: dict[int, list[Any]] = {}  # rows catching up alone: their caches
        # Rows that proposed in the last pass: the tokens their cache held
        # before the proposals, and how many proposals were fed to it.
        self._fed: dict[int, tuple[int, int]] = {}
        self._length: dict[int, int] = {}  # tokens each row proposes next

    def propose(self, rows: dict[int, tuple[list[int], int]], most: int) -> dict[int, list[int]]:
        """For each row of `rows` (uid: the tokens in the target's cache, and
        the token sampled for it), up to `most` proposed tokens; rows still
        catching up propose none."""
        self._leave([uid for uid in self._uids if uid not in rows])
        for uid in [u for u in self._joining if u not in rows]:
            del self._joining[uid], self._seen[uid]
            self._length.pop(uid, None)
        behind = [i for i, uid in enumerate(self._uids)
                  if len(rows[uid][0]) - self._seen[uid] >= FEED_MOST]  # fmt: skip
        for i in behind:  # fell behind while the target ran plain passes
            uid = self._uids[i]
            self._joining[uid] = [c.extract(i) for c in self._cache]
        self._leave([self._uids[i] for i in behind], keep_seen=True)
        self._catch_up(rows)
        if not self._uids:
            return {}
        feeds = [rows[uid][0][self._seen[uid] :] + [rows[uid][1]] for uid in self._uids]
        width = max(len(feed) for feed in feeds)
        inputs = mx.array([feed + [feed[-1]] * (width - len(feed)) for feed in feeds], mx.int32)
        # (read only at the end: the device starts on each pass while the host records the rest)
        with sent_layer_by_layer():
            logits = self._model(inputs, cache=self._cache)
            last = mx.array([len(feed) - 1 for feed in feeds])
            token = mx.argmax(logits[mx.arange(len(feeds)), last], axis=-1)
            if width > 1:
                rewind_layers(self._cache, [width - len(feed) for feed in feeds])
            lengths = [min(self._length.setdefault(uid, most), most) for uid in self._uids]
            proposals = [token]
            for _ in range(max(lengths) - 1):
                token = mx.argmax(self._model(token[:, None], cache=self._cache)[:, -1], axis=-1)
                proposals.append(token)
        proposed = mx.stack(proposals, axis=1).tolist()
        for uid in self._uids:
            base = len(rows[uid][0]) + 1  # its tokens and the sampled one
            self._fed[uid] = (base, len(proposals) - 1)
            self._seen[uid] = base + len(proposals) - 1
        return {uid: p[:n] for uid, p, n in zip(self._uids, proposed, lengths, strict=True)}

    def kept(self, accepted: dict[int, int], most: int) -> None:
        """After the checking pass: how many of its proposals each row kept
        (rows that ended need not be named); each takes back the rest, and
        proposes as many as that earned next time (at most `most`)."""
        counts = []
        for uid in self._uids:
            base, fed = self._fed.pop(uid, (self._seen[uid], 0))
            kept, length = accepted.get(uid, 0), self._length.get(uid, most)
            if kept >= length:
                self._length[uid] = min(length + 1, most)
            else:
                self._length[uid] = kept + 1 if kept else max(1, length // 2)
            held = base + min(kept, fed)
            counts.append(self._seen[uid] - held)
            self._seen[uid] = held
        self._fed.clear()
        if self._cache is not None and any(counts):
            rewind_layers(self._cache, counts)

    def _leave(self, uids: list[int], keep_seen: bool = False) -> None:
        """These rows leave the draft's batch."""
        if not uids:
            return
        gone = set(uids)
        keep = [i for i, uid in enumerate(self._uids) if uid not in gone]
        for uid in uids:
            self._fed.pop(uid, None)
            if not keep_seen:
                del self._seen[uid]
                self._length.pop(uid, None)
        self._uids = [self._uids[i] for i in keep]
        if not keep:
            self._cache = None
        else:
            for cache in self._cache:
                cache.filter(keep)

    def _catch_up(self, rows: dict[int, tuple[list[int], int]]) -> None:
        """Rows new to the draft, or behind, fed alone (JOIN_TOKENS in all, in
        passes that fit: `CatchUp`); those within FEED_MOST tokens join the
        draft's batch."""
        budget = JOIN_TOKENS
        for uid, (tokens, _) in rows.items():
            if uid in self._seen and uid not in self._joining:
                continue
            if uid not in self._joining:
                self._joining[uid] = self._fresh()
                self._seen[uid] = 0
            cache, seen = self._joining[uid], self._seen[uid]
            todo = len(tokens) - seen - (FEED_MOST - 1)  # the last few go in the batched pass
            if todo > 0 and budget > 0:
                n = self._catch_up_size.tokens(seen, min(todo, budget))
                self._model(mx.array([tokens[seen : seen + n]]), cache=cache)
                mx.eval([c.state for c in cache])
                self._seen[uid] = seen + n
                budget -= n
            if len(tokens) - self._seen[uid] < FEED_MOST:
                self._join(uid, self._joining.pop(uid))

    def _join(self, uid: int, cache: list[Any]) -> None:
        """A row caught up alone joins the draft's batch."""
        merged = [ragged(type(c).merge([c])) for c in cache]
        if self._cache is None:
            self._cache = merged
        else:
            for mine, theirs in zip(self._cache, merged, strict=True):
                mine.extend(theirs)
        self._uids.append(uid)


class PaddedOtherwise:
    """A draft whose token ids are padded to another count than the model's,
    with the same tokenizer (Qwen2.5's 0.5B and its 7B, say): ids the model
    writes past the draft's embedding (padding, no token of the tokenizer)
    reach it as its last id, and it proposes only ids the model reads. Its
    proposals are checked as any draft's, so outputs stay the model's."""

    def __init__(self, model: nn.Module, reads: int | None, proposes: int | None) -> None:
        self._model = model
        self._reads = reads  # ids its embedding holds, where the model writes more
        self._proposes = proposes  # ids the model reads, where the draft scores more

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if self._reads is not None:
            inputs = mx.minimum(inputs, self._reads - 1)
        logits = self._model(inputs, cache=cache)
        return logits if self._proposes is None else logits[..., : self._proposes]

    def __getattr__(self, name: str) -> Any:  # (its layers, caches, parameters)
        return getattr(self.__dict__["_model"], name)
