"""The prefix cache: finished sequences' KV caches, reused by later prompts
that share a prefix (engine thread only).

Chat and agent clients resend the whole conversation every turn; a prompt
starts from the entry sharing its longest prefix and prefills only the rest.
Two tiers hold the entries:

- memory (`engine.prefix_cache.memory_tier`): whatever the memory budget leaves beside the
  running batch (`engine.memory`), dropping entries only when a request needs
  the room;
- disk (`engine.prefix_cache.disk_tier`), optional: entries written behind, spilled when
  memory drops them, read back where that beats prefilling, found again after
  a restart.

`PrefixCache` is the one face the batch and the scheduler see: it answers the
scheduler's `Prefixes` questions (what a prompt would reuse, whether to wait
for a read from disk), gives the batch the cache a prompt starts from, keeps
what sequences leave, and counts what each tier served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from smg_mlx.config import EngineConfig
from smg_mlx.engine.prefix_cache.disk_folder import Read
from smg_mlx.engine.prefix_cache.disk_tier import DiskTier
from smg_mlx.engine.prefix_cache.memory_tier import LayerCache, MemoryTier, Pace
from smg_mlx.engine.prefix_cache.token_tree import Entry, TokenTree
from smg_mlx.engine.schedule.waiting_room import Reuse
from smg_mlx.engine.types import CacheStats

log = logging.getLogger(__name__)

# Shorter cached prefixes are not reused: unrelated prompts often share a token
# or two, which saves nothing, and every odd prefill length is one more shape
# for the backend to prepare kernels for.
MIN_REUSED_TOKENS = 16


def open_disk_tier(config: EngineConfig, wake: Callable[[], None]) -> DiskTier | None:
    """The disk tier the settings ask for, its folder opening in the background
    (`wake`: called from its threads when they finish work for the engine
    thread); see `PrefixCache.attach`. None: no disk tier."""
    off = config.prompt_cache_bytes == 0 or config.prompt_cache_disk_bytes == 0
    if off or config.prompt_cache_dir is None:
        return None
    directories = [config.model_path]
    if config.adapter_path is not None:
        directories.append(config.adapter_path)
    return DiskTier(config.prompt_cache_dir, config.prompt_cache_disk_bytes, directories, wake,
                    config.kv_format)  # fmt: skip


# What an ended sequence leaves: its tokens, its cache and its turn (`PrefixCache.keep`).
Ended = tuple[Sequence[int], list[LayerCache], Pace | None]


class Start(NamedTuple):
    """Where a prompt starts: the cache (None: a fresh one), the tokens it
    holds, the entry it came from, and its conversation's turn (None: a new
    conversation), which the entry it leaves keeps."""

    cache: list[LayerCache] | None = None
    tokens: int = 0
    entry: Entry | None = None
    pace: Pace | None = None


class PrefixCache:
    """Both tiers behind one face."""

    def __init__(self, max_bytes: int | None) -> None:
        self.memory = MemoryTier(max_bytes)
        self.disk: DiskTier | None = None
        # Bytes memory may give an entry read back from disk (the last plan's allowance).
        self.room = 0
        self._memory_tokens = 0
        self._disk_tokens = 0

    def attach(self, disk: DiskTier, prefill_seconds: Callable[[int, int], float]) -> None:
        """Add the disk tier once its folder is open (after the warm-up, whose
        entries are not for keeping); see `DiskTier.ready`."""
        disk.ready(prefill_seconds)
        self.disk = disk

    # ---- the scheduler's questions (`scheduler.Prefixes`) ----

    @property
    def version(self) -> int:
        return self.memory.version

    def reuse(self, prompt: Sequence[int]) -> Reuse:
        n, entry = self.memory.match(prompt, MIN_REUSED_TOKENS)
        return Reuse(n, entry.id, entry.nbytes) if entry is not None else Reuse()

    def fetch(self, prompt: Sequence[int], reuse: Reuse) -> Read | None:
        if self.disk is None:
            return None
        return self.disk.fetch(prompt, reuse.tokens, self.room)

    # ---- the batch ----

    def start_from(self, prompt: Sequence[int]) -> Start:
        """Where `prompt` starts."""
        cache, n, entry = self.memory.lookup(prompt, MIN_REUSED_TOKENS)
        pace = self.memory.returning(prompt, n, entry)
        if entry is None:
            return Start(pace=pace)
        log.debug("prefix cache hit: %d of %d prompt tokens", n, len(prompt))
        if entry.value.loaded:  # its first use since it came back from disk
            entry.value.loaded = False
            self._disk_tokens += n
        else:
            self._memory_tokens += n
        return Start(cache, n, entry, pace)

    @staticmethod
    def ahead_of(prompt: Sequence[int], entry: Entry, most: int) -> tuple[int, ...]:
        """Up to `most` tokens `entry`'s sequence had after `prompt`, where it
        began with all of it (the same prompt again): what that sequence said
        next. Empty where it did not."""
        if entry.length <= len(prompt):  # (a conversation's earlier turn: nothing after)
            return ()
        key = TokenTree.tokens(entry)
        if key[: len(prompt)] != tuple(prompt):
            return ()
        return key[len(prompt) : len(prompt) + most]

    def keep(
        self, tokens: Sequence[int], cache: list[LayerCache], pace: Pace | None = None
    ) -> None:
        """A sequence ended (or was aborted) holding the keys and values of
        `tokens` (`pace`: its turn, as `start_from` gave it). Its arrays are
        out of any batch and sent to the device already (`ended_rows.copied_out`):
        lazy slices of a batch would keep its arrays alive, and the next step
        would copy those whole to update them."""
        self.keep_all([(tokens, cache, pace)])

    def keep_all(self, ended: Sequence[Ended]) -> list[Entry | None]:
        """`keep` for each of several sequences (tokens, cache, pace), in
        order; the entry of each (None: a longer entry serves all it would)."""
        kept = []
        for tokens, cache, pace in ended:
            entry, removed = self.memory.insert(tokens, cache, pace=pace)
            kept.append(entry)
            if self.disk is not None:
                self.disk.superseded(removed)
                if entry is not None:
                    self.disk.offer(entry)
        return kept

    def carry(self, entry: Entry, delta: int) -> None:
        """See `MemoryTier.carry`."""
        self.memory.carry(entry, delta)

    @property
    def nbytes(self) -> int:
        """Memory the cache holds: its entries, and spilled ones until written."""
        pending = self.disk.pending_bytes if self.disk is not None else 0
        return self.memory.nbytes + pending

    def over(
        self, limit: int, keep: Collection[int] = (), wanted: Collection[int] = (),
        besides: int = 0,
    ) -> tuple[list[int], int]:  # fmt: skip
        """The memory entries to drop to hold at most `limit` bytes (but those
        in `keep`; those `wanted` last; `besides`: see MemoryTier.over), and
        the entries' bytes held then."""
        ids = self.memory.over(limit, keep, wanted, besides)
        return ids, self.nbytes - sum(e.nbytes for e in self.memory.entries(ids))

    def drop(self, ids: Sequence[int]) -> None:
        """Drop these memory entries for room; the disk tier keeps those worth it."""
        gone = self.memory.drop(ids)
        if self.disk is not None:
            self.disk.spill(gone)

    def tick(self, busy: bool) -> bool:
        """A turn of the engine loop (`busy`: with requests running): the disk
        tier's work (see `DiskTier.tick`)."""
        return self.disk is not None and self.disk.tick(self.memory, busy)

    def due(self) -> float | None:
        """Seconds until the disk tier has work again (None: none waits)."""
        return self.disk.due() if self.disk is not None else None

    @property
    def busy(self) -> bool:
        """Work for the engine thread besides steps (copying entries read back)."""
        return self.disk is not None and self.disk.busy

    def stats(self) -> CacheStats:
        # vars(), not asdict(): asdict deep-copies, and this runs every turn
        disk = vars(self.disk.stats) if self.disk is not None else {}
        return CacheStats(
            memory_bytes=self.memory.nbytes,
            memory_entries=len(self.memory),
            memory_tokens=self._memory_tokens,
            disk_tokens=self._disk_tokens,
            memory_evicted=self.memory.evicted,
            **disk,
        )

    def reset_counts(self) -> None:
        """Start counting anew (after the warm-up)."""
        self._memory_tokens = self._disk_tokens = 0
        self.memory.begin()

    def close(self, flush_until: Callable[[], float] | None) -> None:
        """Write what is worth keeping to disk (until `flush_until()`), then
        release every entry (the trees hold cycles: freed now, not at a
        collection)."""
        if self.disk is not None:
            self.disk.close(self.memory, flush_until)
        self.memory.clear()
