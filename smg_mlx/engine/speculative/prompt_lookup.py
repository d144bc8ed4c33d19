"""Proposals without a second model: prompt lookup (engine thread only).

A row's next tokens are often a copy of tokens it has seen: a summary quotes
its document, an edit repeats the code around it, an agent re-reads its own
tool output. The proposal is what followed the most recent earlier
occurrence of the row's last few tokens (the longest suffix that occurred
before, of LONGEST down to SHORTEST tokens), in its prompt and its output.

A row whose prompt an earlier sequence in the prefix cache began with (the
same question again, a retried or regenerated answer) also has that
sequence's continuation ahead of it (`Ahead`): while the row's output follows
it, it proposes what came next there, before looking in its own tokens.
Where its own tokens have no earlier occurrence of its last ones, it looks in
other streams' recent tokens (`shared_history`).

Each row's proposals adapt to how they fare (`RowDrafts`): as long as its
proposals are right it proposes up to the most asked for; a wrong one
shortens the next; a row whose lookups find nothing, or whose proposals are
all wrong, looks again only after a pause that doubles each time, so a
conversation that never repeats itself costs a lookup now and then.
"""

from __future__ import annotations

import numpy as np

from smg_mlx.engine.speculative.shared_history import SharedHistory

LONGEST = 4  # tokens of a row's end that are looked up, at most...
SHORTEST = 2  # ...and at least: one token recurs too often to predict what follows
MOST_PAUSE = 64  # steps a row waits at most before it looks again


def lookup(tokens: np.ndarray, n: int, most: int) -> list[int]:
    """Up to `most` tokens that followed an earlier occurrence of the longest
    suffix of `tokens[:n]` that occurred before: the latest occurrence
    followed by `most` tokens, else the one followed by the most (the latest
    of a run of one repeated token is followed by just one)."""
    for size in range(min(LONGEST, n - 1), SHORTEST - 1, -1):
        suffix = tokens[n - size : n]
        # Every earlier start of the suffix, compared at once (in a document a
        # common first token starts hundreds of candidates).
        starts = np.flatnonzero(tokens[: n - size] == suffix[0])
        if starts.size:
            rest = tokens[starts[:, None] + np.arange(1, size)] == suffix[1:]
            starts = starts[rest.all(axis=1)]
        if starts.size:
            # A start is followed by min(most, n - size - start) tokens.
            full = starts[starts <= n - size - most]
            start = full[-1] if full.size else starts[0]
            return tokens[start + size : min(start + size + most, n)].tolist()
    return []


class Ahead:
    """The tokens a cached sequence had after a row's prompt: `tokens`, from
    token number `start` of the row's on."""

    __slots__ = ("start", "tokens", "checked")

    def __init__(self, start: int, tokens: tuple[int, ...]) -> None:
        self.start = start
        self.tokens = np.array(tokens, dtype=np.int64)
        self.checked = start  # the row's tokens up to here are known to follow it

    def follows(self, tokens: np.ndarray, n: int) -> bool:
        """Whether the row's `tokens[:n]` still follow it, with some left ahead."""
        end = min(n, self.start + len(self.tokens))
        if end > self.checked:
            mine = tokens[self.checked : end]
            if not np.array_equal(mine, self.tokens[self.checked - self.start : end - self.start]):
                return False
            self.checked = end
        return n < self.start + len(self.tokens)

    def after(self, n: int, most: int) -> list[int]:
        """Up to `most` tokens it has after the row's first `n`."""
        return self.tokens[n - self.start : n - self.start + most].tolist()


class RowDrafts:
    """One row's tokens and how its proposals have fared."""

    __slots__ = (
        "_tokens", "_n", "_most", "_length", "_pause", "_next_look", "_ahead", "_shared",
    )  # fmt: skip

    def __init__(
        self, most: int, ahead: Ahead | None = None, shared: SharedHistory | None = None
    ) -> None:
        self._tokens = np.zeros(256, dtype=np.int64)
        self._n = 0
        self._most = most
        self._length = most  # tokens the next proposal may have
        self._pause = 1  # steps to wait after the next lookup that finds nothing
        self._next_look = 0  # the step at which to look again
        self._ahead = ahead  # a cached continuation of its prompt, while it follows it
        self._shared = shared  # other streams' recent tokens

    def sync(self, tokens: list[int]) -> None:
        """Catch up with the tokens in the row's cache (they only grow)."""
        self._room(len(tokens) + 1)  # (one sampled token more)
        self._tokens[self._n : len(tokens)] = tokens[self._n :]
        self._n = len(tokens)

    def _room(self, n: int) -> None:
        if n > len(self._tokens):
            grown = np.zeros(2 * n, dtype=np.int64)
            grown[: self._n] = self._tokens[: self._n]
            self._tokens = grown

    def likely(self, step: int, tokens: list[int]) -> bool:
        """Whether this row should look now: its `tokens` so far (those in its
        cache) still follow its cached continuation, or end as they did before
        (then the token being sampled will likely follow it too); if not, it
        waits before it looks again."""
        if step < self._next_look and self._ahead is None:
            return False  # a pausing row does not even catch up: its steps cost nothing
        self.sync(tokens)
        if self._following(self._n):
            return True
        if step < self._next_look:
            return False
        if self._looked_up(self._n, 1):
            return True
        self._wait(step)
        return False

    def propose(self, step: int, pending: int, most: int) -> list[int]:
        """Up to `most` tokens that should follow this row's tokens and
        `pending` (sampled, not in its cache yet); [] where none."""
        proposal = self._after([pending], min(most, self._length))
        if not proposal:
            self._wait(step)
        return proposal

    def guess(self, tokens: list[int], sent: list[int], most: int) -> list[int]:
        """For a pass sent after one still running: the token the running pass
        should sample after the row's `tokens` and `sent` (its pending token and
        proposals, if all are kept), then up to `most` tokens to follow it; []
        where none."""
        self.sync(tokens)
        return self._after(sent, 1 + min(most, self._length))

    def _after(self, ahead: list[int], most: int) -> list[int]:
        """Up to `most` tokens that should follow this row's tokens and then
        `ahead` (its pending token first, which it sampled)."""
        n = self._n + len(ahead)
        self._room(n)
        self._tokens[self._n : n] = ahead
        # (a cached continuation is checked against sampled tokens only)
        if self._following(self._n + 1):
            return self._ahead.after(n, most)
        return self._looked_up(n, most)

    def fared(self, step: int, proposed: int, accepted: int) -> None:
        """A pass checked `proposed` tokens of this row and kept `accepted`."""
        if accepted == proposed:
            self._length = min(self._length + 1, self._most)
            self._pause = 1
        elif accepted == 0:
            self._wait(step)
        else:
            self._length = accepted + 1
            self._pause = 1

    def _looked_up(self, n: int, most: int) -> list[int]:
        """`lookup` in its own first `n` tokens, else in other streams'."""
        found = lookup(self._tokens, n, most)
        if not found and self._shared is not None:
            found = self._shared.lookup(self._tokens, n, most, LONGEST)
        return found

    def _following(self, n: int) -> bool:
        """Whether its first `n` tokens follow the cached continuation (which
        is dropped once they do not, or it has nothing left)."""
        if self._ahead is not None and not self._ahead.follows(self._tokens, n):
            self._ahead = None
        return self._ahead is not None

    def _wait(self, step: int) -> None:
        self._next_look = step + self._pause
        self._pause = min(2 * self._pause, MOST_PAUSE)
