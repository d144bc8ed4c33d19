"""Whether a pass that checks proposals pays, from what passes took (pure arithmetic).

A pass over B rows of W tokens each costs about what a pass of one token
costs while the device waits on memory (the weights are read once either
way), and up to W times as much once it is compute-bound: large batches, a
CPU. Which holds depends on the device, the model and the batch, so it is
measured, not assumed: the seconds of plain passes and of passes of each
width are kept by batch size, and a pass checks proposals only where the
tokens it is expected to yield per second beat a plain pass's. A width not
measured yet for this batch size is tried; a losing width is tried again
now and then, as the batch and its proposals change.
"""

from __future__ import annotations

WEIGHT = 0.25  # of each new pass in a moving average of pass seconds
RETRY = 64  # plain passes after which a losing width is measured again


def _size_class(rows: int) -> int:
    """Batch sizes that share their measurements: powers of two."""
    return 1 << (rows - 1).bit_length()


class Pacing:
    """Pass seconds by batch size and width; which width to run. Engine thread only."""

    def __init__(self, always: bool = False) -> None:
        self.always = always  # check proposals whatever the pass times (tests, benchmarks)
        self._seconds: dict[tuple[int, int], float] = {}
        self._plain_since: dict[tuple[int, int], int] = {}  # plain passes since a width lost

    def ran(self, rows: int, width: int, seconds: float) -> None:
        """A pass of `rows` rows and `width` tokens a row took `seconds`."""
        key = (_size_class(rows), width)
        before = self._seconds.get(key)
        self._seconds[key] = seconds if before is None else before + WEIGHT * (seconds - before)

    def width(self, rows: int, expected: list[float]) -> int:
        """The width of the next pass: 1 (plain) or 1 + the proposals to check,
        where `expected[w]` is the tokens a pass of width w + 1 should yield
        (`expected[0]` is `rows`, a plain pass's)."""
        if self.always or len(expected) < 2:
            return len(expected)
        size = _size_class(rows)
        plain = self._seconds.get((size, 1))
        if plain is None:
            return 1  # a plain pass first: the measure every width is held against
        best, best_rate = 1, expected[0] / plain
        for width in range(2, len(expected) + 1):
            seconds = self._seconds.get((size, width))
            if seconds is None:
                return width
            rate = expected[width - 1] / seconds
            if rate > best_rate:
                best, best_rate = width, rate
        if best == 1:
            waited = self._plain_since.get((size, len(expected)), 0) + 1
            self._plain_since[(size, len(expected))] = waited % RETRY
            if waited >= RETRY:
                return len(expected)
        return best
