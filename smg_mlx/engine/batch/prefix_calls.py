"""The batch's calls on its prompt cache, which may be off (engine thread).

Kept apart from `Batch` so that it reads as the lanes and their rows: here
alone is asked whether there is a cache at all.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from smg_mlx.engine.prefix_cache.cache import Ended, PrefixCache, Start
from smg_mlx.engine.prefix_cache.memory_tier import LayerCache, Pace


class PrefixCalls:
    """What `Batch` asks of its prompt cache, `prefixes` (None: off)."""

    prefixes: PrefixCache | None
    # What sequences that ended in the last step leave (tokens, cache, pace),
    # kept once that step's report is out (`keep_ended`).
    _ended: list[Ended]

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefixes.nbytes if self.prefixes is not None else 0

    def cached_over(
        self, limit: int, keep: Collection[int] = (), wanted: Collection[int] = ()
    ) -> tuple[list[int], int]:
        """The prompt-cache entries to drop to hold at most `limit` bytes (but
        those in `keep`; those `wanted` by waiting requests last), and the
        bytes it holds then."""
        if self.prefixes is None:
            return [], 0
        return self.prefixes.over(limit, keep, wanted)

    def drop_cached(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if ids and self.prefixes is not None:  # most turns drop none
            self.prefixes.drop(ids)

    def tend_prefixes(self) -> bool:
        """The prefix cache's work between steps (its disk tier); whether it
        changed anything."""
        return self.prefixes is not None and self.prefixes.tick()

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

    def _keep(self, tokens: Sequence[int], cache: list[LayerCache], pace: Pace | None) -> None:
        """What a sequence leaves, for prompts that share its prefix (see
        `PrefixCache.keep`); nothing without a cache."""
        if self.prefixes is not None:
            self.prefixes.keep(tokens, cache, pace)

    def _keep_later(
        self, tokens: Sequence[int], cache: list[LayerCache], pace: Pace | None
    ) -> None:
        """`_keep`, at the next `keep_ended`."""
        if self.prefixes is not None:
            self._ended.append((tokens, cache, pace))

    def keep_ended(self) -> bool:
        """Keep what the sequences that ended in the last step leave (whether
        there was any: the cache changed after the step's report). Called
        once the step's events are out: copying each row's keys and values out
        of the batch takes the engine thread about a millisecond a row on a
        GPU (56 copies at 28 layers), and a wave of requests ending together
        would hold their last tokens back, and so their clients' next
        requests, that long. Before the next step: its update of the batch's
        arrays would copy them whole while these still read them."""
        ended, self._ended = self._ended, []
        if ended and self.prefixes is not None:
            self.prefixes.keep_all(ended)
        return bool(ended)
