"""Whether checking proposals pays, from what runs of passes did (pure arithmetic).

A pass over B rows of W tokens each costs about what a pass of one token
costs while the device waits on memory (the weights are read once either
way), and up to W times as much once it is compute-bound: large batches, a
CPU. It also waits for the pass before it, where plain passes overlap, and
the pass after it cannot overlap it. Which wins depends on the device, the
model, the batch and how often proposals are right, so it is measured, not
estimated, by the step's clock: passes run in blocks of BLOCK, each block
checking or plain throughout, timed from its first pass's start to the
next block's (`Block`). A single pass could not be timed alone: how long it
takes depends on what the pass before left running. For each batch size (by
powers of two) a moving average of the tokens a second of checking blocks
and of plain ones; a block checks where its rate beats the plain one's.
Until both are measured it is tried, and after a losing run it is tried
again now and then, as the batch and its proposals change. A block in
which a shape ran for the first time is left out (the backend may build
kernels for it first), as is one the engine set aside (`Block.void`).
"""

from __future__ import annotations

import time

BLOCK = 8  # passes a block runs
WEIGHT = 0.25  # of each new block in a moving average
# Plain blocks after which a losing checking block is tried again, doubling
# after each retry that loses again, up to the most.
RETRY, MOST_RETRY = 8, 128


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


class Block:
    """A run of one batch's passes, all checking or all plain."""

    __slots__ = ("size", "checking", "started", "passes", "tokens", "counted")

    def __init__(self, rows: int, checking: bool) -> None:
        self.size = _size_class(rows)
        self.checking = checking
        self.started = time.perf_counter()
        self.passes = self.tokens = 0
        self.counted = True

    def ran(self, tokens: int, new_shape: bool) -> None:
        """One of its passes returned `tokens` (`new_shape`: its shape's first run)."""
        self.passes += 1
        self.tokens += tokens
        self.counted = self.counted and not new_shape

    @property
    def over(self) -> bool:
        return self.passes >= BLOCK

    def void(self) -> None:
        """Left out: its time holds other work (an idle wait, the other lane's passes)."""
        self.counted = False


class Pacing:
    """Checking and plain blocks' rates by batch size; whether the next block
    checks. Engine thread only."""

    def __init__(self, always: bool = False) -> None:
        self.always = always  # check proposals whatever the rates (tests, benchmarks)
        self._plain: dict[int, _Average] = {}
        self._checking: dict[int, _Average] = {}
        self._waited: dict[int, int] = {}  # plain blocks since checking lost, by size
        self._retry: dict[int, int] = {}  # plain blocks between retries, by size
        self._shapes: set[tuple[int, int]] = set()  # (rows, width) of the passes run so far

    def new_shape(self, rows: int, width: int) -> bool:
        """Whether a pass of `rows` rows and `width` tokens a row runs for the first time."""
        if (rows, width) in self._shapes:
            return False
        self._shapes.add((rows, width))
        return True

    def start(self, rows: int) -> Block:
        """The next block, over `rows` rows: checking or plain."""
        return Block(rows, self._checks(_size_class(rows)))

    def ended(self, block: Block) -> None:
        """`block` ran its passes: its rate, up to now, joins its kind's."""
        if not block.counted:
            return
        seconds = time.perf_counter() - block.started
        kept = self._checking if block.checking else self._plain
        if block.size in kept:
            kept[block.size].add(seconds, block.tokens)
        else:
            kept[block.size] = _Average(seconds, block.tokens)

    def _checks(self, size: int) -> bool:
        if self.always:
            return True
        plain, checking = self._plain.get(size), self._checking.get(size)
        if plain is None:
            return False  # plain blocks first: the measure a checking one is held against
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
