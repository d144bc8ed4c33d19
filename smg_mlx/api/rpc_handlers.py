"""Registers the MlxEngine methods so that unparseable requests get INVALID_ARGUMENT.

grpcio's generated registration parses requests before the handler runs and
answers a malformed one with UNKNOWN and a Python exception name. Here each
method receives raw bytes and parses them itself, so a client sending the wrong
message (or garbage) is told what is wrong with the status that says so. A
call the worker has no room for is refused before its bytes are looked at, a
request its bytes alone show to be refused is refused unparsed (api.wire), and
a large message is parsed off the event loop (api.payload).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message, message_factory

from smg_mlx.api import request_log, wire
from smg_mlx.api.payload import PayloadWork
from smg_mlx.grpc_stubs import mlx_engine_pb2

SERVICE = mlx_engine_pb2.DESCRIPTOR.services_by_name["MlxEngine"]


class Refusal(Exception):
    """A request refused from its bytes alone, with the status to answer."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


async def _parse(
    raw: bytes,
    context: grpc.aio.ServicerContext,
    cls: type[message.Message],
    screen: Callable[[bytes], None],
    payload: PayloadWork,
):
    def screened() -> message.Message:
        screen(raw)
        return cls.FromString(raw)

    try:
        return await payload.run(len(raw), screened)
    except Refusal as exc:
        await context.abort(exc.code, str(exc))
    except (message.DecodeError, wire.Unreadable) as exc:
        proto = f"proto/{cls.DESCRIPTOR.file.name}"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, unparsable(cls, exc, proto))


def unparsable(cls: type[message.Message], exc: Exception, proto: str) -> str:
    """What a client sending bytes that do not parse as `cls` is told (`proto`:
    the file that defines it)."""
    return f"the request is not a valid {cls.DESCRIPTOR.full_name} ({exc}); build it from {proto}"


def _ended_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status the client sees, as far as the server can tell."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return "DEADLINE_EXCEEDED" if expired else "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "OK" if exc is None else "UNKNOWN"


async def _admitted(
    admit: Callable[[], contextlib.AbstractContextManager], context: grpc.aio.ServicerContext
) -> contextlib.AbstractContextManager:
    try:
        return admit()
    except Refusal as exc:
        await context.abort(exc.code, str(exc))


Ended = Callable[[grpc.aio.ServicerContext, "BaseException | None"], None]


def _ended(
    method: str, rpc_ended: Callable[[str, str], None], context: grpc.aio.ServicerContext,
    exc: BaseException | None,
) -> None:  # fmt: skip
    """How a call ended, told to `rpc_ended` and, where refused, to the log."""
    code = _ended_code(context, exc)
    rpc_ended(method, code)
    request_log.call_ended(method, code, context.details())


def _unary(impl: Callable, parse: Callable, admit: Callable, ended: Ended) -> Callable:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            with await _admitted(admit, context):
                reply = await impl(await parse(raw, context), context)
        except BaseException as exc:
            ended(context, exc)
            raise
        ended(context, None)
        return reply

    return handle


def _streaming(impl: Callable, parse: Callable, admit: Callable, ended: Ended) -> Callable:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            with await _admitted(admit, context):
                async for reply in impl(await parse(raw, context), context):
                    yield reply
        except BaseException as exc:
            ended(context, exc)
            raise
        ended(context, None)

    return handle


def add_engine_service(
    server: grpc.aio.Server, servicer: Any, rpc_ended: Callable[[str, str], None]
) -> None:
    """Serve the MlxEngine service on `server`, calling the servicer's methods
    by name. Each call is first taken in by `servicer.admit(method)` (a context
    held until it ends), then its request is shown, as bytes, to
    `servicer.screen(method, raw)`, then parsed; both with its `payload`
    worker. Either may raise Refusal. `rpc_ended(method, status code name)`
    hears how each call ended."""
    handlers = {}
    for method in SERVICE.methods:
        cls = message_factory.GetMessageClass(method.input_type)
        parse = functools.partial(
            _parse,
            cls=cls,
            screen=functools.partial(servicer.screen, method.name),
            payload=servicer.payload,
        )
        impl = getattr(servicer, method.name)
        admit = functools.partial(servicer.admit, method.name)
        ended = functools.partial(_ended, method.name, rpc_ended)
        if method.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(
                _streaming(impl, parse, admit, ended), response_serializer=_serialize
            )
        else:
            handler = grpc.unary_unary_rpc_method_handler(
                _unary(impl, parse, admit, ended), response_serializer=_serialize
            )
        handlers[method.name] = handler
    # Registered, each method's calls are taken from a queue of their own: a
    # health check does not wait in line behind a flood of Generate calls.
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _serialize(reply: message.Message | bytes) -> bytes:
    # A large reply comes serialized already: that work was done off the loop.
    return reply if isinstance(reply, bytes) else reply.SerializeToString()
