"""The memory tier of the prefix cache (`engine.prefix_cache`): finished
sequences' KV caches, keyed by their tokens (engine thread only).

Each entry is one sequence's per-layer cache, as mlx-lm's BatchGenerator hands
it back, and the tokens whose keys and values it holds; a new prompt starts
from the entry sharing its longest prefix (`engine.prefix_cache.token_tree` says which).

What the tier may hold is decided elsewhere (`engine.memory`: whatever the
memory budget leaves beside the batch); `over` names what to drop to get
there: entries whose whole key a running request carries in the batch first
(it holds a copy, and the entry it leaves when it ends serves all they serve),
then new conversations' entries, then returning ones' that memory did not
serve, then returning ones' it served; entries that requests waiting to start
reuse go last, carried or not: a row's copy serves that row alone, and every
request still waiting for a shared prefix (a document many questions ask
about) would prefill it again. An optional cap (`--prompt-cache-bytes`)
bounds the tier besides.

A conversation is returning when most of its prompt extends an entry's key, one
held or one dropped for room (`gone` remembers their keys). Least recently used
alone fails sessions that take turns with more history than memory holds: each
session's entry is the oldest when its turn comes, so each is dropped just
before it is wanted, and none is served. Here the sessions memory serves keep
their entries, and one that missed has its new entry dropped first (most
recently kept first among those): kept, it would push out a session coming
back sooner. Memory so serves as many sessions as it holds. A returning
conversation that stays away OVERDUE times as long as it took between turns
counts as new again, so finished conversations do not hold memory for long.

Stored entries are never mutated: a lookup returns new cache objects over the
same MLX arrays (which are immutable values; BatchGenerator copies them into
its batch), trimmed to the reused length.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

from smg_mlx.engine.prefix_cache.token_tree import Entry, TokenTree

LayerCache = Any  # one layer's mlx-lm cache object

OVERDUE = 3.0
# However quickly a conversation came back, it counts as returning this long.
MIN_OVERDUE_SECONDS = 10.0
# Tokens of the keys of entries dropped for room remembered, at most.
GONE_TOKENS = 1 << 20


class Pace(NamedTuple):
    """A returning conversation's turn: the seconds since its last, and
    whether memory served it."""

    seconds: float
    served: bool


def detached(layer: LayerCache) -> LayerCache:
    """A new cache object over the same arrays, so trimming it leaves `layer` as it was."""
    if isinstance(layer, CacheList):
        return CacheList(*(detached(c) for c in layer.caches))
    clone = copy.copy(layer)
    if isinstance(layer, ArraysCache):
        clone.cache = list(layer.cache)  # a list it would otherwise share
    return clone


class Held:
    """A memory entry's cache and what the tiers know of it."""

    __slots__ = ("cache", "carried", "loaded", "written", "since", "used", "waited", "pace")

    def __init__(self, cache: list[LayerCache], loaded: bool, pace: Pace | None) -> None:
        self.cache = cache
        self.carried = 0  # running requests whose batch rows hold its whole key
        self.loaded = loaded  # read back from disk, and not yet reused since
        self.written = loaded  # a copy is on disk
        self.since = time.monotonic()  # when it was kept
        self.used = self.since  # when it was last kept or reused
        self.waited = 0.0  # seconds it had waited unused before that
        self.pace = pace  # the turn that made it, a returning conversation's (None: a new one's)

    def rank(self, now: float) -> tuple[int, float]:
        """Where it stands among entries to drop for room, first first (see
        the module's notes; least recently used first unless said)."""
        if self.carried:
            return 1, 0.0
        pace = self.pace
        if pace is None or now - self.used > max(OVERDUE * pace.seconds, MIN_OVERDUE_SECONDS):
            return 2, 0.0
        return (4, 0.0) if pace.served else (3, -self.since)


class MemoryTier:
    """Longest-prefix KV cache reuse in memory."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes  # the optional cap; None: the memory budget alone
        self.tree = TokenTree()
        self.gone = TokenTree()  # keys of entries dropped for room: when each was last used
        self.version = 0  # changes whenever an entry comes or goes
        self.evicted = 0  # entries dropped for room
        # Entries that left, gathered only where one reads them (`ended_rows`)
        self.departed: list[Entry] | None = None

    def __len__(self) -> int:
        return len(self.tree)

    @property
    def nbytes(self) -> int:
        return self.tree.nbytes

    # ---- lookup ----

    def match(self, prompt: Sequence[int], minimum: int = 1) -> tuple[int, Entry | None]:
        """What `lookup` would reuse now, and from which entry; uses nothing."""
        found = self.tree.longest(prompt, minimum)
        return found if found is not None else (0, None)

    def lookup(
        self, prompt: Sequence[int], minimum: int = 1
    ) -> tuple[list[LayerCache] | None, int, Entry | None]:
        """A cache holding the first n prompt tokens, n, and the entry it came
        from (None, 0, None on a miss). n is at most len(prompt) - 1; a match
        shorter than `minimum` is a miss and no use of its entry. The cache is
        the caller's to mutate."""
        n, entry = self.match(prompt, minimum)
        if entry is None:
            return None, 0, None
        self.tree.touch(entry)
        held, now = entry.value, time.monotonic()
        held.waited, held.used = now - held.used, now
        cache = [detached(c) for c in entry.value.cache]
        if n < entry.length:
            for layer in cache:
                layer.trim(entry.length - n)
        return cache, n, entry

    # ---- insert ----

    def insert(
        self,
        tokens: Sequence[int],
        cache: list[LayerCache],
        loaded: bool = False,
        pace: Pace | None = None,
    ) -> tuple[Entry | None, list[Entry]]:
        """Keep `cache`, which holds the keys and values of exactly `tokens`
        (`loaded`: read back from disk; `pace`: the turn that made it, see
        `returning`). Returns its entry (None when a longer entry already
        serves all it would; else the caller has `cache` evaluated:
        `materialize`, `ended_rows.copied_out`) and the entries it replaced
        or made redundant, which have left.

        What is kept is decided by the tokens alone, so every rank of a model
        split over several keeps the same; what to drop for memory is decided
        apart (`over`, `drop`), by the rank that decides."""
        if not tokens or not cache:
            return None, []
        held = Held(cache, loaded, pace)
        nbytes = sum(c.nbytes for c in cache)
        trimmable = all(c.is_trimmable() for c in cache)
        entry, removed = self.tree.insert(tokens, held, nbytes, trimmable)
        self.version += 1
        self._left(removed)
        return entry, removed

    @staticmethod
    def materialize(caches: Sequence[list[LayerCache]]) -> None:
        """Evaluate kept caches' lazy slices (they would keep the whole batch's
        arrays alive, and the next step would copy those whole to update them),
        without waiting: a blocking eval would stall the engine's pipelined
        steps. One call for many caches costs less than one each."""
        mx.async_eval([c.state for cache in caches for c in cache])

    def returning(self, prompt: Sequence[int], cached: int, entry: Entry | None) -> Pace | None:
        """The turn of a prompt that started from `entry` with `cached` tokens
        (just looked up), when most of it extends an entry's key: served,
        from a memory entry; not served, from one read back from disk or
        dropped for room (whose key is then forgotten: the prompt's own entry
        takes over). None: a new conversation."""
        if entry is not None and 2 * cached > len(prompt) and not entry.value.loaded:
            return Pace(entry.value.waited, served=True)
        found = self.gone.longest(prompt)
        if found is None or 2 * found[0] <= len(prompt):
            return None
        ghost = found[1]
        self.gone.remove(ghost)
        return Pace(time.monotonic() - ghost.value, served=False)

    def carry(self, entry: Entry, delta: int) -> None:
        """A running request's batch row begins (+1) or stops (-1) holding all of `entry`."""
        entry.value.carried += delta

    # ---- what memory allows ----

    def over(
        self, limit: int, keep: Collection[int] = (), wanted: Collection[int] = (),
        besides: int = 0,
    ) -> list[int]:  # fmt: skip
        """The entries to drop to hold at most `limit` bytes (and the cap),
        `besides` bytes held for them elsewhere counted in both, but those in
        `keep`: any larger than the cap alone, then as `Held.rank` says, those
        `wanted` by requests waiting to start last. Asked at every turn that
        plans, so it looks no further than it must."""
        cap = self.max_bytes
        if cap is not None:
            limit = min(limit, cap)
        limit = max(0, limit - besides)
        if self.nbytes <= limit:
            return []
        now = time.monotonic()

        def group(entry: Entry) -> tuple[bool, int, float]:
            if cap is not None and entry.nbytes > cap:
                return False, 0, 0.0
            return entry.id in wanted, *entry.value.rank(now)

        # A stable sort: least recently used first where ranks tie.
        ordered = sorted((e for e in self.tree if e.id not in keep), key=group)
        dropped, held = [], self.nbytes
        for entry in ordered:
            if held <= limit and (cap is None or entry.nbytes <= cap):
                break
            dropped.append(entry.id)
            held -= entry.nbytes
        return dropped

    def entries(self, ids: Sequence[int]) -> list[Entry]:
        """The entries with these ids still held."""
        return [e for id in ids if (e := self.tree.get(id)) is not None]

    def drop(self, ids: Sequence[int]) -> list[Entry]:
        """Drop these entries for room (those already gone are skipped); the
        entries dropped."""
        gone = self.entries(ids)
        for entry in gone:
            self.gone.insert(self.tree.tokens(entry), entry.value.used, entry.length, True)
            self.tree.remove(entry)
        self._left(gone)
        for ghost in self.gone:  # the oldest keys go first
            if self.gone.nbytes <= GONE_TOKENS:
                break
            self.gone.remove(ghost)
        self.evicted += len(gone)
        self.version += bool(gone)
        return gone

    def begin(self) -> None:
        """Start anew after the warm-up: nothing dropped, nor remembered as dropped."""
        self.evicted = 0
        self.gone = TokenTree()

    def clear(self) -> None:
        """Drop everything (its tree holds cycles: freed now, not at a collection)."""
        self._left(list(self.tree))
        for tree in (self.tree, self.gone):
            for entry in tree:
                tree.remove(entry)
        self.version += 1

    def _left(self, entries: Sequence[Entry]) -> None:
        if self.departed is not None:
            self.departed += entries
