"""Whether a pass that checks proposals pays, from what passes did (pure arithmetic).

A pass over B rows of W tokens each costs about what a pass of one token
costs while the device waits on memory (the weights are read once either
way), and up to W times as much once it is compute-bound: large batches, a
CPU. It also waits for the pass before it, where plain passes overlap. Which
wins depends on the device, the model, the batch and how often proposals
are right, so it is measured, not estimated: for each batch size (by powers
of two) a moving average of plain passes' seconds, and of checking passes'
seconds and the tokens they returned. A checking pass runs where its
tokens per second beat a plain pass's rows per second; until both are
measured it is tried, and after a losing run it is tried again now and then,
as the batch and its proposals change. A pass of a shape never run before
is left out of the averages: the backend may build kernels for it first.
"""

from __future__ import annotations

WEIGHT = 0.25  # of each new pass in a moving average
# Plain passes after which a losing checking pass is tried again, doubling
# after each retry that loses again, up to the most.
RETRY, MOST_RETRY = 64, 1024


def _size_class(rows: int) -> int:
    """Batch sizes that share their measurements: powers of two."""
    return 1 << (rows - 1).bit_length()


class _Average:
    __slots__ = ("seconds", "tokens")

    def __init__(self, seconds: float, tokens: float) -> None:
        self.seconds, self.tokens = seconds, tokens

    def add(self, seconds: float, tokens: float) -> None:
        self.seconds += WEIGHT * (seconds - self.seconds)
        self.tokens += WEIGHT * (tokens - self.tokens)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Pacing:
    """Plain and checking passes' rates by batch size; whether to check. Engine thread only."""

    def __init__(self, always: bool = False) -> None:
        self.always = always  # check proposals whatever the rates (tests, benchmarks)
        self._plain: dict[int, _Average] = {}
        self._checking: dict[int, _Average] = {}
        self._waited: dict[int, int] = {}  # plain passes since checking lost, by size
        self._retry: dict[int, int] = {}  # plain passes between retries, by size
        self._shapes: set[tuple[int, int]] = set()  # (rows, width) of the passes run so far

    def ran(self, rows: int, width: int, seconds: float, tokens: int) -> None:
        """A pass of `rows` rows and `width` tokens a row took `seconds` and returned `tokens`."""
        if (rows, width) not in self._shapes:
            self._shapes.add((rows, width))
            return
        kept = self._plain if width == 1 else self._checking
        size = _size_class(rows)
        if size in kept:
            kept[size].add(seconds, tokens)
        else:
            kept[size] = _Average(seconds, tokens)

    def check(self, rows: int) -> bool:
        """Whether the next pass over `rows` rows should check their proposals."""
        if self.always:
            return True
        size = _size_class(rows)
        plain, checking = self._plain.get(size), self._checking.get(size)
        if plain is None:
            return False  # plain passes first: the measure a checking pass is held against
        if checking is None or checking.rate > plain.rate:
            self._retry[size] = RETRY
            return True
        waited = self._waited[size] = self._waited.get(size, 0) + 1
        retry = self._retry.get(size, RETRY)
        if waited < retry:
            return False
        self._waited[size] = 0
        self._retry[size] = min(2 * retry, MOST_RETRY)
        return True
