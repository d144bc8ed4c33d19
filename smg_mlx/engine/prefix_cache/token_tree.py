"""A radix tree of token sequences, each holding one entry: the index of both
prefix-cache tiers (memory, `engine.prefix_cache`; disk, `engine.prefix_cache.disk_tier`).

Pure Python, no MLX. An entry is found by the longest prefix it shares with a
prompt, walking the prompt once whatever the number of entries:

- A trimmable entry (plain KV caches, rotating ones that have not wrapped) can
  be cut back to any shorter prefix, so it serves every prompt that shares
  some prefix with it.
- Any other entry (a wrapped sliding window, recurrent state) holds a state
  that cannot be rewound: it serves only prompts that extend its whole key.

At least one prompt token is always left over, so the model still computes
the logits of the first new token. A trimmable entry makes every entry on its
path redundant (it serves all they serve), and is itself redundant below a
longer trimmable one. The tree keeps its entries in least-recently-used order
and their total size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any


class Entry:
    """One sequence's value in the tree, as the caller gave it."""

    __slots__ = ("id", "node", "value", "nbytes", "trimmable")

    def __init__(self, id: int, node: _Node, value: Any, nbytes: int, trimmable: bool) -> None:
        self.id = id  # how many inserts there have been, it included
        self.node = node
        self.value = value
        self.nbytes = nbytes
        self.trimmable = trimmable

    @property
    def length(self) -> int:
        """Tokens in its key."""
        return self.node.depth


class _Node:
    """A node: the path from the root spells `depth` tokens."""

    __slots__ = ("edge", "parent", "children", "entry", "depth", "trimmable_below")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None) -> None:
        self.edge = edge  # the tokens from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None
        self.depth = (parent.depth if parent else 0) + len(edge)
        # Trimmable entries at or below this node: finds one without a search.
        self.trimmable_below = 0


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (slices compare at C speed)."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if tuple(a[low:middle]) == tuple(b[low:middle]):
            low = middle
        else:
            high = middle
    return low


class TokenTree:
    """Entries keyed by token sequences, longest-prefix lookup, LRU order."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._root = _Node((), None)
        self._lru: OrderedDict[Entry, None] = OrderedDict()  # oldest first
        self._entries: dict[int, Entry] = {}
        self._inserted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[Entry]:
        """Entries, least recently used first."""
        return iter(list(self._lru))

    def get(self, id: int) -> Entry | None:
        return self._entries.get(id)

    def touch(self, entry: Entry) -> None:
        """`entry` was used now."""
        self._lru.move_to_end(entry)

    @staticmethod
    def tokens(entry: Entry) -> tuple[int, ...]:
        """The key of `entry`."""
        edges = []
        node = entry.node
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return tuple(t for edge in reversed(edges) for t in edge)

    # ---- lookup ----

    def longest(self, prompt: Sequence[int], minimum: int = 1) -> tuple[int, Entry] | None:
        """The entry sharing the longest usable prefix with the prompt, and how
        many tokens of it are usable (at most len(prompt) - 1); None when
        fewer than `minimum`. Uses nothing (see `touch`)."""
        limit = len(prompt) - 1
        best: tuple[int, Entry] | None = None
        node, depth = self._root, 0
        while True:
            # Entries whose whole key is a prefix of the prompt need no trimming.
            if node.entry is not None and 0 < depth <= limit:
                best = (depth, node.entry)
            if depth == len(prompt) or prompt[depth] not in node.children:
                below = node
                break
            child = node.children[prompt[depth]]
            matched = common_length(child.edge, prompt[depth : depth + len(child.edge)])
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
    def _trimmable_under(node: _Node) -> Entry:
        while node.entry is None or not node.entry.trimmable:
            node = next(c for c in node.children.values() if c.trimmable_below)
        return node.entry

    # ---- insert ----

    def insert(
        self, tokens: Sequence[int], value: Any, nbytes: int, trimmable: bool
    ) -> tuple[Entry | None, list[Entry]]:
        """Keep `value` under `tokens`. Returns its entry (None when a longer
        trimmable entry already serves every prompt it would) and the entries
        it replaced or made redundant, which have left the tree."""
        if not tokens:
            return None, []
        node = self._node_for(tuple(tokens))
        self._inserted += 1
        longer = node.trimmable_below - (node.entry is not None and node.entry.trimmable)
        if trimmable and longer > 0:
            self._prune(node)
            return None, []
        removed = []
        if node.entry is not None:  # an older value of the same tokens
            removed.append(node.entry)
            self._forget(node.entry)
        entry = Entry(self._inserted, node, value, nbytes, trimmable)
        node.entry = entry
        self._lru[entry] = None
        self._entries[entry.id] = entry
        self.nbytes += nbytes
        if trimmable:
            self._count_trimmable(node, 1)
            ancestor = node.parent
            while ancestor is not None:
                parent = ancestor.parent
                if ancestor.entry is not None:
                    removed.append(ancestor.entry)
                    self.remove(ancestor.entry)
                ancestor = parent
        return entry, removed

    def _node_for(self, key: tuple[int, ...]) -> _Node:
        """The node spelling `key`, created (splitting an edge) if need be."""
        node, depth = self._root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                leaf = _Node(key[depth:], node)
                node.children[key[depth]] = leaf
                return leaf
            matched = common_length(child.edge, key[depth : depth + len(child.edge)])
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

    def remove(self, entry: Entry) -> None:
        """Take `entry` out of the tree (one that already left is ignored)."""
        if self._entries.get(entry.id) is not entry:
            return
        self._forget(entry)
        self._prune(entry.node)

    def _forget(self, entry: Entry) -> None:
        """Forget `entry`, leaving its node in the tree."""
        del self._lru[entry]
        del self._entries[entry.id]
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
