"""The MlxEngine gRPC service: validate, hand over to the engine, stream back.

Runs on the event loop only and never touches MLX.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from smg_mlx.api import request_log, responses, streaming, translation
from smg_mlx.api.engine_client import EngineClient, EngineState, EngineUnavailable
from smg_mlx.api.jobs import Job
from smg_mlx.api.metrics import Metrics
from smg_mlx.api.model_info import ModelInfo
from smg_mlx.api.payload import PayloadWork
from smg_mlx.api.rpc_handlers import Refusal
from smg_mlx.api.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from smg_mlx.api.tokenizer_files import Bundle, chunks
from smg_mlx.api.translation import InvalidRequest, encode
from smg_mlx.config import UNQUANTIZED, RequestLimits
from smg_mlx.engine.types import Failure, GenerationSpec
from smg_mlx.grpc_stubs import common_pb2, mlx_engine_pb2, mlx_engine_pb2_grpc
from smg_mlx.logs import counted, format_bytes

log = logging.getLogger(__name__)

SERVER_TYPE = "mlx-grpc"
MODEL_INFO_WAIT_SECONDS = 60.0
# Every request but Generate's carries a few ids at most: larger ones are
# refused unparsed.
SMALL_REQUEST_BYTES = 1 << 20
# Any id Generate takes, one Abort can name.
MAX_REQUEST_ID_BYTES = SMALL_REQUEST_BYTES // 2


class MlxEngineServicer(mlx_engine_pb2_grpc.MlxEngineServicer):
    def __init__(
        self,
        engine: EngineClient,
        *,
        batch: int,
        pending: int,
        metrics: Metrics,
        limits: RequestLimits,
        kv_format: str | None = None,
    ) -> None:
        """`kv_format`: how --kv-bits stores the KV caches (None: as the model computes them)."""
        self._engine = engine
        self._kv_format = kv_format or UNQUANTIZED
        self._metrics = metrics
        self._batch, self._pending = batch, pending  # --completion-batch-size, --max-pending
        self._limits = limits
        self._calls = 0  # Generate calls taken in, from their arrival to their end
        self._jobs: dict[str, Job] = {}
        # Requests taken in, not yet jobs (parsed, being tokenized or checked), by
        # id: set where an Abort named them meanwhile (which frees the id at once).
        self._preparing: dict[str, asyncio.Event] = {}
        self.payload = PayloadWork()
        self._started = time.monotonic()
        self.draining = False
        # Set by `set_model()` once the model directory has been read.
        self.info: ModelInfo | None = None
        self.tokenizer: Any = None
        self.sampling_defaults = NO_DEFAULTS
        self._model_known = asyncio.Event()
        self._tokenizer_zip = Bundle(b"", "")  # (`set_model`)
        # One thread: a fast tokenizer is not safe to call from several at once.
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def set_model(self, info: ModelInfo, tokenizer: Any, defaults: SamplingDefaults,
                  bundle: Bundle) -> None:  # fmt: skip
        """The model to serve; `defaults`: its sampling values for what requests
        leave unset; `bundle`: its tokenizer files as GetTokenizer serves them
        (`tokenizer_files.Bundle`), read with the tokenizer: files moved
        or deleted while the worker runs cannot change what it serves."""
        self.info, self.tokenizer = info, tokenizer
        self.sampling_defaults = defaults
        self._tokenizer_zip = bundle
        self._model_known.set()

    @property
    def active_requests(self) -> int:
        """Requests taken in: running, waiting, or still being parsed or prepared."""
        return self._calls

    def unavailable_reason(self) -> str | None:
        """Why the worker cannot take a request now, or None when it can."""
        if self.draining:
            return "the worker is shutting down; send the request to another worker"
        if self._engine.state is EngineState.FAILED:
            return f"the engine has failed ({self._engine.failure})"
        if self.info is None or self._engine.state is not EngineState.READY:
            return "the model is still loading; retry when health reports SERVING"
        return None

    def admit(self, method: str) -> contextlib.AbstractContextManager:
        """Take a call in, or refuse it (raises Refusal) before anything is done
        with its bytes: a Generate call when the worker cannot serve it, or when
        the batch and --max-pending are full. Large payloads wait their turn to
        be parsed (api.payload), and a client refused for capacity should hear
        so at once, to try another worker. Held until the call ends."""
        if method != "Generate":
            return contextlib.nullcontext()
        reason = self.unavailable_reason()
        if reason:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, reason)
        full = self._full()
        if full:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the worker is full ({counted(self._calls, 'request')} in flight: {full}); "
                "retry on another worker or later",
            )
        return self._counted()

    def _full(self) -> str | None:
        """Why no call more may wait (None: one may): the batch and --max-pending
        are full, or requests wait for memory and --max-pending of them do
        besides those running (as the engine last said: every call since waits
        too, memory being full)."""
        memory, running = self._engine.memory, self._engine.running
        if self._calls >= self._batch + self._pending:
            # (as many running as the engine last said: memory may hold fewer than the batch)
            return (
                f"the most it takes: --completion-batch-size {self._batch} + --max-pending "
                f"{self._pending}; {running} running"
            )
        if memory is not None and memory.waiting_for_memory and (
            self._calls - running >= self._pending
        ):
            return f"{running} running, as many as memory holds, --max-pending waiting"
        return None

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1

    def screen(self, method: str, raw: bytes) -> None:
        """Refuse a request from its bytes, before it is parsed (raises
        Refusal): a parse holds the GIL from start to end, so a large one
        pauses every other call (api.wire). Only Generate carries large lists,
        and those are counted here and checked against their limits: what is
        then parsed is bounded by the context length. Runs wherever the parse
        does (api.payload), after `admit`."""
        if method != "Generate":
            if len(raw) > SMALL_REQUEST_BYTES:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the {method} request is {len(raw)} bytes; this worker takes at most "
                    f"{SMALL_REQUEST_BYTES} for any request but Generate",
                )
            return
        try:
            translation.check_sizes(raw, self.info, self._limits, self._engine.longest_sequence)
        except InvalidRequest as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    async def Generate(
        self, request: mlx_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[mlx_engine_pb2.GenerateResponse | bytes]:
        request_id = request.request_id or uuid.uuid4().hex
        if (size := len(request_id.encode())) > MAX_REQUEST_ID_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request_id is {size} bytes; this worker takes at most {MAX_REQUEST_ID_BYTES} "
                "(an Abort must be able to name it)",
            )
        if request_id in self._jobs or request_id in self._preparing:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                # (bounded: a status message over 16 KiB is refused by grpcio's clients)
                f"request_id {request_log.bounded(request_id)!r} is already in flight; "
                "use a unique id",
            )
        aborted = self._preparing[request_id] = asyncio.Event()
        try:
            spec = await self._prepare(request, context)
        finally:
            if self._preparing.get(request_id) is aborted:
                del self._preparing[request_id]
        job = Job(request_id, spec)
        if aborted.is_set():  # while it was being prepared: it never reaches the engine,
            job.end(finish_reason="abort")  # and its id, freed by Abort, may be taken again
        else:
            try:
                self._engine.submit(job)
            except EngineUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            self._jobs[request_id] = job
        delivered = False
        try:
            most = responses.tokens_within(
                self._limits.max_response_bytes, self.info.vocab_size, spec.logprobs
            )
            async for chunk in streaming.chunks(
                job, request.stream, self._tokens_per_message, most, self._engine.each_alone
            ):
                yield chunk
            if job.error:
                await context.abort(self._error_code(job), job.error)
            final = await self._complete(job, request.stream)
            # Handed to gRPC: sent, even where the call ends before gRPC asks for
            # more (a client may stop reading once it has this message).
            delivered = True
            yield final
        finally:
            if self._jobs.get(request_id) is job:  # (Abort may have freed its id)
                del self._jobs[request_id]
            if not job.done:  # the client left or its deadline passed
                self._engine.abandon(job)
            self._request_ended(job, delivered)

    async def _prepare(
        self, request: mlx_engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> GenerationSpec:
        """The request checked and translated, or the call ended with the status
        that says why. Capacity was checked first (`admit`), and lengths next
        (the lists' before parsing, in `screen`), before any work that grows
        with the request (tokenizing, checking ids)."""
        try:
            text = translation.prompt_text(request, self.info)
            ids = request.tokenized.input_ids if text is None else await self._encode(text)
            return await self.payload.run(
                translation.payload_size(request, ids),
                translation.generation_spec,
                request,
                self.info,
                ids,
                self._engine.longest_sequence,
                self._limits,
                self.sampling_defaults,
            )
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _encode(self, text: str) -> list[int]:
        """Tokenize off the event loop: megabytes of text take seconds."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizing, encode, self.tokenizer, text)

    async def _complete(self, job: Job, streamed: bool) -> bytes:
        """The final message, serialized: a non-streamed one carries every token
        (megabytes with logprobs), so a large one is built off the loop."""
        size = 0
        if not streamed:
            per_token = responses.bytes_per_token(self.info.vocab_size, job.spec.logprobs)
            size = len(job.tokens) * per_token
        return await self.payload.run(size, _serialized_complete, job, streamed)

    @staticmethod
    def _error_code(job: Job) -> grpc.StatusCode:
        if job.failure is Failure.TOO_BIG:
            return grpc.StatusCode.INVALID_ARGUMENT
        if job.failure is Failure.OUT_OF_MEMORY:
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        if job.retry_elsewhere and not job.streamed:
            # Nothing reached the client: another worker can serve it (the
            # router retries UNAVAILABLE before the first message).
            return grpc.StatusCode.UNAVAILABLE
        return grpc.StatusCode.INTERNAL

    def _tokens_per_message(self) -> int:
        return self._engine.tokens_per_message

    def _request_ended(self, job: Job, delivered: bool) -> None:
        job.ended_at = time.monotonic()
        if job.failure is Failure.STOPPING:
            outcome = "shutdown"  # turned away unstarted, for another worker: no failure
        elif job.error or delivered:
            outcome = "error" if job.error else job.finish_reason
        else:
            # The client left or its deadline passed: before the end, or after
            # it, with the response unsent (never counted as a success).
            outcome = "undelivered" if job.finish_reason else "cancelled"
        self._metrics.request_ended(job, outcome)
        request_log.request_ended(job, outcome)

    async def Abort(
        self, request: mlx_engine_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.AbortResponse:
        ids = await self.payload.run(
            translation.BYTES_PER_ITEM * len(request.request_ids), frozenset, request.request_ids
        )
        jobs = [job for request_id, job in self._jobs.items() if request_id in ids]
        if jobs:
            self._engine.abort(jobs)
            # Their ids are free once Abort returns: a client may send one again
            # at once, while the aborted stream is still sending its last message.
            for job in jobs:
                del self._jobs[job.request_id]
        # Those still being prepared end once they are (Generate sees the flag).
        preparing = [self._preparing.pop(i) for i in ids if i in self._preparing]
        for aborted in preparing:
            aborted.set()
        if jobs or preparing:
            log.info("abort requested for %s", counted(len(jobs) + len(preparing), "request"))
        return mlx_engine_pb2.AbortResponse()

    async def HealthCheck(
        self, request: mlx_engine_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.HealthCheckResponse:
        # Not an answer with healthy=false: the router (smg 1.13) registers a
        # worker whose first HealthCheck succeeds, and routes to it at once,
        # whatever the answer says. An error makes it try again later.
        reason = self.unavailable_reason()
        if reason:
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
        return mlx_engine_pb2.HealthCheckResponse(healthy=True, message="ok")

    async def _model_info(self, context: grpc.aio.ServicerContext) -> ModelInfo:
        """The model's facts, waiting the short while it takes to read them at start-up."""
        try:
            await asyncio.wait_for(self._model_known.wait(), MODEL_INFO_WAIT_SECONDS)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the model directory is still being read; retry shortly",
            )
        return self.info

    async def GetModelInfo(
        self, request: mlx_engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetModelInfoResponse:
        info = await self._model_info(context)
        return mlx_engine_pb2.GetModelInfoResponse(
            model_path=info.model_path,
            is_generation=True,
            max_context_length=info.context_length,
            vocab_size=info.vocab_size,
            served_model_name=info.served_model_name,
            model_type=info.model_type,
            architectures=info.architectures,
            eos_token_ids=info.eos_token_ids,
            pad_token_id=info.pad_token_id or 0,
            bos_token_id=info.bos_token_id or 0,
            max_req_input_len=self._longest_prompt(info.context_length),
        )

    def _longest_prompt(self, context_length: int) -> int:
        """The longest prompt a request may send: one token short of the
        context, or of what memory holds for one request, whichever is less
        (what `Generate` refuses past; unknown until the engine has started)."""
        longest = self._engine.longest_sequence
        return (min(context_length, longest) if longest else context_length) - 1

    async def GetServerInfo(
        self, request: mlx_engine_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> mlx_engine_pb2.GetServerInfoResponse:
        # The message has no fields for the scheduler's state, and the router
        # shares its definition: its headers carry it instead, and the log
        # (the router asks once, as it adds a worker).
        running = self._engine.running
        waiting = max(len(self._jobs) - running, 0)
        per_token = self._engine.kv_per_token
        # What proposes tokens to check (the metrics' drafter label), once started.
        loading = self._engine.mode == "loading"
        drafter = self._engine.speculation.drafter or ("loading" if loading else "off")
        await context.send_initial_metadata(
            (
                ("waiting-requests", str(waiting)),
                ("prefilling-requests", str(self._engine.prefilling)),
                ("running-requests", str(running)),
                # How requests are batched: other than "batched" is slower
                # (docs/serving.md, "Model families").
                ("serving-mode", self._engine.mode),
                # What a token of context costs (--kv-bits makes it less).
                ("kv-bytes-per-token", str(round(per_token))),
                # --kv-bits and --kv-group-size ("8-bit KV, group 64"), and
                # --speculative / --draft-model as the engine found them.
                ("kv-format", self._kv_format),
                ("speculative-decoding", drafter),
            )
        )
        log.info(
            "GetServerInfo: %d running (%d prefilling), %d waiting; serving mode %s; "
            "KV %s per token (%s); speculative decoding: %s", running,
            self._engine.prefilling, waiting, self._engine.mode, format_bytes(per_token),
            self._kv_format, drafter,
        )  # fmt: skip
        return mlx_engine_pb2.GetServerInfoResponse(
            server_type=SERVER_TYPE,
            active_requests=self.active_requests,
            uptime_seconds=time.monotonic() - self._started,
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        await self._model_info(context)
        bundle = self._tokenizer_zip
        if bundle.refused:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, bundle.refused)
        for data, sha256 in chunks(bundle.data, bundle.sha256):
            yield common_pb2.GetTokenizerChunk(data=data, sha256=sha256)


def _serialized_complete(job: Job, streamed: bool) -> bytes:
    return responses.complete(job, streamed=streamed).SerializeToString()
