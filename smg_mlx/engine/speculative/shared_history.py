"""Other streams' recent tokens, for prompt lookup across conversations
(engine thread only).

A row's own tokens hold most of what it repeats, not all: the same question
under another system prompt (its prompt then shares no prefix with the
cached one), an answer asked for again in other words, an agent session
writing out what another one wrote. A row whose own tokens have no earlier
occurrence of its last ones looks here: the last ROW_TOKENS tokens of each
stream that finished lately, HELD tokens in all, the oldest dropped first.
Streams are kept apart (a match never spans two), and a lookup is a few
array comparisons over what is held, whatever the number of streams.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

HELD = 16384  # tokens held in all
ROW_TOKENS = 512  # of a finished stream: its last, where its answer is
SEPARATOR = -1  # between two streams' tokens (no token id)


class SharedHistory:
    """Finished streams' last tokens, one after another."""

    def __init__(self, held: int = HELD) -> None:
        self._tokens = np.full(held, SEPARATOR, dtype=np.int64)
        self._n = 0  # tokens (and separators) written

    def add(self, tokens: Sequence[int]) -> None:
        """A stream's tokens, as it finished (its last ROW_TOKENS)."""
        keep = len(self._tokens) // 2
        last = np.asarray(tokens[-min(ROW_TOKENS, keep - 1) :], dtype=np.int64)
        if not len(last):
            return
        size = len(last) + 1
        if self._n + size > len(self._tokens):  # the oldest half goes
            self._tokens[:keep] = self._tokens[self._n - keep : self._n]
            self._n = keep
        self._tokens[self._n] = SEPARATOR
        self._tokens[self._n + 1 : self._n + size] = last
        self._n += size

    def clear(self) -> None:
        self._n = 0

    def lookup(self, mine: np.ndarray, n: int, most: int, longest: int) -> list[int]:
        """Up to `most` tokens that followed the latest held occurrence of the
        longest suffix of `mine[:n]` (of `longest` tokens down to two) that
        occurs here; [] where none does."""
        if n < 2 or self._n < 3:
            return []
        held = self._tokens[: self._n]
        # Where the row's last two tokens occur (`ends`: the second's index),
        # then how far back each match goes.
        ends = np.flatnonzero((held[:-1] == mine[n - 2]) & (held[1:] == mine[n - 1])) + 1
        best, best_size = None, 1
        for end in ends[::-1]:  # (the latest first)
            size = 2
            while (
                size < min(longest, n) and end - size >= 0
                and held[end - size] == mine[n - 1 - size]
            ):  # fmt: skip
                size += 1
            if size > best_size and end + 1 < self._n and held[end + 1] != SEPARATOR:
                best, best_size = end, size
                if size == min(longest, n):
                    break
        if best is None:
            return []
        follows = held[best + 1 : best + 1 + most]
        stop = np.flatnonzero(follows == SEPARATOR)
        return follows[: stop[0] if len(stop) else len(follows)].tolist()
