"""mlx-lm's BatchGenerators behind the engine's own bookkeeping (runs on the engine thread).

The model, the stream and every array are created here, on the engine thread,
so no MLX state ever crosses threads. What the engine knows of the batch
(which request holds which row, which have started) it counts itself, from
what BatchGenerator returns (`rows`), rather than from BatchGenerator's internals.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from contextlib import nullcontext
from dataclasses import replace

import mlx.core as mx

from smg_mlx.config import EngineConfig
from smg_mlx.engine.batch import (
    batch_check,
    batch_kv,  # noqa: F401 - installs itself
    batch_mode,
    few_rows_matmul,
    kv_format,
    loading,
    quantized_attention,
)
from smg_mlx.engine.batch.attention_shapes import AttentionShapes, shapes_build
from smg_mlx.engine.batch.ended_rows import SharedBlocks
from smg_mlx.engine.batch.lanes import Lanes, Sampled, logprobs
from smg_mlx.engine.batch.prefix_calls import PrefixCalls
from smg_mlx.engine.batch.rows import Row, Rows
from smg_mlx.engine.batch.sampling import SamplerCache, StopTokens
from smg_mlx.engine.memory import buffer_cache, probe_results
from smg_mlx.engine.memory import probe as memory_probe
from smg_mlx.engine.memory.planner import MemoryPlanner
from smg_mlx.engine.prefix_cache.cache import PrefixCache
from smg_mlx.engine.prefix_cache.token_tree import Entry
from smg_mlx.engine.schedule.scheduler import Running
from smg_mlx.engine.schedule.step_clock import StepClock
from smg_mlx.engine.schedule.step_plan import LONG, SHORT, Passes
from smg_mlx.engine.speculative.choice import draft_for, drafting_for
from smg_mlx.engine.speculative.draft_model import wider
from smg_mlx.engine.speculative.prompt_lookup import Ahead
from smg_mlx.engine.types import Event, GenerationSpec, Request, SpeculationStats
from smg_mlx.model_config import DEFAULT_CONTEXT_LENGTH, named_context_length

log = logging.getLogger(__name__)

# The largest prefill chunk by default: mlx-lm's, and on CUDA twice that.
CHUNK, CUDA_CHUNK = 2048, 4096


class Batch(PrefixCalls):
    """The model and its lanes' BatchGenerators; each request is a row keyed
    by its lane and uid (`Rows`)."""

    def __init__(self, config: EngineConfig, group: mx.distributed.Group | None = None) -> None:
        started = time.perf_counter()
        self._config = config
        # How many prompts prefill together and sequences run together: as
        # configured, unless the model needs less (see `serve_as`).
        self.prefill_rows = config.prefill_batch_size
        self.batch_size = config.completion_batch_size
        self.model = loading.load_for(config, group)
        # --kv-bits: rows' fresh caches, quantized (None: mlx-lm makes the model's own).
        self._fresh_caches = kv_format.caches_for(config, self.model)
        draft = draft_for(config, self.model, group)  # refused before the batch check, if so
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
        # Passes of a few rows (decoding, checking proposals) multiply in a kernel
        # of ours where it fits (CUDA): before the batch check, which runs them.
        models = [self.model, *([draft.model] if draft is not None else [])]
        taken = sum(few_rows_matmul.install(m) for m in models)
        if taken:
            log.info("few-row products: %d linear layers multiply passes of %d-%d rows in the "
                     "worker's CUDA kernel, faster than cuBLAS's there", taken,
                     few_rows_matmul.LEAST_ROWS, few_rows_matmul.most_rows(0))  # fmt: skip
        # The kinds of few-query passes over quantized caches run (warm-up).
        self._quantized_kinds: set[quantized_attention.Kind] = set()
        if self._fresh_caches is not None:
            quantized_attention.install(self.attention, self._quantized_kinds)
        # There, too, mlx-lm's passes keep MLX's buffer cache (`engine.memory.buffer_cache`).
        self._buffers = buffer_cache.kept if builds else nullcontext
        self._cache_limit: int | None = None  # MLX's, before bound_buffer_cache set one
        # A stream made on this thread: mlx-lm's module-level one belongs to
        # whichever thread imported mlx-lm first.
        self._stream = mx.new_stream(mx.default_device())
        # Before anything else runs a batch of it: a model may not run one
        # (refused: types.Unservable), or not exactly.
        self.choice = batch_mode.decide(
            config, self.model, self._stream, self.prefill_rows, self.batch_size,
            split=group is not None, caches=self._fresh_caches,
        )  # fmt: skip
        batched = self.choice.mode is not batch_check.Mode.EQUAL_LENGTHS
        drafting = drafting_for(config, self.model, group, batched, draft, one_width=builds)
        self._lanes = Lanes(self.model, self._stream, self.max_chunk, self._buffers, drafting)
        self.serve_as(self.choice.mode)
        self._samplers = SamplerCache()
        self._rows = Rows()
        self._ended = []
        # 0 turns the prefix cache off; None bounds it by the memory budget alone.
        self.prefixes = (
            PrefixCache(config.prompt_cache_bytes) if config.prompt_cache_bytes != 0 else None
        )
        self._shared = SharedBlocks(self.prefixes.memory if self.prefixes is not None else None)
        # The probe's prompts are short: padded to a key bucket, their attention would
        # pass for what much longer prompts cost.
        known = self._padded_attention()
        kept = None if group is not None else probe_results.remembered(
            config, self.max_chunk, known is not None
        )  # fmt: skip
        found = probe_results.recall(kept) if kept is not None else None
        if found is not None:
            self.memory, self.speed = found
        else:
            probed = time.perf_counter()
            with self.attention.bypassed() if self.attention is not None else nullcontext():
                self.memory, self.speed = memory_probe.measure(
                    self.model, self._stream, self.max_chunk, group,
                    known,
                    self._fresh_caches, self._dequantized(),
                )  # fmt: skip
            if kept is not None:
                probe_results.keep(kept, self.memory, self.speed, time.perf_counter() - probed)
        if config.kv_format is not None:
            kv_format.log_cost(config.kv_format, self.memory.kv_per_token, self.model, self._stream)
        if drafting is not None and drafting.draft is not None:
            self.memory = memory_probe.with_draft(
                self.memory, drafting.draft, self._stream, wider(drafting.draft, self.model),
                drafting.draft_caches,
            )  # fmt: skip
            drafting.catch_up.measured(self.memory)
        # The longest a step should take at the probe's context: a full chunk.
        self.slowest_step = StepClock(self.speed).seconds(
            self.max_chunk, memory_probe.PROBE_CONTEXT
        )
        mx.reset_peak_memory()
        log.info("model %s loaded and measured in %.2fs on %s", config.model_path,
                 time.perf_counter() - started, mx.default_device())  # fmt: skip

    def _padded_attention(self) -> Callable[[float], tuple[float, float] | None] | None:
        """What prefill attention holds, given the KV bytes per token, where it
        runs padded (`attention_shapes`; None: the probe measures it)."""
        if self.attention is None:
            return None
        layers = len(self.model.layers)
        if self._fresh_caches is None:
            return lambda own: self.attention.working_set(own, layers)
        # Quantized rows' prompts attend copies padded while quantized, then
        # dequantized (quantized_attention): both are held, per key.
        own = memory_probe.kv_per_token(self.model, self._stream)
        return lambda quantized: self.attention.working_set(own + quantized, layers)

    def _dequantized(self) -> float:
        """Bytes per key a prefill's attention dequantizes over all layers where
        it runs unpadded (quantized_attention): the model's own KV per token."""
        if self._fresh_caches is None or self.attention is not None:
            return 0.0
        return memory_probe.kv_per_token(self.model, self._stream)

    def serve_as(self, mode: batch_check.Mode) -> None:
        """Serve in `mode` from now on (the batch must be empty)."""
        self.mode = mode
        if mode is batch_check.Mode.ONE_AT_A_TIME:
            self.prefill_rows = self.batch_size = 1
        self._lanes.open(self.batch_size, self.prefill_rows)

    @property
    def speculation(self) -> SpeculationStats:
        return self._lanes.speculation

    def uncount_speculation(self) -> None:
        """What speculation has done so far counts in no metric (the warm-up's)."""
        self._lanes.uncount_speculation()

    @property
    def size(self) -> int:
        """Requests admitted to the batch."""
        return len(self._rows)

    @property
    def running(self) -> int:
        """Requests being prefilled or decoded; BatchGenerator queues the rest."""
        return self._rows.started

    @property
    def prefilling(self) -> int:
        """Requests whose prompt is not all processed."""
        return sum(1 for _ in self._rows.prefilling())

    def prefills(self) -> list[tuple[str, int, int]]:
        """(request id, tokens in its cache, prompt tokens) of each prompt prefilling."""
        return [
            (row.request.request_id, row.context, len(row.inserted.prompt))
            for row in self._rows.prefilling()
        ]

    @property
    def waiting(self) -> int:
        """Requests admitted that BatchGenerator has not started yet."""
        return len(self._rows) - self._rows.started

    @property
    def memory_in_use(self) -> tuple[int, int]:
        """MLX's active and peak memory."""
        return mx.get_active_memory(), mx.get_peak_memory()

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes the batch holds now."""
        return self._lanes.kv_bytes

    @property
    def shape_builds(self) -> bool:
        """Whether each new attention shape costs a kernel build (mlx's CUDA backend)."""
        return shapes_build()

    def queue_attention_shapes(self) -> None:
        """Queue the attention shapes prompts will meet, up to the context served
        (api.model_info), for `build_shapes` (`engine.batch.attention_shapes`)."""
        if self.attention is not None:
            context = named_context_length(self._config.model_path) or DEFAULT_CONTEXT_LENGTH
            self.attention.queue(context, self.prefill_rows)

    def build_quantized_kernels(self) -> None:
        """Under --kv-bits, run few-query passes over quantized caches at every
        query count (`quantized_attention.build_kernels`)."""
        quantized_attention.build_kernels(self._quantized_kinds)

    @property
    def shapes_queued(self) -> bool:
        return self.attention is not None and self.attention.queued

    def build_shapes(self, seconds: float) -> None:
        if self.attention is not None:
            self.attention.build_queued(seconds)

    def bound_buffer_cache(self, planner: MemoryPlanner) -> None:
        """Where mlx-lm's passes keep MLX's buffer cache, bound it (`buffer_cache.bound`)."""
        if self._buffers is buffer_cache.kept:
            self._cache_limit = buffer_cache.bound(planner)

    @property
    def stream(self) -> mx.Stream:
        return self._stream

    def holds(self, key: int) -> bool:
        return self._rows.holds(key)

    def sequences(self, excluding: Iterable[int] = ()) -> list[Running]:
        """See `Rows.sequences`."""
        return self._rows.sequences(excluding)

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
            resumed = self._rows.resumed(request.key)
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

    def _insert(self, lane: int, accepted: list[tuple[Request, tuple, Row | None]]) -> None:
        if not accepted:
            return
        prompts = [request.spec.prompt for request, _, _ in accepted]
        starts = [self._start_from(prompt) for prompt in prompts]
        samplers, processors, stops = zip(*(options for _, options, _ in accepted), strict=True)
        fresh = self._fresh_caches  # None: rows without a prefix start from mlx-lm's own
        uids = self._lanes[lane].insert(
            [list(p[s.tokens :]) for p, s in zip(prompts, starts, strict=True)],
            max_tokens=[request.spec.max_tokens for request, _, _ in accepted],
            caches=[fresh() if s.cache is None and fresh else s.cache for s in starts],
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
            row = Row(request, lane, request.spec, options, cached, cached, carries, start.pace)
            if resumed is not None:  # as the client knows it: tokens sent, cache reuse
                row.request, row.cached, row.pace = resumed.request, resumed.cached, resumed.pace
                row.fresh, row.generated = resumed.fresh, resumed.generated
            self._rows.add((lane, uid), row)
            if entry is not None and self._lanes.drafting is not None:
                self._expect(lane, uid, request.spec, entry)

    def _expect(self, lane: int, uid: int, spec: GenerationSpec, entry: Entry) -> None:
        """Where the prefix cache's entry is a sequence that began with the whole
        prompt, the row proposes what it said next (speculation's prompt lookup)."""
        ahead = self.prefixes.ahead_of(spec.prompt, entry, spec.max_tokens)
        if ahead:
            self._lanes.expect(lane, uid, Ahead(len(spec.prompt), ahead))

    def _forget(self, place: tuple[int, int]) -> Row:
        """The row leaves the batch, and gives up the entry it carried."""
        row = self._rows.forget(place)
        if row.carries is not None:
            self.prefixes.carry(row.carries, -1)
            row.carries = None
        return row

    def remove(self, keys: Iterable[int]) -> list[Event]:
        """Drop the requests with these keys (unknown keys are ignored); an abort
        event for each one dropped."""
        places = [self._rows.place(k) for k in keys if self._rows.holds(k)]
        events = []
        for lane, generator in enumerate(self._lanes):
            uids = [uid for on, uid in places if on == lane]
            if not uids:
                continue
            kept = generator.remove(uids, return_prompt_caches=self.prefixes is not None)
            self._lanes.forget(lane, uids)
            for uid in uids:
                row = self._forget((lane, uid))
                cache, tokens = kept.get(uid) or (None, ())
                # What an aborted sequence computed is as good as a finished one's.
                if cache is not None and len(tokens) > row.cached:
                    self._keep(tokens, cache, row.pace)
                events.append(Event(row.key, finish_reason="abort"))
        return events

    def move(self, keys: Iterable[int]) -> list[Event]:
        """Move these decoding requests to the long prompts' lane, each row
        with its cache as it is: put in again there, with the token mlx-lm
        has sampled for it still to process, which goes out now (unless it
        went out early). A request that token ends stays where it is."""
        events = []
        for key in keys:
            lane, uid = self._rows.place(key)
            row = self._rows[lane, uid]
            (pending,) = self._lanes.pending(lane, [uid])
            token = pending.token
            if not row.ahead:  # (one that went out early could not end its request)
                if row.ends_with(token):
                    continue
                events += self._tokens(lane, [pending])
            left = row.request.spec.max_tokens - len(row.generated)
            moved, tokens = self._lanes.move_to_long(lane, uid, token, left, row.options)
            row.lane, row.start, row.processed = LONG, len(tokens), 0
            row.prefilling, row.ahead = True, False
            row.inserted = replace(row.inserted, prompt=(*tokens, token), max_tokens=left)
            self._rows.moved((lane, uid), (LONG, moved))
            log.info(
                "request %r: its %d tokens move to the long prompts' lane, away from the "
                "short ones", row.request.request_id, len(row.inserted.prompt),
            )  # fmt: skip
        return events

    def step(
        self,
        chunk: int,
        long_chunks: tuple[int, ...] = (),
        early: Callable[[list[Event]], None] | None = None,
        spare: float = math.inf,
    ) -> tuple[list[Event], Passes]:
        """Advance the batch by one step: each sequence's new token, and what
        each pass over the model took. The short lane prefills in chunks of
        at most `chunk` tokens, the long lane runs once for each of
        `long_chunks` (once at `chunk` if none). Where the long lane runs
        after the short one, `early` gets the short lane's events first (the
        list returned begins with them): a chat's first token and a stream's
        next one need not wait for a long prompt's chunks. `spare`: the
        working set the step's plan leaves room for (`Plan.spare_bytes`),
        which a draft model catching up may take."""
        if self._lanes.drafting is not None:
            self._lanes.drafting.catch_up.room = spare
        held = self._rows.lanes()
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
        row; `early` (or where its decoding rows run checking passes): the first
        tokens of rows it moves into decoding go out now (`_first_tokens`), else
        with its next call, as mlx-lm hands them over."""
        prefilling, responses = self._lanes.next(lane, chunk)
        return self._handled(lane, prefilling, responses, early)

    def exercise_speculation(self) -> list[Event]:
        """The warm-up's: each kind of pass speculative decoding adds, once, on
        the short lane's decoding rows (nothing where it is off)."""
        return self._handled(SHORT, [], self._lanes.exercise_speculation(SHORT), early=False)

    def _handled(self, lane: int, prefilling: list, responses: list, early: bool) -> list[Event]:
        """The events of what a call of a lane's BatchGenerator returned (`_next`)."""
        decoding = []  # the rows that moved into the decoding rows in this pass
        for r in prefilling:
            row = self._rows.get((lane, r.uid))
            if row is not None:
                self._rows.prefilled(row, r.progress[0], r.end_of_prompt)
                if r.end_of_prompt:
                    decoding.append(r.uid)
        sampled = []
        for r in responses:
            row = self._rows[lane, r.uid]
            if row.ahead:  # went out a pass ago (a token that could not end its request)
                row.ahead = False
            else:
                sampled.append(r)
        events = self._tokens(lane, sampled)
        for r in responses:
            if r.finish_reason is not None:
                row = self._forget((lane, r.uid))
                # The cache holds every token of `all_tokens`, the last
                # generated one included.
                self._keep_later(r.all_tokens, r.prompt_cache, row.pace)
        early = early or self._lanes.checking(lane)  # reading them costs no overlap there
        return events + (self._first_tokens(lane, decoding) if early else [])

    def _tokens(self, lane: int, sampled: list) -> list[Event]:
        """The events of the tokens mlx-lm sampled for the lane's rows."""
        rows = [self._rows[lane, r.uid] for r in sampled]
        events = []
        wanted = [row.request.spec.logprobs for row in rows]
        for r, row, chosen in zip(sampled, rows, logprobs(sampled, wanted), strict=True):
            row.generated.append(r.token)
            events.append(
                Event(
                    row.key,
                    token=r.token,
                    finish_reason=r.finish_reason,
                    logprobs=chosen,
                    cached_tokens=row.cached,
                    first=row.fresh,
                )
            )
            row.fresh = False
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
        sampled: list[Sampled] = []
        for pending in self._lanes.pending(lane, uids):
            row = self._rows[lane, pending.uid]
            if not row.ends_with(pending.token):
                row.ahead = True
                sampled.append(pending)
        return self._tokens(lane, sampled)

    def reset(self) -> list[Request]:
        """After a step failed (out of memory), start over with an empty batch:
        what the failed step left behind cannot be trusted. Returns the requests
        that were in the batch, in admission order, each to continue from where
        its client is: its prompt extended by the tokens sent, fewer to go."""
        self._lanes.close()
        mx.clear_cache()
        self._lanes.open(self.batch_size, self.prefill_rows)
        requests = []
        for place in self._rows.places():
            row = self._forget(place)
            spec = row.request.spec
            self._rows.put_back(row)
            requests.append(
                replace(
                    row.request,
                    spec=replace(
                        spec,
                        prompt=spec.prompt + tuple(row.generated),
                        max_tokens=spec.max_tokens - len(row.generated),
                    ),
                )
            )
        return requests

    def forget_resumed(self, keys: Iterable[int]) -> None:
        """Requests put back by `reset` that ended before being admitted again."""
        self._rows.forget_resumed(keys)

    def close(self, flush_until: Callable[[], float] | None = None) -> None:
        """Release the lanes' generators, the prefix cache (first writing to
        disk what is worth keeping, until `flush_until()`; None: nothing) and
        the model on this thread (see `EngineCore.run`)."""
        self._ended.clear()  # left by a failed turn: nothing is kept of it
        self._lanes.close()
        if self.prefixes is not None:
            self.prefixes.close(flush_until)
        self.prefixes = None
        if self.attention is not None:
            self.attention.uninstall()
        if self._cache_limit is not None:
            mx.set_cache_limit(self._cache_limit)
        self.model = None
