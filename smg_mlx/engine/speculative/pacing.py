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
powers of two) a moving average of the tokens a second of plain blocks and
of checking ones (each block weighing the passes it ran), these for each
width (`widths`: the most tokens a row may propose in the block's passes); a
block checks where its rate beats the plain one's.
A wider pass keeps more of a row's right proposals, and costs more once
the device computes rather than waits: the width checking runs at is the
one measured best, its neighbours timed now and then (every PROBE checking
blocks); a width that loses to plain passes gives way to the next narrower
one, tried when a losing checking run would be; once none is left to try, the
next trial starts again from the widest, the measures before it forgotten.
Checking pays only where it is fair too: rows with nothing right to propose
make a token a pass whatever their neighbours do, and a checking pass costs
more than a plain one (it waits for the one before, and is wider). So each
stream keeps a ledger (`Pacing.admit`): the tokens it made, less FAIR of
those plain passes would have made it in the same time (plain passes as
they usually run, without the slow one where a row ends or joins:
`Block.usual`). Plain passes add
to it, a checking pass where it keeps fewer proposals than the pass costs
takes from it; it starts with what FAIR leaves of its first ALLOWANCE
tokens. While any stream that kept no proposal in its last checking pass
could not afford another such, passes are plain (one keeping some is
making its ledger up; one checked fewer than JUDGED times may have its
first proposals still to find). So no stream makes much less than FAIR
of its plain pace over its life, whatever its neighbours gain, and a
stream whose proposals were right has room for a spell of wrong ones. One
stream's chat beside another's agent is not slowed for the agent's gain.
Until both are measured it is tried; whichever kind loses runs again now and
then, as the batch, its proposals and the machine change (a losing checking
run after ever longer waits, drawn give or take a quarter, and after plain
passes ran long enough that what the last trial lost is a small share of the
time, TRIAL_SHARE; plain after longer waits too, within a few dozen blocks);
a checking block clearly losing after its first passes ends there
(`losing`), so that a trial costs a few passes. A pass of a shape run for
the first time counts in no block, neither its time nor its tokens (the
backend may build kernels for it first); a block the engine set aside
(`Block.void`) counts not at all.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping

BLOCK = 8  # passes a block runs
WEIGHT = 0.25  # of each new block in a moving average
# Blocks after which the kind that lost runs again: a losing checking block
# after RETRY, doubling after each retry that loses again, up to MOST_RETRY;
# a plain block after RETRY too, doubling while checking keeps winning, up to
# MOST_PLAIN_RETRY (where checking makes several tokens a pass, each plain
# block costs most of its passes' worth).
RETRY, MOST_RETRY, MOST_PLAIN_RETRY = 8, 512, 64
# A checking block whose rate after EARLY passes is under this share of the
# plain rate ends there.
EARLY, LOSING = 2, 0.75
# What losing trials may cost, at most, as a share of the time plain passes
# run between them: a trial that cost c seconds more than plain passes would
# have is followed by c / TRIAL_SHARE seconds of plain ones at least (a draft
# model catching up on every row's tokens makes a trial cost far more than
# its passes).
TRIAL_SHARE = 0.03
# Seconds between two log lines (info) saying checking turned to pay, or not,
# for one batch size: rates near each other may cross back and forth.
SAY_EVERY = 10.0
# Seconds from which a pass of a shape run for the first time is logged (info):
# a stall every stream sees.
SLOW_FIRST = 0.5
# Checking blocks at a size between two at a neighbouring width.
PROBE = 8
# The share of its pace under plain passes a stream keeps, at least, over its life.
FAIR = 0.97
# A stream's first tokens (its `max_tokens`, if fewer) of which it may lose
# 1 - FAIR before its checking passes have made any up.
ALLOWANCE = 256
# Checking passes a stream runs before its ledger may stop checking.
JUDGED = 2

log = logging.getLogger(__name__)


def _size_class(rows: int) -> int:
    """Batch sizes that share their measurements: powers of two."""
    return 1 << (rows - 1).bit_length()


def widths(most: int, chain: int = 1) -> list[int]:
    """The widths checking blocks may run at, narrowest first: `most` and its
    halves, down to 1, a pass; then, where a call may send `chain` passes
    each while the one before runs, `most` for each of them (a wrong
    proposal costs the pass after it too, where the device's time is saved)."""
    one = {most >> k for k in range(most.bit_length())}
    return sorted(one | ({most * chain} if chain > 1 else set()))


def _streams(size: int) -> str:
    """The batch sizes of a size class, said."""
    if size <= 2:
        return "1 stream" if size == 1 else "2 streams"
    return f"{size // 2 + 1} to {size} streams"


class _Average:
    """A moving average of a kind's passes: seconds and tokens a pass (a run
    weighs as many passes as it ran: one cut short two passes in, where a
    stream's first proposals were wrong, moves it a quarter as far as a
    whole run); over its first passes, their mean (a run timed in a slow
    moment weighs no more than its share). Beside the seconds a pass, those
    of its usual pass (`Block.usual`)."""

    __slots__ = ("seconds", "usual", "tokens", "sent", "passes", "weight", "last")

    def __init__(self, block: Block, seconds: float) -> None:
        passes = block.passes
        self.seconds, self.tokens = seconds / passes, block.tokens / passes
        self.usual = block.usual()
        self.sent = block.sent / passes  # the model's passes a pass sent (chained)
        self.passes = self.last = passes
        self.weight = 1.0  # the last run's

    def add(self, block: Block, seconds: float) -> None:
        passes = block.passes
        self.passes += passes
        self.last = passes
        self.weight = weight = min(1.0, max(WEIGHT * passes / BLOCK, passes / self.passes))
        self.seconds += weight * (seconds / passes - self.seconds)
        self.usual += weight * (block.usual() - self.usual)
        self.tokens += weight * (block.tokens / passes - self.tokens)
        self.sent += weight * (block.sent / passes - self.sent)

    def later(self, seconds: float) -> None:
        """The last run took `seconds` more."""
        self.seconds += self.weight * seconds / self.last

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class _Stream:
    """A stream's ledger (the module's docstring), in tokens; the checking
    passes it ran, and whether it kept a proposal in the last."""

    __slots__ = ("ledger", "checks", "kept")

    def __init__(self, ledger: float) -> None:
        self.ledger, self.checks, self.kept = ledger, 0, True

    def judged(self, more: int = 0) -> bool:
        """Whether it ran JUDGED checking passes (`more` with those of the run
        under way): a stream finds its first proposals a few tokens in."""
        return self.checks + more >= JUDGED


class Block:
    """A run of one batch's passes, all checking or all plain."""

    __slots__ = (
        "size", "checking", "width", "started", "passes", "checked", "tokens", "sent",
        "counted", "skipped", "rows", "_pass", "_mark", "_walls",
    )  # fmt: skip

    def __init__(self, rows: int, checking: bool, width: int = 0) -> None:
        self.size = _size_class(rows)
        self.checking = checking
        # The most tokens a row proposes in its passes (0: as many as allowed).
        self.width = width if checking else 0
        self.started = self._pass = time.perf_counter()
        self.passes = self.checked = self.tokens = self.sent = 0
        self.skipped = 0.0  # seconds of passes that do not count
        self.counted = True
        # By row told (`ran`): [tokens, passes, whether it kept a proposal in its last].
        self.rows: dict[int, list[int]] = {}
        self._mark: float | None = None  # where the next pass's time starts
        self._walls: list[float] = []  # each timed pass's, up to the end of the one before

    def begins(self) -> None:
        """One of its passes begins."""
        self._pass = time.perf_counter()
        if self._mark is None:
            self._mark = self._pass

    def ran(
        self, tokens: int, new_shape: bool, checked: bool = False,
        rows: Mapping[int, int] | None = None, sent: int = 1,
    ) -> None:  # fmt: skip
        """The pass that began returned `tokens` (`new_shape`: its shape's
        first run, not timed; `checked`: it checked proposals, and waited for
        the pass before it, timed or not; `rows`: the tokens of each row, by
        uid, that decodes on after it: not those that ended or joined;
        `sent`: the model's passes it took, chained)."""
        self.checked += checked
        now, mark = time.perf_counter(), self._mark
        self._mark = now
        if new_shape:
            took = now - self._pass
            self.skipped += took
            if took >= SLOW_FIRST:
                log.info("speculation, batches of %s: a %s pass of a new shape took %.1f s "
                         "(mlx building its kernels; every stream waited)", _streams(self.size),
                         "checking" if checked else "plain", took)  # fmt: skip
            return
        self._walls.append(now - (mark if mark is not None else self._pass))
        self.passes += 1
        self.tokens += tokens
        self.sent += sent
        for uid, made in (rows or {}).items():
            counts = self.rows.setdefault(uid, [0, 0, 0])
            counts[0] += made
            counts[1] += 1
            counts[2] = made > sent  # (each of its passes made it one token, and those it kept)

    def fits(self, rows: int) -> bool:
        """Whether a batch of `rows` rows is of its size."""
        return _size_class(rows) == self.size

    @property
    def over(self) -> bool:
        return self.passes >= BLOCK

    def seconds(self) -> float:
        """Its time so far, but the passes that do not count."""
        return time.perf_counter() - self.started - self.skipped

    def usual(self) -> float:
        """Its usual pass's seconds (the median, from the end of the pass before
        to its own): a pass where a row ends or joins takes several times as
        long, and where checking has rows end apart, they do far more often
        than in a batch that never checks, whose rows of one length end
        together. So a stream's plain pace is this, not the mean."""
        walls = sorted(self._walls)
        return walls[len(walls) // 2] if walls else 0.0

    def void(self) -> None:
        """Left out: its time holds other work (the other lane's passes)."""
        self.counted = False

    @property
    def measured(self) -> bool:
        """Whether it counts: not left out, and some of its passes were timed."""
        return self.counted and self.passes > 0


class Pacing:
    """Checking and plain blocks' rates by batch size; whether the next block
    checks. Engine thread only."""

    def __init__(self, always: bool = False, most: int = 0, chain: int = 1) -> None:
        self.always = always  # check proposals whatever the rates (tests, benchmarks)
        # The widths to choose from (`widths`); where none are given, every
        # checking block is as wide as the rows are allowed to propose.
        self._widths = widths(most, chain) if most and not always else [0]
        self._plain: dict[int, _Average] = {}
        self._checking: dict[tuple[int, int], _Average] = {}  # by size and width
        self._width: dict[int, int] = {}  # by size: the width checking runs at
        self._probe: dict[int, int] = {}  # by size: checking blocks since a neighbour's
        self._waited: dict[int, int] = {}  # plain blocks since checking lost, by size
        self._retry: dict[int, int] = {}  # blocks between retries, by size
        self._due: dict[int, int] = {}  # by size: blocks until the next retry (`_drawn`)
        self._random = random.Random(0)
        self._wins: dict[int, bool] = {}  # by size: whether checking won, as last seen
        self._shapes: set[tuple[int, int]] = set()  # (rows, width) of the passes run so far
        self._said: dict[int, tuple[bool, float]] = {}  # by size: the verdict logged, when
        # By size: plain seconds due before the next trial (after one that lost), and run since.
        self._owed: dict[int, float] = {}
        self._plain_since: dict[int, float] = {}
        self._streams: dict[int, _Stream] = {}  # by uid (`admit`)

    def admit(self, uid: int, max_tokens: int) -> None:
        """Stream `uid` decodes from now on, for `max_tokens` tokens at most:
        its ledger opens with what FAIR leaves of its first ALLOWANCE tokens."""
        self._streams[uid] = _Stream((1 - FAIR) * min(max_tokens, ALLOWANCE))

    def _stream(self, uid: int) -> _Stream:
        """Stream `uid`'s (one not admitted opens with all of ALLOWANCE)."""
        if uid not in self._streams:
            self._streams[uid] = _Stream((1 - FAIR) * ALLOWANCE)
        return self._streams[uid]

    def left(self, uids: Iterable[int] | None = None) -> None:
        """Streams that decode no more: their ledgers closed (None: every one,
        as the lanes start empty again)."""
        if uids is None:
            self._streams.clear()
        for uid in uids or ():
            self._streams.pop(uid, None)

    def _behind(self, uids: Iterable[int], size: int) -> int:
        """How many of streams `uids` could not afford another checking pass at
        `size` where they keep no proposal, as they did in their last (`_Stream.judged`)."""
        margin = self._margin(size)
        streams = [self._streams[uid] for uid in uids if uid in self._streams]
        return sum(s.judged() and not s.kept and s.ledger < margin for s in streams)

    def _margin(self, size: int) -> float:
        """What a checking pass at `size` takes from the ledger of a stream
        that keeps no proposal in it (each pass it chains makes it a token),
        as measured (0: not measured)."""
        plain, checking = self._plain.get(size), self._current(size)
        if plain is None or checking is None or plain.usual <= 0:
            return 0.0
        return max(0.0, FAIR * checking.seconds / plain.usual - checking.sent)

    def new_shape(self, rows: int, width: int) -> bool:
        """Whether a pass of `rows` rows and `width` tokens a row runs for the first time."""
        if (rows, width) in self._shapes:
            return False
        self._shapes.add((rows, width))
        return True

    def start(self, rows: int, uids: Iterable[int] = ()) -> Block:
        """The next block, over `rows` rows (streams `uids`): checking (at which
        width) or plain."""
        size = _size_class(rows)
        if not self.always and self._behind(uids, size):
            return Block(rows, False)  # (until their ledgers are made up)
        if not self._checks(size):
            return Block(rows, False)
        return Block(rows, True, self._next_width(size))

    def _at(self, size: int) -> int:
        """The width checking runs at, at `size` (the widest, until measured)."""
        return self._width.get(size, self._widths[-1])

    def _measured(self, size: int, width: int) -> _Average | None:
        """The rate of checking blocks at `width`, at `size` (None: not measured)."""
        return self._checking.get((size, width))

    def _current(self, size: int) -> _Average | None:
        """The rate of checking blocks at the width checking runs at, at `size`."""
        return self._measured(size, self._at(size))

    def _next_width(self, size: int) -> int:
        """The next checking block's width: where it wins, every PROBE blocks
        a neighbour of the width it runs at (the wider, then the narrower)."""
        at = self._at(size)
        if not self._pays(self._plain.get(size), self._current(size)):
            return at
        probe = self._probe[size] = self._probe.get(size, 0) + 1
        if probe % PROBE:
            return at
        i = self._widths.index(at)
        sides = [j for j in (i - 1, i + 1) if 0 <= j < len(self._widths)]
        return self._widths[sides[probe // PROBE % len(sides)]] if sides else at

    def losing(self, block: Block) -> bool:
        """Whether `block`, checking, makes clearly fewer tokens a second so far
        than plain blocks do, or has left a stream unable to afford another of
        its passes: it ends now, its passes measured as they are."""
        if not block.checked or self.always or not block.passes:
            return False
        cost = self._cost(block)
        if cost is None:
            return False
        # (a stream that could not afford the next pass, at this block's cost so far)
        margin = max(0.0, FAIR * cost - block.sent / block.passes)
        for uid, (made, passes, kept) in block.rows.items():
            s = self._stream(uid)
            ledger = s.ledger + made - FAIR * passes * cost
            if s.judged(passes) and not kept and ledger < margin:
                # (how many checking passes a stream runs before its proposals are
                # right, or it stops checking for the batch: the cost of its first tokens)
                log.debug("speculation, batches of at most %d: checking ends: a stream kept "
                          "none of its proposals in its checking pass %d, and could not afford "
                          "another (its ledger %.1f tokens, a pass %.1f)", block.size,
                          s.checks + passes, ledger, margin)  # fmt: skip
                return True
        plain, seconds = self._plain[block.size], block.seconds()
        if not block.counted or block.passes < EARLY or seconds <= 0:
            return False
        return block.tokens / seconds < LOSING * plain.rate

    def _cost(self, block: Block) -> float | None:
        """What each of `block`'s passes cost a stream, in usual plain passes
        (`Block.usual`): as its own time says, rows ending and joining in it
        and all, or where that holds other work (`Block.void`), as checking
        passes at its size were measured (None: not known)."""
        if not block.checked:
            return 1.0
        plain = self._plain.get(block.size)
        if plain is None or plain.usual <= 0:
            return None
        if block.measured:
            return block.seconds() / block.passes / plain.usual
        current = self._current(block.size)
        return current.seconds / plain.usual if current is not None else None

    @staticmethod
    def _pays(plain: _Average | None, checking: _Average | None) -> bool:
        """Whether checking at this measure makes more tokens a second than plain passes."""
        if plain is None or checking is None:
            return False
        return checking.rate > plain.rate

    def ended(self, block: Block) -> None:
        """`block` ran its passes: its rate, up to now, joins its kind's, and
        what each stream made in it, its ledger (whether its time counts or not:
        the streams ran its passes either way)."""
        if (cost := self._cost(block)) is not None and block.passes:
            for uid, (made, passes, kept) in block.rows.items():
                s = self._stream(uid)
                s.ledger += made - FAIR * passes * cost
                if block.checked:
                    s.checks += passes
                    s.kept = bool(kept)
        if not block.measured:
            log.debug("speculation, batches of at most %d: a run of %d %s passes left out of "
                      "the rates (other work ran beside them)", block.size, block.passes,
                      "checking" if block.checked else "plain")  # fmt: skip
            return
        seconds = block.seconds()
        kept, key = self._kept(block)
        if key in kept:
            kept[key].add(block, seconds)
        else:
            kept[key] = _Average(block, seconds)
        self._account(block, seconds)
        if block.checked:
            self._choose_width(block.size, block.width)
        if log.isEnabledFor(logging.DEBUG):
            plain = self._plain.get(block.size)
            checking = self._current(block.size)
            log.debug(
                "speculation, batches of at most %d: %d %s passes%s made %d tokens in %.1f ms; "
                "tokens a second, checking %s, plain %s", block.size, block.passes,
                "checking" if block.checked else "plain", _width_said(block.width, " ({})"),
                block.tokens, 1e3 * seconds,
                f"{checking.rate:.0f}{_width_said(self._at(block.size), ' ({})')}"
                if checking else "not measured",
                f"{plain.rate:.0f}" if plain else "not measured",
            )  # fmt: skip
        self._say(block.size, self._behind(block.rows, block.size))

    def _choose_width(self, size: int, ran: int) -> None:
        """After a checking block at width `ran`: the width checking runs at
        becomes the best measured one; one that loses to plain passes gives
        way to the next narrower one not measured yet (tried at the next trial)."""
        if ran not in self._widths:
            return
        at, current = self._at(size), self._current(size)
        if current is None:
            return  # the other lane's block moved it on to a width not tried yet
        plain = self._plain.get(size)
        if self._measured(size, ran).rate > current.rate:
            self._width[size], at, current = ran, ran, self._measured(size, ran)
        i = self._widths.index(at)
        if plain is not None and not self._pays(plain, current) and i > 0:
            if self._measured(size, narrower := self._widths[i - 1]) is None:
                self._width[size] = narrower

    def _say(self, size: int, behind: int) -> None:
        """Log (info) where checking proposals turns to pay at a batch size, or
        to lose (or leaves `behind` streams' ledgers below nothing): at most
        every SAY_EVERY seconds a size. Where the width checking ran at lost
        and a narrower one waits for a trial, checking has stopped: said with
        the best rate measured."""
        plain, current = self._plain.get(size), self._current(size)
        width, checking = self._at(size), current
        if checking is None:
            measured = [(a.rate, w) for (s, w), a in self._checking.items() if s == size]
            if measured:
                width = max(measured)[1]
                checking = self._measured(size, width)
        if plain is None or checking is None or self.always:
            return
        pays, now = self._pays(plain, current) and not behind, time.perf_counter()
        said, when = self._said.get(size, (None, -SAY_EVERY))
        if pays == said or now - when < SAY_EVERY:
            return
        self._said[size] = (pays, now)
        unfair = f", {_streams_said(behind)} below {FAIR:.0%} of plain pace" if behind else ""
        log.info(
            "speculation, batches of %s: checking proposals %s (%.0f tokens a second%s against "
            "%.0f plain%s)%s", _streams(size),
            "pays" if pays else "does not pay", checking.rate,
            _width_said(width, ", {},"), plain.rate, unfair,
            "" if pays else "; plain passes, a trial now and then"
            if not behind else "; plain passes until they catch up",
        )  # fmt: skip

    def charge(self, ended: Block, then: Block, work: Callable[[], object]) -> None:
        """Run `work` (lining up the rows `ended` left apart) on `ended`'s clock,
        not on `then`'s, the block after it."""
        started = time.perf_counter()
        work()
        seconds = time.perf_counter() - started
        then.skipped += seconds
        log.debug("speculation, batches of at most %d: rows lined up after checking passes "
                  "in %.1f ms", ended.size, 1e3 * seconds)  # fmt: skip
        if ended.measured:
            kept, key = self._kept(ended)
            kept[key].later(seconds)
            if ended.checked and ended.size in self._owed:
                self._owed[ended.size] += seconds / TRIAL_SHARE

    def _account(self, block: Block, seconds: float) -> None:
        """What a checking block that lost cost beyond plain passes, as plain
        time due before the next trial; a plain block's time, towards it."""
        plain, size = self._plain.get(block.size), block.size
        if not block.checked:
            self._plain_since[size] = self._plain_since.get(size, 0.0) + seconds
        elif plain is not None and plain.rate > 0 and (lost := _lost(block, seconds, plain)) > 0:
            self._owed[size] = lost / TRIAL_SHARE
            self._plain_since[size] = 0.0
        else:
            self._owed.pop(size, None)

    def _kept(self, block: Block) -> tuple[dict, object]:
        """Where `block`'s rate is kept, and its key there."""
        # A checking block whose rows had nothing to propose ran plain passes.
        if block.checked:
            return self._checking, (block.size, block.width)
        return self._plain, block.size

    def _checks(self, size: int) -> bool:
        if self.always:
            return True
        plain, checking = self._plain.get(size), self._current(size)
        if plain is None:
            return False  # plain blocks first: the measure a checking one is held against
        if checking is None and all(measured != size for measured, _ in self._checking):
            return True  # the first checking block at this size
        # (A width not measured yet, after a wider one lost, waits as a losing
        # kind does: trying the widths one after another would cost as much as
        # as many trials.)
        wins = self._pays(plain, checking)
        # The kind that lost runs again now and then: its measure goes stale
        # as the batch, its proposals and the machine change (a plain block
        # timed while kernels were built would keep a losing checking run
        # going). After ever longer waits while it keeps losing, from RETRY
        # blocks where the verdict turned.
        if wins != self._wins.get(size):
            self._wins[size] = wins
            self._retry[size] = RETRY
            self._due[size] = self._drawn(RETRY, wins)
        waited = self._waited[size] = self._waited.get(size, 0) + 1
        if waited < self._due.get(size, RETRY):
            return wins
        if not wins and self._plain_since.get(size, 0.0) < self._owed.get(size, 0.0):
            return False  # the last trial's cost is not yet a small share of the time since
        self._waited[size] = 0
        most = MOST_RETRY if not wins else MOST_PLAIN_RETRY
        retry = self._retry[size] = min(2 * self._retry.get(size, RETRY), most)
        self._due[size] = self._drawn(retry, wins)
        # (A narrower width not measured yet is tried first; at the widest the
        # trial's measure joins those before it, which hold the lining up of
        # rows that ended apart, charged when a checking run ends.)
        if not wins and self._current(size) is not None and self._at(size) != self._widths[-1]:
            self._forget_widths(size)
        return not wins

    def _drawn(self, blocks: int, wins: bool) -> int:
        """The wait before the next trial of the kind that lost: `blocks`, and
        where checking lost, a quarter more or less, drawn. Requests of one
        length would otherwise have every trial start at the same point of
        one (waits of whole runs, of eight passes, doubling), and a stream's
        first tokens are where its proposals are least often right."""
        if wins:
            return blocks
        return self._random.randint(blocks - blocks // 4, blocks + blocks // 4)

    def _forget_widths(self, size: int) -> None:
        """A trial after checking lost at every width it could try, down to a
        narrower one, starts from the widest again, its measures at `size`
        forgotten: they date from proposals as they were (a width that lost to
        wrong ones would never be tried once they are right)."""
        for key in [key for key in self._checking if key[0] == size]:
            del self._checking[key]
        self._width.pop(size, None)
        self._probe.pop(size, None)


def _lost(block: Block, seconds: float, plain: _Average) -> float:
    """The seconds a checking block took beyond what plain passes would have
    taken for its tokens."""
    return seconds - block.tokens / plain.rate


def _streams_said(n: int) -> str:
    """`n` streams, said."""
    return "1 stream" if n == 1 else f"{n} streams"


def _width_said(width: int, form: str) -> str:
    """A checking block's width said in `form` ("" where it has none)."""
    return form.format(f"up to {width} proposed a stream") if width else ""
