"""The MLX side of the engine: model, BatchGenerator and one step at a time.

Everything here runs on the engine thread (see `engine`), which creates the
model, the stream and every array, so no MLX state ever crosses threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, StopSequences

from smg_mlx.config import EngineConfig
from smg_mlx.engine import Event, Job, TokenLogprobs
from smg_mlx.prefix_cache import PrefixCache
from smg_mlx.sampling import SamplerCache

log = logging.getLogger(__name__)

# Shorter cached prefixes are not reused. Random prompts share their first
# token or two with some cached entry all the time (a quarter of the bench's
# requests did); reusing that saves nothing worth having, and every odd
# prefill length is one more shape to prepare kernels for (on the H100 some
# new prefill lengths cost 1.0 to 1.4 s the first time they were seen).
MIN_REUSED_TOKENS = 16


class BatchLoop:
    """mlx-lm's BatchGenerator plus the bookkeeping from its uids to our jobs."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        path = config.model_path
        self.model, self.tokenizer = load(str(path))
        # A stream made on this thread: mlx-lm's module-level one belongs to
        # whichever thread imported mlx-lm first.
        self._stream = mx.new_stream(mx.default_device())
        self._generator = BatchGenerator(
            self.model,
            completion_batch_size=config.completion_batch_size,
            prefill_batch_size=config.prefill_batch_size,
            prefill_step_size=config.prefill_step_size,
            stream=self._stream,
        )
        self._samplers = SamplerCache()
        self._stops: dict[frozenset[int], StopSequences] = {}
        self._jobs: dict[int, Job] = {}  # BatchGenerator uid -> job
        self._uids: dict[int, int] = {}  # job key -> uid
        self._cached: dict[int, int] = {}  # uid -> prompt tokens reused from the cache
        self._fresh: set[int] = set()  # uids that have not made a token yet
        self._prefixes = (
            PrefixCache(config.prompt_cache_bytes) if config.prompt_cache_bytes else None
        )
        self._warm_up()
        log.info(
            "model %s loaded and warmed up in %.2fs on %s",
            path,
            time.perf_counter() - started,
            mx.default_device(),
        )

    def _warm_up(self) -> None:
        """One short generation, so the first request pays no first-step costs."""
        uid = self._generator.insert([[0, 1, 2, 3]], max_tokens=[2])[0]
        while True:
            _, done = self._generator.next()
            if any(r.uid == uid and r.finish_reason for r in done):
                return

    @property
    def has_work(self) -> bool:
        return bool(self._jobs)

    @property
    def prefix_cache_bytes(self) -> int:
        return self._prefixes.nbytes if self._prefixes is not None else 0

    @property
    def running(self) -> int:
        """Sequences being prefilled or decoded; BatchGenerator queues the rest."""
        g = self._generator
        return len(g._prompt_batch) + len(g._generation_batch)

    @property
    def generator_sequences(self) -> int:
        """Sequences BatchGenerator itself holds (queued, prefilling, decoding)."""
        return len(self._generator._unprocessed_sequences) + self.running

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    def _stop_sequences(self, ids: frozenset[int]) -> StopSequences:
        if ids not in self._stops:
            self._stops[ids] = StopSequences([[t] for t in sorted(ids)])
        return self._stops[ids]

    def _start(self, prompt: tuple[int, ...]) -> tuple[list | None, int]:
        """The cache to start `prompt` from (None: a fresh one) and the tokens it holds."""
        if self._prefixes is None:
            return None, 0
        cache, cached = self._prefixes.lookup(prompt, MIN_REUSED_TOKENS)
        if cached:
            log.debug("prefix cache hit: %d of %d prompt tokens", cached, len(prompt))
        return cache, cached

    def admit(self, jobs: list[Job]) -> list[Event]:
        """Insert new jobs, each from its longest cached prefix; they start prefill
        at the next step. A job whose sampling setup fails ends with an error event
        instead of reaching the batch."""
        accepted, options, failed = [], [], []
        for job in jobs:
            spec = job.spec
            try:
                options.append(
                    (
                        self._samplers.sampler(spec.sampling),
                        self._samplers.processors(spec.logits),
                        self._stop_sequences(spec.stop_token_ids),
                    )
                )
            except Exception as exc:  # noqa: BLE001 - one request's fault, not the engine's
                log.exception("request %s cannot start", job.request_id)
                failed.append(Event(job, error=f"the request could not start: {exc!r}"))
                continue
            accepted.append(job)
        if not accepted:
            return failed
        prompts = [job.spec.prompt for job in accepted]
        starts = [self._start(prompt) for prompt in prompts]
        samplers, processors, stops = zip(*options, strict=True)
        uids = self._generator.insert(
            [list(p[n:]) for p, (_, n) in zip(prompts, starts, strict=True)],
            max_tokens=[job.spec.max_tokens for job in accepted],
            caches=[cache for cache, _ in starts],
            # The tokens already in each cache (a new list: mlx-lm appends to it).
            all_tokens=[list(p[:n]) for p, (_, n) in zip(prompts, starts, strict=True)],
            samplers=list(samplers),
            logits_processors=list(processors),
            stop_sequences=list(stops),
        )
        for uid, job, (_, cached) in zip(uids, accepted, starts, strict=True):
            self._jobs[uid] = job
            self._uids[job.key] = uid
            self._cached[uid] = cached
            self._fresh.add(uid)
        return failed

    def remove(self, keys: Iterable[int]) -> list[Job]:
        """Drop the jobs with these keys from the batch; unknown keys are ignored."""
        uids = [self._uids.pop(k) for k in keys if k in self._uids]
        if uids:
            # What an aborted sequence computed is as good as a finished one's.
            kept = self._generator.remove(uids, return_prompt_caches=self._prefixes is not None)
            for uid, (cache, tokens) in kept.items():
                if len(tokens) > self._cached[uid]:  # else nothing new was computed
                    self._prefixes.insert(tokens, cache)
        for uid in uids:
            del self._cached[uid]
            self._fresh.discard(uid)
        return [self._jobs.pop(uid) for uid in uids]

    def step(self) -> list[Event]:
        """Advance the batch by one step and report each sequence's new token."""
        _, responses = self._generator.next()
        events = []
        wanted = []  # (event, logprobs row, n) for requests that asked for logprobs
        for r in responses:
            job = self._jobs[r.uid]
            event = Event(
                job,
                token=r.token,
                finish_reason=r.finish_reason,
                cached_tokens=self._cached[r.uid],
                first=r.uid in self._fresh,
            )
            self._fresh.discard(r.uid)
            if job.spec.logprobs is not None:
                wanted.append((event, r.logprobs, job.spec.logprobs))
            if r.finish_reason is not None:
                del self._jobs[r.uid]
                del self._uids[job.key]
                del self._cached[r.uid]
                if self._prefixes is not None:
                    # The cache holds every token of `all_tokens`, the last
                    # generated one included.
                    self._prefixes.insert(r.all_tokens, r.prompt_cache)
            events.append(event)
        if wanted:
            self._attach_logprobs(wanted)
        return events

    @staticmethod
    def _attach_logprobs(wanted: list[tuple[Event, mx.array, int]]) -> None:
        # Build every row's top-n lazily, then evaluate them all at once.
        lazy = []
        for event, row, n in wanted:
            top = mx.array([], dtype=mx.uint32)
            if n:
                top = mx.argpartition(-row, kth=n - 1)[:n]
                top = top[mx.argsort(-row[top])]
            lazy.append((row[event.token], top, row[top]))
        mx.eval(lazy)
        for (event, _, _), (chosen, top, values) in zip(wanted, lazy, strict=True):
            event.logprobs = TokenLogprobs(
                logprob=chosen.item(),
                top_ids=tuple(top.tolist()),
                top_values=tuple(values.tolist()),
            )

    def close(self) -> None:
        self._generator.close()
