"""mlx-lm's BatchGenerators behind the engine's own bookkeeping (runs on the engine thread).

The model, the stream and every array are created here, on the engine thread,
so no MLX state ever crosses threads. What the engine knows of the batch
(which request holds which slot, which have started) it counts itself, from
what BatchGenerator returns, rather than from BatchGenerator's internals.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from smg_mlx.config import EngineConfig
from smg_mlx.engine import (
    batch_check,
    batch_kv,  # noqa: F401 - installs itself
    batch_mode,
    buffer_cache,
    loading,
    memory_probe,
)
from smg_mlx.engine.attention_shapes import AttentionShapes
from smg_mlx.engine.memory import Cost, MemoryPlanner
from smg_mlx.engine.memory_tier import Pace
from smg_mlx.engine.prefix_cache import PrefixCache, Start
from smg_mlx.engine.sampling import SamplerCache, StopTokens
from smg_mlx.engine.scheduler import Running
from smg_mlx.engine.step_clock import StepClock
from smg_mlx.engine.step_plan import LONG, SHORT, Passes
from smg_mlx.engine.token_tree import Entry
from smg_mlx.engine.types import Event, GenerationSpec, Request, TokenLogprobs
from smg_mlx.model_config import DEFAULT_CONTEXT_LENGTH, named_context_length

log = logging.getLogger(__name__)

# The largest prefill chunk by default: mlx-lm's, and on CUDA twice that.
CHUNK, CUDA_CHUNK = 2048, 4096


@dataclass(slots=True)
class _Slot:
    """One request's place in the batch."""

    request: Request
    lane: int
    inserted: GenerationSpec  # what BatchGenerator runs (after an error: the rest of it)
    options: tuple  # its sampler, logits processors and stop sequences
    cached: int  # prompt tokens reused from the prefix cache (as its client is told)
    start: int  # tokens in its cache when it was inserted
    carries: Entry | None  # the prefix-cache entry whose whole key its row holds
    pace: Pace | None  # its conversation's turn (`prefix_cache.Start`)
    processed: int = 0  # prompt tokens prefilled since
    started: bool = False  # BatchGenerator has begun its prefill
    prefilling: bool = True  # its prompt is not all processed yet
    fresh: bool = True  # no token yet
    # Its first token went out in the pass that sampled it; mlx-lm returns
    # it a pass later, to be passed over then.
    ahead: bool = False
    generated: list[int] = field(default_factory=list)

    @property
    def key(self) -> int:
        return self.request.key

    @property
    def context(self) -> int:
        """Tokens in its cache."""
        return self.start + self.processed

    @property
    def decoded(self) -> int:
        """Tokens generated since it was inserted (after an error, its prompt
        holds those generated before)."""
        return len(self.generated) - len(self.inserted.prompt) + len(self.request.spec.prompt)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill, the last one aside."""
        return len(self.inserted.prompt) - 1 - self.context if self.prefilling else 0

    def ends_with(self, token: int) -> bool:
        """Whether `token`, sent next, ends the request: its last, or a stop token."""
        _, _, stop = self.options
        return len(self.generated) + 1 >= self.request.spec.max_tokens or stop.advance(token)


class _Sampled(NamedTuple):
    """A token mlx-lm has sampled but not returned yet (see `Batch._first_tokens`)."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: None = None


class Batch:
    """The model and its lanes' BatchGenerators; each request is a slot keyed
    by its lane and uid."""

    def __init__(self, config: EngineConfig, group: mx.distributed.Group | None = None) -> None:
        started = time.perf_counter()
        self._config = config
        # How many prompts prefill together and sequences run together: as
        # configured, unless the model needs less (see `serve_as`).
        self.prefill_rows = config.prefill_batch_size
        self.batch_size = config.completion_batch_size
        self.model = loading.load_for(config, group)
        # Where each new attention shape costs a build (mlx's CUDA backend),
        # prefills run in few shapes, from the first pass on.
        builds = self.shape_builds
        # The most prompt tokens a prompt prefills in one pass. Where every
        # pass costs a fixed time besides its tokens' (CUDA), larger chunks
        # take fewer passes to prefill a turn of a long conversation.
        self.max_chunk = config.prefill_step_size or (CUDA_CHUNK if builds else CHUNK)
        self.attention = AttentionShapes(self.max_chunk) if builds else None
        if self.attention is not None:
            self.attention.install()
        # There, too, mlx-lm's passes keep MLX's buffer cache (`engine.buffer_cache`).
        self._buffers = buffer_cache.kept if builds else nullcontext
        self._cache_limit: int | None = None  # MLX's, before bound_buffer_cache set one
        # A stream made on this thread: mlx-lm's module-level one belongs to
        # whichever thread imported mlx-lm first.
        self._stream = mx.new_stream(mx.default_device())
        # Before anything else runs a batch of it: a model may not run one
        # (refused: types.Unservable), or not exactly.
        self.choice = batch_mode.decide(
            config, self.model, self._stream, self.prefill_rows, self.batch_size,
            split=group is not None,
        )  # fmt: skip
        self._lanes = ()
        self.serve_as(self.choice.mode)
        self._samplers = SamplerCache()
        # (lane, BatchGenerator uid) -> slot, in admission order
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._uids: dict[int, tuple[int, int]] = {}  # request key -> (lane, uid)
        self._started = 0  # slots BatchGenerator is prefilling or decoding
        self._resuming: dict[int, _Slot] = {}  # key -> slot of a request put back (see reset)
        # 0 turns the prefix cache off; None bounds it by the memory budget alone.
        self.prefixes = (
            PrefixCache(config.prompt_cache_bytes) if config.prompt_cache_bytes != 0 else None
        )
        # The probe's prompts are short: padded to a key bucket, their
        # attention would pass for what much longer prompts cost.
        with self.attention.bypassed() if self.attention is not None else nullcontext():
            self.memory, self.speed = memory_probe.measure(
                self.model, self._stream, self.max_chunk, group,
                self.attention.working_set if self.attention is not None else None,
            )  # fmt: skip
        # The longest a step should take at the probe's context: a full chunk.
        self.slowest_step = StepClock(self.speed).seconds(
            self.max_chunk, memory_probe.PROBE_CONTEXT
        )
        mx.reset_peak_memory()
        log.info(
            "model %s loaded and measured in %.2fs on %s",
            config.model_path,
            time.perf_counter() - started,
            mx.default_device(),
        )

    def _new_lanes(self) -> tuple[BatchGenerator, ...]:
        """A BatchGenerator for each lane, indexed by SHORT and LONG."""
        return tuple(
            BatchGenerator(
                self.model,
                completion_batch_size=self.batch_size,
                prefill_batch_size=self.prefill_rows,
                prefill_step_size=self.max_chunk,
                stream=self._stream,
            )
            for _ in (SHORT, LONG)
        )

    def serve_as(self, mode: batch_check.Mode) -> None:
        """Serve in `mode` from now on (the batch must be empty)."""
        self.mode = mode
        if mode is batch_check.Mode.ONE_AT_A_TIME:
            self.prefill_rows = self.batch_size = 1
        for lane in self._lanes:
            lane.close()
        self._lanes = self._new_lanes()

    @property
    def size(self) -> int:
        """Requests admitted to the batch."""
        return len(self._slots)

    @property
    def running(self) -> int:
        """Requests being prefilled or decoded; BatchGenerator queues the rest."""
        return self._started

    def _prefilling(self) -> Iterator[_Slot]:
        """The slots whose prompt BatchGenerator has begun and not finished."""
        return (slot for slot in self._slots.values() if slot.started and slot.prefilling)

    @property
    def prefilling(self) -> int:
        """Requests whose prompt is not all processed."""
        return sum(1 for _ in self._prefilling())

    def prefills(self) -> list[tuple[str, int, int]]:
        """(request id, tokens in its cache, prompt tokens) of each prompt prefilling."""
        return [
            (slot.request.request_id, slot.context, len(slot.inserted.prompt))
            for slot in self._prefilling()
        ]

    @property
    def waiting(self) -> int:
        """Requests admitted that BatchGenerator has not started yet."""
        return len(self._slots) - self._started

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefixes.nbytes if self.prefixes is not None else 0

    @property
    def active_memory(self) -> int:
        return mx.get_active_memory()

    @property
    def peak_memory(self) -> int:
        return mx.get_peak_memory()

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes the batch holds now."""
        return sum(lane.prompt_cache_nbytes for lane in self._lanes)

    @property
    def shape_builds(self) -> bool:
        """Whether each new attention shape costs a kernel build (mlx's CUDA backend)."""
        return mx.default_device() == mx.gpu and not mx.metal.is_available()

    def prebuild_attention(self) -> None:
        """Build the attention shapes prompts will meet, up to the model's context
        (see `engine.attention_shapes`); nothing where shapes cost no build."""
        if self.attention is None:
            return
        # The context served (api.model_info): no prompt is longer.
        context = named_context_length(self._config.model_path) or DEFAULT_CONTEXT_LENGTH
        self.attention.prebuild(context, self.prefill_rows)

    def bound_buffer_cache(self, planner: MemoryPlanner) -> None:
        """Where mlx-lm's passes keep MLX's buffer cache (`engine.buffer_cache`),
        it holds at most the working set the budget counts for one full
        prefill chunk at short context: what a pass frees for the next one,
        while the batch and the prefix cache fill the budget. (Larger, the
        allocator would free cached buffers before most allocations there.)"""
        if self._buffers is buffer_cache.kept:
            chunk = planner.max_chunk
            working_set = planner.prefill_bytes([Cost(chunk, chunk, chunk)], chunk)
            self._cache_limit = mx.set_cache_limit(int(working_set))

    @property
    def stream(self) -> mx.Stream:
        return self._stream

    def holds(self, key: int) -> bool:
        return key in self._uids

    def sequences(self, excluding: Iterable[int] = ()) -> list[Running]:
        """The admitted sequences (but those with the keys `excluding`), as the
        scheduler sees them."""
        leaving = set(excluding)
        # A request put back after an error prefills what it had generated too.
        return [
            Running(
                Cost(
                    len(slot.inserted.prompt),
                    len(slot.request.spec.prompt) + slot.request.spec.max_tokens,
                    slot.remaining + 1 if slot.prefilling else 0,
                    slot.lane == LONG,
                    slot.decoded,
                ),
                slot.remaining,
                slot.context,
                slot.key,
            )
            for slot in self._slots.values()
            if slot.key not in leaving
        ]

    def cached_over(self, limit: int, keep: Collection[int] = ()) -> tuple[list[int], int]:
        """The prompt-cache entries to drop to hold at most `limit` bytes (but
        those in `keep`), and the bytes it holds then."""
        if self.prefixes is None:
            return [], 0
        return self.prefixes.over(limit, keep)

    def drop_cached(self, ids: Iterable[int]) -> None:
        if self.prefixes is not None:
            self.prefixes.drop(list(ids))

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

    def _options(self, request: Request) -> tuple:
        spec = request.spec
        return (
            self._samplers.sampler(spec.sampling),
            self._samplers.processors(spec.logits),
            StopTokens(spec.stop_token_ids),
        )

    def admit(self, requests: list[Request], long: Collection[int] = ()) -> list[Event]:
        """Insert new requests (those with the keys `long` in the long prompts'
        lane), each from its longest cached prefix; they start prefill at the
        next step. A request whose sampling setup fails ends with an error
        event instead of reaching the batch."""
        accepted, failed = [], []
        for request in requests:
            resumed = self._resuming.pop(request.key, None)
            try:
                options = resumed.options if resumed else self._options(request)
            except Exception as exc:  # noqa: BLE001 - one request's fault, not the engine's
                log.exception("request %r cannot start", request.request_id)
                failed.append(Event(request.key, error=f"the request could not start: {exc!r}"))
                continue
            accepted.append((request, options, resumed))
        for lane in (SHORT, LONG):
            self._insert(lane, [a for a in accepted if (a[0].key in long) == (lane == LONG)])
        return failed

    def _insert(self, lane: int, accepted: list[tuple[Request, tuple, _Slot | None]]) -> None:
        if not accepted:
            return
        prompts = [request.spec.prompt for request, _, _ in accepted]
        starts = [self._start_from(prompt) for prompt in prompts]
        samplers, processors, stops = zip(*(options for _, options, _ in accepted), strict=True)
        uids = self._lanes[lane].insert(
            [list(p[s.tokens :]) for p, s in zip(prompts, starts, strict=True)],
            max_tokens=[request.spec.max_tokens for request, _, _ in accepted],
            caches=[s.cache for s in starts],
            # The tokens already in each cache (a new list: mlx-lm appends to it).
            all_tokens=[list(p[: s.tokens]) for p, s in zip(prompts, starts, strict=True)],
            samplers=list(samplers),
            logits_processors=list(processors),
            stop_sequences=list(stops),
        )
        for uid, (request, options, resumed), start in zip(uids, accepted, starts, strict=True):
            cached, entry = start.tokens, start.entry
            # Its row will hold all of the entry: the entry can go first if memory runs short.
            carries = entry if entry is not None and cached == entry.length else None
            if carries is not None:
                self.prefixes.carry(carries, 1)
            slot = _Slot(request, lane, request.spec, options, cached, cached, carries, start.pace)
            if resumed is not None:  # as the client knows it: tokens sent, cache reuse
                slot.request, slot.cached, slot.pace = resumed.request, resumed.cached, resumed.pace
                slot.fresh, slot.generated = resumed.fresh, resumed.generated
            self._slots[lane, uid] = slot
            self._uids[request.key] = (lane, uid)

    def _forget(self, place: tuple[int, int]) -> _Slot:
        slot = self._slots.pop(place)
        del self._uids[slot.key]
        self._started -= slot.started
        if slot.carries is not None:
            self.prefixes.carry(slot.carries, -1)
            slot.carries = None
        return slot

    def remove(self, keys: Iterable[int]) -> list[Event]:
        """Drop the requests with these keys (unknown keys are ignored); an abort
        event for each one dropped."""
        places = [self._uids[k] for k in keys if k in self._uids]
        events = []
        for lane, generator in enumerate(self._lanes):
            uids = [uid for on, uid in places if on == lane]
            if not uids:
                continue
            kept = generator.remove(uids, return_prompt_caches=self.prefixes is not None)
            for uid in uids:
                slot = self._forget((lane, uid))
                cache, tokens = kept.get(uid) or (None, ())
                # What an aborted sequence computed is as good as a finished one's.
                if self.prefixes is not None and cache is not None and len(tokens) > slot.cached:
                    self.prefixes.keep(tokens, cache, slot.pace)
                events.append(Event(slot.key, finish_reason="abort"))
        return events

    def move(self, keys: Iterable[int]) -> list[Event]:
        """Move these decoding requests to the long prompts' lane, each row
        with its cache as it is: put in again there, with the token mlx-lm
        has sampled for it still to process, which goes out now (unless it
        went out early). A request that token ends stays where it is."""
        events = []
        for key in keys:
            lane, uid = self._uids[key]
            slot = self._slots[lane, uid]
            (pending,) = self._pending(lane, [uid])
            token = pending.token
            if not slot.ahead:  # (one that went out early could not end its request)
                if slot.ends_with(token):
                    continue
                events += self._tokens(lane, [pending])
            cache, tokens = self._lanes[lane].remove([uid], return_prompt_caches=True)[uid]
            del self._slots[lane, uid]
            sampler, processors, stop = slot.options
            left = slot.request.spec.max_tokens - len(slot.generated)
            (moved,) = self._lanes[LONG].insert(
                [[token]],
                max_tokens=[left],
                caches=[cache],
                all_tokens=[list(tokens)],
                samplers=[sampler],
                logits_processors=[processors],
                stop_sequences=[stop],
            )
            slot.lane, slot.start, slot.processed = LONG, len(tokens), 0
            slot.prefilling, slot.ahead = True, False
            slot.inserted = replace(slot.inserted, prompt=(*tokens, token), max_tokens=left)
            self._slots[LONG, moved] = slot
            self._uids[key] = (LONG, moved)
            log.info(
                "request %r: its %d tokens move to the long prompts' lane, away from the "
                "short ones", slot.request.request_id, len(slot.inserted.prompt),
            )  # fmt: skip
        return events

    def step(
        self,
        chunk: int,
        long_chunks: tuple[int, ...] = (),
        early: Callable[[list[Event]], None] | None = None,
    ) -> tuple[list[Event], Passes]:
        """Advance the batch by one step: each sequence's new token, and what
        each pass over the model took. The short lane prefills in chunks of
        at most `chunk` tokens, the long lane runs once for each of
        `long_chunks` (once at `chunk` if none). Where the long lane runs
        after the short one, `early` gets the short lane's events first (the
        list returned begins with them): a chat's first token and a stream's
        next one need not wait for a long prompt's chunks."""
        held = {lane for lane, _ in self._slots}
        both = len(held) == 2
        events, short, long = [], None, []
        if SHORT in held:
            started = time.perf_counter()
            events = self._next(SHORT, chunk, early=LONG in held)
            if both:  # its decoding, left running, is timed as its own
                mx.synchronize(self._stream)
            short = time.perf_counter() - started
            if events and both and early is not None:
                early(list(events))
        if LONG in held:
            for size in long_chunks or (chunk,):
                started = time.perf_counter()
                events += self._next(LONG, size, early=True)
                long.append(time.perf_counter() - started)
            if both:
                started = time.perf_counter()
                mx.synchronize(self._stream)
                long[-1] += time.perf_counter() - started
        if self.attention is not None:
            self.attention.forget()
        return events, Passes(short, tuple(long))

    def _next(self, lane: int, chunk: int, early: bool) -> list[Event]:
        """One call of a lane's BatchGenerator, prefilling at most `chunk` tokens a
        row; `early`: the first tokens of rows it moves into decoding go out now
        (`_first_tokens`), else with its next call, as mlx-lm hands them over."""
        generator = self._lanes[lane]
        generator.prefill_step_size = chunk
        with self._buffers():
            prefilling, responses = generator.next()
        decoding = []  # the rows that moved into the decoding rows in this pass
        for r in prefilling:
            slot = self._slots.get((lane, r.uid))
            if slot is not None:
                self._started += not slot.started
                slot.started = True
                slot.prefilling = not r.end_of_prompt
                slot.processed = r.progress[0]
                if r.end_of_prompt:
                    decoding.append(r.uid)
        sampled = []
        for r in responses:
            slot = self._slots[lane, r.uid]
            if slot.ahead:  # went out a pass ago (a token that could not end its request)
                slot.ahead = False
            else:
                sampled.append(r)
        events = self._tokens(lane, sampled)
        for r in responses:
            if r.finish_reason is not None:
                slot = self._forget((lane, r.uid))
                if self.prefixes is not None:
                    # The cache holds every token of `all_tokens`, the last
                    # generated one included.
                    self.prefixes.keep(r.all_tokens, r.prompt_cache, slot.pace)
        return events + (self._first_tokens(lane, decoding) if early else [])

    def _tokens(self, lane: int, sampled: list) -> list[Event]:
        """The events of the tokens mlx-lm sampled for the lane's rows."""
        events = []
        for r, chosen in zip(sampled, self._logprobs(lane, sampled), strict=True):
            slot = self._slots[lane, r.uid]
            slot.generated.append(r.token)
            events.append(
                Event(
                    slot.key,
                    token=r.token,
                    finish_reason=r.finish_reason,
                    logprobs=chosen,
                    cached_tokens=slot.cached,
                    first=slot.fresh,
                )
            )
            slot.fresh = False
        return events

    def _first_tokens(self, lane: int, uids: list[int]) -> list[Event]:
        """The first tokens of the rows with `uids`, which moved into the
        lane's decoding rows in this pass: mlx-lm samples each there but
        returns it only after the next pass (it starts that pass before it
        waits for this one's tokens), which would hold a chat's first token
        back behind a whole step of long prompts' chunks. Reading them waits
        for the pass: the device then idles while the next one is prepared,
        which a step of short prompts alone (its next pass as short) does not
        pay for. A token that ends its request is left to mlx-lm, which ends
        it then."""
        if not uids:
            return []
        sampled = []
        for pending in self._pending(lane, uids):
            slot = self._slots[lane, pending.uid]
            if not slot.ends_with(pending.token):
                slot.ahead = True
                sampled.append(pending)
        return self._tokens(lane, sampled)

    def _pending(self, lane: int, uids: list[int]) -> list[_Sampled]:
        """The tokens mlx-lm has sampled for these decoding rows of the lane
        and not returned yet (its own state: read here alone)."""
        rows = self._lanes[lane]._generation_batch  # mlx-lm's decoding rows
        tokens = rows._next_tokens.tolist()
        where = {uid: i for i, uid in enumerate(rows.uids)}
        return [_Sampled(uid, tokens[where[uid]], rows._next_logprobs[where[uid]]) for uid in uids]

    def reset(self) -> list[Request]:
        """After a step failed (out of memory), start over with an empty batch:
        what the failed step left behind cannot be trusted. Returns the requests
        that were in the batch, in admission order, each to continue from where
        its client is: its prompt extended by the tokens sent, fewer to go."""
        for lane in self._lanes:
            lane.close()
        self._lanes = ()
        mx.clear_cache()
        self._lanes = self._new_lanes()
        requests = []
        for place in list(self._slots):
            slot = self._slots[place]
            self._forget(place)
            spec = slot.request.spec
            self._resuming[slot.key] = slot
            requests.append(
                replace(
                    slot.request,
                    spec=replace(
                        spec,
                        prompt=spec.prompt + tuple(slot.generated),
                        max_tokens=spec.max_tokens - len(slot.generated),
                    ),
                )
            )
        return requests

    def forget_resumed(self, keys: Iterable[int]) -> None:
        """Requests put back by `reset` that ended before being admitted again."""
        for key in keys:
            self._resuming.pop(key, None)

    def _logprobs(self, lane: int, responses: list) -> list[TokenLogprobs | None]:
        """Each response's logprobs, if its request asked for them."""
        found: list[TokenLogprobs | None] = [None] * len(responses)
        rows, lazy = [], []
        # Build every row's top-n lazily, then evaluate them all at once.
        for i, r in enumerate(responses):
            n = self._slots[lane, r.uid].request.spec.logprobs
            if n is None:
                continue
            top = mx.array([], dtype=mx.uint32)
            if n:
                top = mx.argpartition(-r.logprobs, kth=n - 1)[:n]
                top = top[mx.argsort(-r.logprobs[top])]
            rows.append(i)
            lazy.append((r.logprobs[r.token], top, r.logprobs[top]))
        if lazy:
            mx.eval(lazy)
        for i, (chosen, top, values) in zip(rows, lazy, strict=True):
            found[i] = TokenLogprobs(chosen.item(), tuple(top.tolist()), tuple(values.tolist()))
        return found

    def close(self, flush_until: Callable[[], float] | None = None) -> None:
        """Release the lanes' generators, the prefix cache (first writing to
        disk what is worth keeping, until `flush_until()`; None: nothing) and
        the model on this thread (see `EngineCore.run`)."""
        for lane in self._lanes:
            lane.close()
        self._lanes = ()
        if self.prefixes is not None:
            self.prefixes.close(flush_until)
        self.prefixes = None
        if self.attention is not None:
            self.attention.uninstall()
        if self._cache_limit is not None:
            mx.set_cache_limit(self._cache_limit)
        self.model = None
