"""The batch's calls on its prompt cache, which may be off (engine thread).

Kept apart from `Batch` so that it reads as the lanes and their rows: here
alone is asked whether there is a cache at all.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from smg_mlx.engine.batch.ended_rows import EndedRow, SharedBlocks, copied_out, one_row
from smg_mlx.engine.prefix_cache.cache import PrefixCache, Start
from smg_mlx.engine.prefix_cache.memory_tier import LayerCache, Pace

# A row's cache as the batch gives it when the row ends or leaves.
RowCache = list[LayerCache] | EndedRow


class PrefixCalls:
    """What `Batch` asks of its prompt cache, `prefixes` (None: off)."""

    prefixes: PrefixCache | None
    # What sequences that ended in the last step leave (tokens, cache, pace),
    # kept once that step's report is out (`keep_ended`).
    _ended: list[tuple[Sequence[int], RowCache, Pace | None]]
    _shared: SharedBlocks  # blocks of rows copied out together, and the memory they hold
    size: int  # requests admitted to the batch (`Batch.size`)

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefixes.nbytes + self._shared.waste if self.prefixes is not None else 0

    def cached_over(
        self, limit: int, keep: Collection[int] = (), wanted: Collection[int] = ()
    ) -> tuple[list[int], int]:
        """The prompt-cache entries to drop to hold at most `limit` bytes and
        --prompt-cache-bytes, the memory its entries' blocks hold beyond them
        counted (but those in `keep`; those `wanted` by waiting requests
        last), and the bytes it holds then."""
        if self.prefixes is None:
            return [], 0
        waste = self._shared.waste
        drop, held = self.prefixes.over(limit, keep, wanted, besides=waste)
        return drop, held + waste

    def drop_cached(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if ids and self.prefixes is not None:  # most turns drop none
            self.prefixes.drop(ids)

    def tend_prefixes(self) -> bool:
        """The prefix cache's work between steps (its disk tier); whether it
        changed anything."""
        return self.prefixes is not None and self.prefixes.tick(busy=self.size > 0)

    @property
    def prefixes_busy(self) -> bool:
        """Whether the prefix cache has work for the engine thread besides steps."""
        return self.prefixes is not None and self.prefixes.busy

    def prefixes_due(self) -> float | None:
        """Seconds until the prefix cache has work for the engine thread (None: none waits)."""
        return self.prefixes.due() if self.prefixes is not None else None

    def _start_from(self, prompt: tuple[int, ...]) -> Start:
        """See `PrefixCache.start_from` (a fresh cache without one)."""
        return self.prefixes.start_from(prompt) if self.prefixes is not None else Start()

    def _keep(self, tokens: Sequence[int], cache: RowCache, pace: Pace | None) -> None:
        """What a sequence leaves, for prompts that share its prefix (see
        `PrefixCache.keep`); nothing without a cache."""
        if self.prefixes is not None:
            self.prefixes.keep(tokens, one_row(cache), pace)

    def _keep_later(self, tokens: Sequence[int], cache: RowCache, pace: Pace | None) -> None:
        """`_keep`, at the next `keep_ended`."""
        if self.prefixes is not None:
            self._ended.append((tokens, cache, pace))

    def keep_ended(self) -> bool:
        """Keep what the sequences that ended in the last step leave, and what
        the blocks they are copied out in hold (`ended_rows`); whether the
        cache changed after the step's report. Called once the step's events
        are out, so that copying rows out of the batch holds no request's
        last token back. Before the next step: its update of the batch's
        arrays would copy them whole while these still read them."""
        ended, self._ended = self._ended, []
        if self.prefixes is None:
            return False
        if ended:
            caches, blocks = copied_out([cache for _, cache, _ in ended])
            entries = self.prefixes.keep_all(
                [(tokens, c, pace) for (tokens, _, pace), c in zip(ended, caches, strict=True)]
            )
            self._shared.add(list(zip(entries, caches, blocks, strict=True)))
        return self._shared.tend() or bool(ended)
