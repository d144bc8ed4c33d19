"""The worker process: gRPC server, health, start-up and graceful shutdown."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from smg_mlx import demo_model, flag_types, model_files, model_source
from smg_mlx.api import health_service, responses, sampling_defaults, translation
from smg_mlx.api.engine_client import EngineClient, EngineState, EngineUnavailable
from smg_mlx.api.health_service import HealthServicer
from smg_mlx.api.metrics import Metrics
from smg_mlx.api.model_info import ModelInfo, load_model_info
from smg_mlx.api.rpc_handlers import add_engine_service
from smg_mlx.api.servicer import MlxEngineServicer
from smg_mlx.api.start_up_progress import StartUpProgress, said_while_quiet
from smg_mlx.api.tokenizer_files import VOCABULARY_PATTERNS, tokenizer_zip
from smg_mlx.config import UNQUANTIZED, ServerConfig
from smg_mlx.engine.ranks.launched import launched_rank
from smg_mlx.grpc_stubs import mlx_engine_pb2
from smg_mlx.logs import READY, counted, format_bytes, host_port, one_line
from smg_mlx.model_config import BadModelConfig, generation_config, read_json
from smg_mlx.stop_signals import stop_signals

log = logging.getLogger(__name__)

ENGINE_SERVICE = mlx_engine_pb2.DESCRIPTOR.services_by_name["MlxEngine"].full_name
# Tokens a request may have, below which the start-up says so as a warning.
FEW_TOKENS = 512
# The reflection service's name since gRPC made it stable: v1alpha's messages, field for field.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
HEALTH_NAMES = ("", ENGINE_SERVICE)  # "" is the whole server, as Kubernetes probes ask
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# At a stop, how long an engine thread (it cannot be killed, as its process can)
# may take to end besides the prefix cache's writes (its step, then releasing
# the model on its own thread).
STOP_SECONDS = 30.0
# Once the engine has stopped and its writes' time is up, how long its process may
# take to exit before it is killed: a write the system holds up (a hung disk) cannot
# be interrupted, and must not hold up the worker's exit.
EXIT_SECONDS = 1.0
# An engine thread (not process) holds the GIL through a step's Python: all of
# a step where the host bounds it (a small model on a GPU). The event loop,
# woken for a request or a message, waits up to this long for each piece of its
# work (Python's default is 5 ms), and every request and stream with it.
SWITCH_INTERVAL_SECONDS = 0.0005
# A stop asked again within this is the first one delivered twice, not a second
# request: `kill %1` of `make serve &` signals the job's process group, and make
# passes SIGTERM on to the worker it runs. Timed as the event loop gets to each,
# so it allows for a busy host's delays (a quarter second was seen passed once).
ONE_STOP_SECONDS = 1.0


class StartupError(RuntimeError):
    """The worker could not start; the message names the cause, `exit_code` is
    the process's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def load_tokenizer(model_dir: Path) -> Any:
    """The model's tokenizer (transformers tokenizes without MLX, so text
    prompts never touch the engine thread); raises StartupError when the
    directory has none, or it cannot be loaded."""
    from transformers import AutoTokenizer

    missing = StartupError(
        f"{model_dir} has no tokenizer (no tokenizer.json, nor the vocabulary files a "
        "tokenizer_config.json names): serve a model directory with its tokenizer files",
        exit_code=2,
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - transformers' own reasons, of many kinds
        if not any(any(model_dir.glob(name)) for name in VOCABULARY_PATTERNS):
            # transformers' reason would be to install a library that converts them
            raise missing from None
        # Its files, or what their config asks for, are to be fixed: a restart cannot cure it.
        where = next(_unreadable_json(model_dir.glob("*token*.json")), model_dir)
        said = one_line(exc)
        if isinstance(exc, (KeyError, TypeError, AttributeError, IndexError)):
            # Python's own words alone ('added_tokens') say nothing of a file.
            said = f"{type(exc).__name__}: {said}; a tokenizer file lacks or misstates a field"
        why = f"cannot load the tokenizer of {where}: {said}"
        if where == model_dir:
            why = _config_unreadable(model_dir) or why
        raise StartupError(why, exit_code=2) from None
    # Without tokenizer files transformers may build an empty tokenizer of the
    # model's family, which turns every text into no tokens at all.
    try:
        encoded = tokenizer.encode("Hello")
    except Exception as exc:  # noqa: BLE001 - a setting of its files transformers took, then trips on
        raise StartupError(
            f"the tokenizer of {model_dir} cannot encode a text ({type(exc).__name__}: "
            f"{one_line(exc)}): a setting in tokenizer_config.json or tokenizer.json has a "
            "value of the wrong type (such as model_max_length given as text); fix it",
            exit_code=2,
        ) from None
    if not encoded:
        raise missing
    return tokenizer


def _config_unreadable(model_dir: Path) -> str | None:
    """Why transformers cannot read the directory's config.json, which it reads
    to find the tokenizer (a setting mlx-lm takes and transformers refuses,
    such as a linear RoPE without its factor): None where it can."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:  # noqa: BLE001 - transformers' own reasons, of many kinds
        return (
            f"transformers cannot read {model_dir / 'config.json'} ({one_line(exc)}), and "
            "loads the tokenizer through it: fix the setting it names, or serve the "
            "config.json that came with the model"
        )
    return None


def check_chat_template(tokenizer: Any) -> None:
    """Warn where the chat template cannot render a one-message chat: the
    router renders it itself from GetTokenizer's files, and would fail every
    chat request of a worker that reports SERVING. A warning, not a refusal:
    the worker's own API takes text and tokens, and completions still work."""
    if not getattr(tokenizer, "chat_template", None):
        return  # (a base model: the router refuses chats itself, saying why)
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # noqa: BLE001 - jinja's and the template's own, of many kinds
        from jinja2 import TemplateSyntaxError

        if isinstance(exc, TemplateSyntaxError):
            # The router parses the template as it loads the tokenizer: it then
            # refuses every request for this model, text completions too.
            log.warning(
                "the chat template (tokenizer_config.json's chat_template, or "
                "chat_template.jinja) is not valid Jinja: %s; the router cannot load this "
                "model's tokenizer, so every request through it fails (chats and text "
                "completions alike; requests of token ids over gRPC still work): fix the "
                "template, serve the model's own, or give the router one (its --chat-template)",
                one_line(exc),
            )
            return
        log.warning(
            "the chat template (tokenizer_config.json's chat_template, or chat_template.jinja) "
            "cannot render a one-message chat: %s; the router's chat completions will fail "
            "(its completions of text still work): fix the template, or serve the model's own",
            one_line(exc),
        )


def _check_draft(draft: Path, tokenizer: Any) -> None:
    """The checks --model's directory gets, for --draft-model's, and that it
    proposes the model's tokens (`tokenizer`, the model's): a refusal (exit 2)
    that names the flag, before the weights load, not a load failure that a
    supervisor restarts."""
    try:
        model_files.check(draft)
        theirs = load_tokenizer(draft).get_vocab()
    except (BadModelConfig, StartupError) as exc:
        raise StartupError(f"--draft-model: {exc}", exit_code=2) from None
    if (differs := _first_difference(theirs, tokenizer.get_vocab())) is not None:
        raise StartupError(
            f"--draft-model {draft}: its tokenizer's vocabulary is not the model's "
            f"({differs}): a draft must share the model's tokenizer (e.g. a smaller model of "
            "the same family)",
            exit_code=2,
        )


def _first_difference(draft: dict[str, int], model: dict[str, int]) -> str | None:
    """Where the draft's vocabulary (token: id) first departs from the model's, said."""
    if len(draft) != len(model):
        return f"{len(draft)} tokens against {len(model)}"
    for token, number in sorted(model.items(), key=lambda item: item[1]):
        if draft.get(token) != number:
            return f"token {token!r} is id {draft.get(token)} there, {number} here"
    return None


def _unreadable_json(paths: Iterable[Path]) -> Iterator[Path]:
    """Those of `paths` that do not hold JSON (the file to name when a tokenizer fails)."""
    for path in sorted(paths):
        try:
            read_json(path)
        except (BadModelConfig, OSError):
            yield path


def _bind(host: str, port: int) -> None:
    """Bind a socket to every address `host` names, as gRPC does; raises OSError."""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)


def listen_failure(flag: str, host: str, port: int, exc: OSError | None = None) -> StartupError:
    """Why `host:port` (the port of `flag`) cannot be listened on, as a
    StartupError whose exit code says whether a restart could cure it (a port
    in use) or a flag must change. gRPC's own error names no cause: without
    `exc`, a socket bound there finds it."""
    where = f"cannot listen on {host_port(host, port)}"
    if exc is None:
        try:
            _bind(host, port)
        except socket.gaierror as lookup:
            return StartupError(
                f"{where}: {host or repr(host)} is neither an address nor a name this "
                "machine resolves "
                f"({lookup.strerror}): fix --host",
                exit_code=2,
            )
        except OSError as bind:
            exc = bind
        else:
            return StartupError(f"{where}: gRPC could not bind it")
    if exc.errno == errno.EADDRINUSE:  # another process may let go of it: a restart may do
        return StartupError(
            f"{where}: port {port} is in use (another worker or program holds it): stop that "
            f"or choose another {flag}"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"{where}: {host} is not an address of this machine: fix --host", 2)
    if exc.errno == errno.EACCES:
        return StartupError(f"{where}: port {port} needs privileges: choose another {flag}", 2)
    return StartupError(f"{where}: {exc.strerror or exc}")


def _add_reflection(server: grpc.aio.Server) -> None:
    """Reflection (grpcurl, Postman) under both of its names: grpcio-reflection
    serves v1alpha alone, and a tool that asks v1 only would find nothing."""
    servicer = reflection.aio.ReflectionServicer(
        (ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    )
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method}),)
    )


class Worker:
    """One serving worker. Create, `start()`, then `serve_until_stopped()` or `shutdown()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model_dir = config.engine.model_path
        self.port: int | None = None
        self._stop_requested = asyncio.Event()
        self._asked_to_stop = False  # by a signal (or a test), not by an engine failure
        self._hurry = False  # a second stop request: no more grace
        self._asked_at = 0.0  # when the first was (time.monotonic)
        self.serving = False  # started and reported SERVING
        self.engine = EngineClient(
            asyncio.get_running_loop(),
            config.stream_interval,
            config.engine_process,
            config.watchdog_seconds,
        )
        self.metrics = Metrics(
            active=lambda: self.servicer.active_requests,
            running=lambda: self.engine.running,
            prefilling=lambda: self.engine.prefilling,
            memory=lambda: self.engine.memory,
            cache=lambda: self.engine.cache,
            speculation=(lambda: self.engine.speculation)
            if config.engine.speculative != "off" else None,
        )  # fmt: skip
        self.engine.on_step(self.metrics.steps)
        self.servicer = MlxEngineServicer(
            self.engine,
            batch=config.engine.completion_batch_size,
            pending=config.max_pending,
            metrics=self.metrics,
            limits=config.limits,
            kv_format=config.engine.kv_format,
        )
        self.health = HealthServicer()
        self.engine.on_failure(self._on_engine_failure)
        self.server = grpc.aio.server(
            options=[
                # Larger requests get RESOURCE_EXHAUSTED from gRPC itself.
                ("grpc.max_receive_message_length", config.limits.max_request_bytes),
                # gRPC shares ports by default: a second worker on the same
                # port would silently take half the connections.
                ("grpc.so_reuseport", 0),
                # Clients' keepalive pings are welcome however often they come:
                # gRPC's default closes a connection that pings more than once in
                # five minutes while no data flows (a non-streamed answer, a long
                # prompt before its first token), failing its calls UNAVAILABLE.
                ("grpc.http2.max_ping_strikes", 0),
            ]
        )
        add_engine_service(self.server, self.servicer, self.metrics.rpc_ended)
        health_service.add_to_server(self.health, self.server)
        _add_reflection(self.server)

    def _tls_credentials(self) -> grpc.ServerCredentials | None:
        cert, key = self.config.tls_cert, self.config.tls_key
        if cert is None or key is None:
            return None
        return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])

    async def _set_health(self, status: int) -> None:
        for name in HEALTH_NAMES:
            await self.health.set(name, status)

    def _on_engine_failure(self, message: str) -> None:
        if not self.serving:  # a failure while loading ends start-up, which says why
            return
        log.error("%s; reporting NOT_SERVING", message)
        asyncio.get_running_loop().create_task(self._set_health(NOT_SERVING))
        # Supervisors restart a worker that exits, not one that stays up broken.
        log.error("the engine failed: stopping the worker (exit code 1)")
        self._stop_requested.set()  # no one asked: a signal that comes now is the first

    async def start(self) -> None:
        """Listen, find the model (which may mean a download or building the demo
        model), load it on the engine thread, and report SERVING once it is warm.
        Until then the port is open and health says NOT_SERVING: probes and the
        router see a worker starting, not a dead host."""
        await self._set_health(NOT_SERVING)
        address = host_port(self.config.host, self.config.port)
        try:
            if self.config.port:  # found first: gRPC's own failure adds a cryptic line
                _bind(self.config.host, self.config.port)
            credentials = self._tls_credentials()
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except (OSError, RuntimeError):
            raise listen_failure("--port", self.config.host, self.config.port) from None
        await self.server.start()
        if self.config.metrics_port is not None:
            try:
                self.metrics.serve(self.config.host, self.config.metrics_port)
            except OSError as exc:
                await self.server.stop(None)
                raise listen_failure(
                    "--metrics-port", self.config.host, self.config.metrics_port, exc
                ) from None
            metrics = host_port(self.config.host, self.config.metrics_port)
            log.info("metrics on http://%s/metrics", metrics)
        log.info(
            "listening on %s (%s)",
            host_port(self.config.host, self.port),
            "TLS" if credentials else "plaintext",
        )
        started = time.perf_counter()
        finding = "finding the model (a download, or the demo model's build)"
        async with said_while_quiet(log, finding) as progress:
            info = await self._load(progress)
        self.metrics.model_load_seconds.set(time.perf_counter() - started)
        self.metrics.serving_mode.labels(self.engine.mode).set(1)
        self.metrics.kv_format.labels(self.config.engine.kv_format or UNQUANTIZED).set(1)
        self.metrics.speculative_drafter.labels(self.engine.speculation.drafter or "off").set(1)
        if self.config.engine.pipeline and self.engine.ranks == 1:  # a launcher of one rank
            log.warning("--pipeline does nothing: the model runs whole in this one process")
        longest = self.engine.longest_sequence
        short = longest < min(info.context_length, FEW_TOKENS)  # hardly a chat's: worth a warning
        (log.warning if short else log.info)(
            "one request may have up to %d tokens of prompt and output (%s)",
            min(longest, info.context_length),
            "the model's context" if info.context_length <= longest
            else "what memory holds" + ("; --memory-budget gives more" if short else ""),
        )  # fmt: skip
        await self._set_health(SERVING)
        self.serving = True
        logging.getLogger(READY).info(
            "SERVING %s (context %d, vocab %d) on %s, ready in %.1fs%s",
            info.served_model_name,
            info.context_length,
            info.vocab_size,
            host_port(self.config.host, self.port),
            time.perf_counter() - started,
            self._ranks(),
        )

    async def _load(self, progress: StartUpProgress) -> ModelInfo:
        """Find the model, read what the worker needs of it, and have the
        engine load it; what it is. Says in `progress` what it waits on."""
        await self._locate_model()
        log.info("loading %s", self.model_dir)
        try:
            model_files.check(self.model_dir)
            # Model facts need no weights: GetModelInfo answers while the
            # engine thread loads them. Read them before the engine starts:
            # transformers' lazy imports are not safe from two threads at once.
            progress.waiting_on = "reading the model's tokenizer"
            tokenizer = await asyncio.to_thread(load_tokenizer, self.model_dir)
            if self.config.engine.draft_model is not None:
                progress.waiting_on = "reading the draft model's tokenizer"
                await asyncio.to_thread(_check_draft, self.config.engine.draft_model, tokenizer)
            progress.waiting_on = "reading the tokenizer's files"
            self._check_budget_holds_the_weights()
            await asyncio.to_thread(check_chat_template, tokenizer)
            bundle = await asyncio.to_thread(tokenizer_zip, self.model_dir)
            # --generation-config none: not read at all (a broken one cannot matter).
            generation = (
                generation_config(self.model_dir) if self.config.model_sampling_defaults else None
            )
            info = load_model_info(
                self.model_dir, tokenizer, self.config.served_model_name, generation
            )
            self._check_request_room(info)
            defaults = self._sampling_defaults(generation)
            self.servicer.set_model(info, tokenizer, defaults, bundle)
            progress.engine_loads()
            self.engine.start(self.config.engine)
            await self.engine.wait_ready()
        except StartupError:
            await self.server.stop(None)
            raise
        except Exception as exc:
            await self.server.stop(None)
            # A model the worker can never serve is refused like a bad flag (exit 2):
            # supervisors do not restart it into the same refusal.
            permanent = isinstance(exc, EngineUnavailable) and exc.permanent
            code = 2 if permanent or isinstance(exc, BadModelConfig) else 1
            raise StartupError(f"cannot serve {self.model_dir}: {exc}", code) from exc
        return info

    def _check_budget_holds_the_weights(self) -> None:
        """Refuse a --memory-budget that cannot hold even the model's weights
        before loading them. (Each of several ranks holds a part of them: the
        engine checks those once they are loaded.)"""
        budget = self.config.engine.memory_budget_bytes
        weights = model_files.weights_on_disk(self.model_dir)
        if budget is not None and budget < weights and launched_rank() is None:
            raise StartupError(
                f"--memory-budget {format_bytes(budget)} cannot hold the model: its weights "
                f"alone take {format_bytes(weights)}; raise --memory-budget",
                exit_code=2,
            )

    def _sampling_defaults(
        self, generation: dict[str, Any] | None
    ) -> sampling_defaults.SamplingDefaults:
        """The model's sampling values (in `generation`, its generation_config.json;
        None: --generation-config none) for what requests leave unset; logged,
        since they change what clients get."""
        if generation is None:
            return sampling_defaults.NO_DEFAULTS
        defaults = sampling_defaults.read(generation, self.model_dir / "generation_config.json")
        if str(defaults):
            log.info(
                "requests that leave them unset get the model's sampling values "
                "(generation_config.json; --generation-config none turns this off): %s",
                defaults,
            )
        return defaults

    def _check_request_room(self, info: ModelInfo) -> None:
        """Say so when a prompt of the model's whole context would not fit in one
        request message: gRPC's refusal of it names no flag."""
        limit = self.config.limits.max_request_bytes
        # A request's ids are the same varints as a response's.
        per_id = responses.bytes_per_token(info.vocab_size, None)
        needed = info.context_length * per_id + translation.REQUEST_BESIDES_IDS
        if needed > limit:
            most = flag_types.MAX_MESSAGE_BYTES
            advice = (
                f"set --max-request-bytes {-(-needed // 1024)}KiB for any such request to fit"
                if needed <= most else
                f"at its most ({most} bytes) --max-request-bytes takes prompts of up to "
                f"{(most - translation.REQUEST_BESIDES_IDS) // per_id} tokens"
            )  # fmt: skip
            log.warning(
                "requests over %d bytes are refused (--max-request-bytes): a prompt of this "
                "model's whole context (%d tokens) takes about %d bytes, up to %d with stop "
                "ids and logit biases at their limits; %s",
                limit, info.context_length, info.context_length * per_id, needed, advice,
            )  # fmt: skip

    async def _locate_model(self) -> None:
        """Point the settings at the model directory to serve (off the loop: a
        download takes minutes)."""
        config = self.config
        source = None
        try:
            source = await asyncio.to_thread(
                model_source.locate, config.engine.model_path, config.demo, config.revision
            )
            draft = config.engine.draft_model
            if draft is not None:
                draft = (await asyncio.to_thread(model_source.resolve, str(draft))).path
        except model_source.ModelUnavailable as exc:
            await self.server.stop(None)
            which = "--draft-model: " if source is not None else ""
            raise StartupError(f"{which}{exc}", exc.exit_code) from None
        self.model_dir = source.path
        self.config = replace(
            config,
            engine=replace(config.engine, model_path=source.path, draft_model=draft),
            served_model_name=config.served_model_name or source.served_name,
        )

    def _ranks(self) -> str:
        ranks = self.engine.ranks
        if ranks == 1:
            return ""
        split = "pipeline" if self.config.engine.pipeline else "tensor parallel"
        return f", the model split over {ranks} ranks ({split})"

    def request_stop(self) -> None:
        """Begin a graceful shutdown; a second request (not the first delivered
        twice: ONE_STOP_SECONDS) skips what is left of the grace period. Signal
        handlers and tests call this on the loop."""
        now = time.monotonic()
        if not self._asked_to_stop:
            self._asked_to_stop, self._asked_at = True, now
        elif not self._hurry and now - self._asked_at >= ONE_STOP_SECONDS:
            log.warning("asked again to stop: aborting what is still running and writing "
                        "nothing more to disk")  # fmt: skip
            self._hurry = True
            self.engine.hurry()
        self._stop_requested.set()

    async def stop_requested(self) -> None:
        """Returns once a stop was requested."""
        await self._stop_requested.wait()

    async def shutdown(self) -> int:
        """Stop taking work, let in-flight requests finish within the grace period,
        abort the rest, stop the engine. Returns the process exit code."""
        servicer = self.servicer
        servicer.draining = True
        await self.health.enter_graceful_shutdown()  # NOT_SERVING everywhere, for good
        if refused := self.engine.refuse_waiting():
            log.info(
                "shutting down: %s still waiting for a place in the batch turned away "
                "(UNAVAILABLE: the router sends them to another worker)",
                counted(refused, "request"),
            )
        grace = self.config.shutdown_grace_seconds
        # (those turned away still count until their calls end, after this)
        in_flight = counted(servicer.active_requests - refused, "request")
        if self.engine.state is EngineState.FAILED:  # its requests end with it, now
            log.info("shutting down: %s in flight end with the engine", in_flight)
        else:
            log.info("shutting down: %s in flight, waiting up to %gs", in_flight, grace)
        deadline = time.monotonic() + grace
        while servicer.active_requests and time.monotonic() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        if servicer.active_requests:
            log.warning("aborting %s still running", counted(servicer.active_requests, "request"))
            self.engine.abort_all()
            # Let the aborted streams send their final message.
            end = time.monotonic() + 5
            while servicer.active_requests and time.monotonic() < end:
                await asyncio.sleep(0.05)
        await self.server.stop(1.0)
        # The prefix cache's last writes to disk take what is left of the grace.
        flush = 0.0 if self._hurry else max(0.0, deadline - time.monotonic())
        self.engine.stop(flush)
        failed = self.engine.state is EngineState.FAILED
        # A failed engine's thread may be stuck waiting for a hung rank: the
        # process exits without it (os._exit) rather than wait.
        if failed and not await asyncio.to_thread(self.engine.join, 2):
            log.error("the engine did not stop within 2s")
            return 1
        if not failed and not await self._engine_ends(flush):
            return 1
        log.info("stopped%s", " (the engine had failed)" if failed else "")
        return 1 if failed else 0

    async def _engine_ends(self, flush: float) -> bool:
        """Wait for the engine, asked to stop, to end; whether it stopped. Its
        prompt cache writes to disk until `flush` seconds from now (or until a
        second signal). In a process of its own it then has EXIT_SECONDS more
        to end, else it is killed, in its step or not: no stream is open any
        more, and a step of a request already aborted (a long prompt's chunk on
        a slow machine) would hold the exit past the grace for nothing. A
        thread cannot be killed: it has STOP_SECONDS besides the writes to end
        its step and say it stopped."""
        began = time.monotonic()
        killable = self.config.engine_process
        end = began + flush + (EXIT_SECONDS if killable else STOP_SECONDS)
        while not await asyncio.to_thread(self.engine.join, 0.1):
            now = time.monotonic()
            stopped = self.engine.state is EngineState.STOPPED
            if stopped:
                writes_end = now if self._hurry else max(now, began + flush)
                end = min(end, writes_end + EXIT_SECONDS)
            if now < end:
                continue
            if not stopped and not killable:
                log.error("the engine did not stop within %.0fs", now - began)
                return False
            if stopped:
                log.warning(
                    "the engine stopped, but its process had not exited %.0fs later "
                    "(a write to disk the system holds up?): ending it",
                    EXIT_SECONDS,
                )
            else:
                log.warning(
                    "the engine was still in a step %.1fs after it was asked to stop, "
                    "with no request open: ending its process",
                    now - began,
                )
            self.engine.kill()
            return True
        return True


async def run(config: ServerConfig) -> int:
    """Serve until a stop signal (`stop_signals`), which may come at any time,
    even while the model loads; returns the exit code."""
    if not config.engine_process:
        sys.setswitchinterval(SWITCH_INTERVAL_SECONDS)
    worker = Worker(config)
    loop = asyncio.get_running_loop()
    for sig in stop_signals():
        loop.add_signal_handler(sig, worker.request_stop)
    starting = asyncio.ensure_future(worker.start())
    stop = asyncio.ensure_future(worker.stop_requested())
    await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        # The engine thread may be deep in loading weights: it is not waited
        # for (the process exits without joining it).
        log.info("asked to stop while starting; stopping")
        demo_model.stop_builds()  # (--demo's first run)
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await worker.server.stop(None)
        worker.engine.stop()
        return 0
    try:
        starting.result()
    except StartupError as exc:
        log.error("%s", exc)
        worker.engine.stop()
        return exc.exit_code
    await stop
    return await worker.shutdown()
