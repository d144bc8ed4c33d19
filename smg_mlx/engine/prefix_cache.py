"""A bounded store of finished sequences' KV caches, keyed by their tokens.

Runs on the engine thread only. Each entry is one sequence's per-layer cache
(as mlx-lm's BatchGenerator hands it back) and the tokens whose keys and
values it holds. A new prompt starts from the entry sharing its longest prefix:

- A trimmable entry (plain KV caches; rotating ones that have not wrapped)
  can be cut back to any shorter prefix, so it serves every prompt that shares
  some prefix with it.
- Any other entry (a wrapped sliding window, recurrent state) holds a state
  that cannot be rewound: it serves only prompts that extend its whole key.

At least one prompt token is always left to prefill, so the model still
produces the logits of the first new token.

Entries live in a radix tree (edges labelled by token runs), so a lookup
walks the prompt once, whatever the number of entries. Memory is bounded by
the entries' `nbytes`; the least recently used go first.

Stored entries are never mutated: a lookup returns new cache objects over the
same MLX arrays (which are immutable values; BatchGenerator copies them into
its batch), trimmed to the reused length.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList

log = logging.getLogger(__name__)

LayerCache = Any  # one layer's mlx-lm cache object


def _detached(layer: LayerCache) -> LayerCache:
    """A new cache object over the same arrays, so trimming it leaves `layer` as it was."""
    if isinstance(layer, CacheList):
        return CacheList(*(_detached(c) for c in layer.caches))
    clone = copy.copy(layer)
    if isinstance(layer, ArraysCache):
        clone.cache = list(layer.cache)  # a list it would otherwise share
    return clone


class _Entry:
    __slots__ = ("id", "node", "cache", "nbytes", "trimmable")

    def __init__(self, id: int, node: _Node, cache: list[LayerCache]) -> None:
        self.id = id  # how many inserts there have been, it included: the same on every rank
        self.node = node
        self.cache = cache
        self.nbytes = sum(c.nbytes for c in cache)
        self.trimmable = all(c.is_trimmable() for c in cache)


class _Node:
    """A radix-tree node: the path from the root spells `depth` tokens."""

    __slots__ = ("edge", "parent", "children", "entry", "depth", "trimmable_below")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge  # the tokens from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: _Entry | None = None
        self.depth = (parent.depth if parent else 0) + len(edge)
        # Trimmable entries at or below this node: finds one without a search.
        self.trimmable_below = 0


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Longest-prefix KV cache reuse under a byte budget, LRU eviction."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._root = _Node((), None)
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # oldest first
        self._entries: dict[int, _Entry] = {}
        self._oversized: set[int] = set()  # entries larger than max_bytes alone
        self._inserted = 0

    def __len__(self) -> int:
        return len(self._lru)

    # ---- lookup ----

    def lookup(
        self, prompt: Sequence[int], minimum: int = 1
    ) -> tuple[list[LayerCache] | None, int]:
        """A cache holding the first n prompt tokens, and n (0 and None on a miss).

        n is at most len(prompt) - 1; a match shorter than `minimum` is a miss
        (and does not count as a use of its entry). The cache is the caller's
        to mutate.
        """
        found = self._longest(prompt, minimum)
        if found is None:
            return None, 0
        n, entry = found
        self._lru.move_to_end(entry)
        cache = [_detached(c) for c in entry.cache]
        if n < entry.node.depth:
            for layer in cache:
                layer.trim(entry.node.depth - n)
        return cache, n

    def reusable(self, prompt: Sequence[int], minimum: int = 1) -> int:
        """How many prompt tokens `lookup` would reuse now; uses nothing."""
        found = self._longest(prompt, minimum)
        return found[0] if found else 0

    def _longest(self, prompt: Sequence[int], minimum: int) -> tuple[int, _Entry] | None:
        """The entry sharing the longest usable prefix with the prompt, and its length."""
        limit = len(prompt) - 1
        best: tuple[int, _Entry] | None = None
        node, depth = self._root, 0
        while True:
            # Entries whose whole key is a prefix of the prompt need no trimming.
            if node.entry is not None and 0 < depth <= limit:
                best = (depth, node.entry)
            if depth == len(prompt) or prompt[depth] not in node.children:
                below = node
                break
            child = node.children[prompt[depth]]
            matched = _common(child.edge, prompt[depth : depth + len(child.edge)])
            if matched < len(child.edge):
                below, depth = child, depth + matched
                break
            node, depth = child, depth + matched
        # Every entry under `below` shares exactly `depth` tokens with the prompt.
        reach = min(depth, limit)
        if below.trimmable_below and reach > (best[0] if best else 0):
            best = (reach, self._trimmable_under(below))
        if best is None or best[0] < minimum:
            return None
        return best

    @staticmethod
    def _trimmable_under(node: _Node) -> _Entry:
        while node.entry is None or not node.entry.trimmable:
            node = next(c for c in node.children.values() if c.trimmable_below)
        return node.entry

    # ---- insert ----

    def insert(self, tokens: Sequence[int], cache: list[LayerCache]) -> None:
        """Keep `cache`, which holds the keys and values of exactly `tokens`.

        What is kept is decided by the tokens alone, so every rank of a model
        split over several keeps the same; the byte budget is applied apart
        (`over`, `drop`), by the rank that decides."""
        if not tokens or not cache:
            return
        node = self._node_for(tuple(tokens))
        self._inserted += 1
        entry = _Entry(self._inserted, node, cache)
        longer = node.trimmable_below - (node.entry is not None and node.entry.trimmable)
        # Redundant: a longer trimmable entry serves its prompts.
        if entry.trimmable and longer > 0:
            self._prune(node)
            return
        # Materialize the lazy slices (they would keep the whole batch's arrays
        # alive), without waiting: a blocking eval would stall the engine's
        # pipelined steps on every finished request.
        mx.async_eval([c.state for c in cache])
        if node.entry is not None:
            self._drop(node.entry)  # a newer cache of the same tokens
        node.entry = entry
        self._lru[entry] = None
        self._entries[entry.id] = entry
        if entry.nbytes > self.max_bytes:
            self._oversized.add(entry.id)
        self.nbytes += entry.nbytes
        if entry.trimmable:
            self._count_trimmable(node, 1)
            # Shorter entries on the path are now redundant: this one, trimmed,
            # serves every prompt they serve.
            ancestor = node.parent
            while ancestor is not None:
                parent = ancestor.parent
                if ancestor.entry is not None:
                    self._remove(ancestor.entry)
                ancestor = parent

    # ---- the byte budget ----

    def over(self, limit: int) -> list[int]:
        """The entries to drop to hold at most `limit` bytes (and `max_bytes`):
        any larger than `max_bytes` alone, then the least recently used. Asked
        every engine step, so it looks no further than it must."""
        limit = min(limit, self.max_bytes)
        dropped = list(self._oversized)
        held = self.nbytes - sum(self._entries[id].nbytes for id in dropped)
        for entry in self._lru:
            if held <= limit:
                break
            if entry.id not in self._oversized:
                dropped.append(entry.id)
                held -= entry.nbytes
        return dropped

    def size_of(self, ids: Sequence[int]) -> int:
        return sum(self._entries[id].nbytes for id in ids)

    def drop(self, ids: Sequence[int]) -> None:
        """Drop these entries; ones already gone (a later insert made them
        redundant) are skipped."""
        for id in ids:
            if id in self._entries:
                self._remove(self._entries[id])

    def shrink(self, limit: int) -> None:
        """Hold at most `limit` bytes (and `max_bytes`)."""
        self.drop(self.over(limit))

    def _node_for(self, key: tuple[int, ...]) -> _Node:
        """The node spelling `key`, created (splitting an edge) if need be."""
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                leaf = _Node(key[depth:], node)
                node.children[key[depth]] = leaf
                return leaf
            matched = _common(child.edge, key[depth : depth + len(child.edge)])
            if matched < len(child.edge):
                middle = _Node(child.edge[:matched], node)
                middle.trimmable_below = child.trimmable_below
                node.children[key[depth]] = middle
                child.edge = child.edge[matched:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            node, depth = child, depth + matched
        return node

    # ---- removal ----

    def _remove(self, entry: _Entry) -> None:
        self._drop(entry)
        self._prune(entry.node)

    def _drop(self, entry: _Entry) -> None:
        """Forget `entry`, leaving its node in the tree."""
        del self._lru[entry]
        del self._entries[entry.id]
        self._oversized.discard(entry.id)
        self.nbytes -= entry.nbytes
        entry.node.entry = None
        if entry.trimmable:
            self._count_trimmable(entry.node, -1)

    @staticmethod
    def _count_trimmable(node: _Node | None, delta: int) -> None:
        while node is not None:
            node.trimmable_below += delta
            node = node.parent

    @staticmethod
    def _prune(node: _Node) -> None:
        """Drop empty leaves and fold single-child nodes into their child."""
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child
