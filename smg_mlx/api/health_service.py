"""grpc.health.v1's servicer, with a refusal that names the services a worker
reports, and watches that end when the worker stops; registered so that a
request that does not parse gets INVALID_ARGUMENT (`add_to_server`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message
from grpc_health.v1 import health, health_pb2

from smg_mlx.api.rpc_handlers import unparsable

Status = health_pb2.HealthCheckResponse.ServingStatus
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health.aio.HealthServicer):
    """grpcio's, but a Check of a service this worker does not report says which
    it does, instead of a bare NOT_FOUND; a Watch, once the worker shuts down,
    sends NOT_SERVING and ends (OK) rather than stay open until the server's
    stop cancels it, which would hold the stop for its grace period and end
    the watch UNAVAILABLE; and List (newer health clients call it), which
    grpcio leaves unimplemented, answers."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, Status] = {}  # as set, by service (grpcio's keeps its own)
        self._changed = asyncio.Condition()
        self._closing = False

    async def set(self, service: str, status: Status) -> None:
        await super().set(service, status)
        if not self._closing:
            await self._tell(lambda: self._statuses.__setitem__(service, status))

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()

        def close() -> None:
            self._closing = True
            self._statuses.update(dict.fromkeys(self._statuses, NOT_SERVING))

        await self._tell(close)

    async def _tell(self, change: Callable[[], None]) -> None:
        async with self._changed:
            change()
            self._changed.notify_all()

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self._statuses:
            names = ", ".join(repr(name) for name in self._statuses) or "none yet"
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {request.service!r}; this worker reports {names}",
            )
        return await super().Check(request, context)

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            service: health_pb2.HealthCheckResponse(status=status)
            for service, status in self._statuses.items()
        })  # fmt: skip

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        sent = None
        while True:
            # (Written outside the lock: a watcher slow to read holds up no one.)
            async with self._changed:
                await self._changed.wait_for(
                    lambda last=sent: self._closing or self._status(request.service) != last
                )
                status, closing = self._status(request.service), self._closing
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
            if closing:
                return

    def _status(self, service: str) -> Status:
        return self._statuses.get(service, SERVICE_UNKNOWN)


def add_to_server(servicer: HealthServicer, server: grpc.aio.Server) -> None:
    """`servicer` as grpc.health.v1.Health, each method parsing its request
    itself: grpcio's registration answers bytes that do not parse with
    UNKNOWN and an exception's name, which tells a prober nothing."""
    check, listed = health_pb2.HealthCheckRequest, health_pb2.HealthListRequest
    reply = health_pb2.HealthCheckResponse.SerializeToString
    methods = {
        "Check": grpc.unary_unary_rpc_method_handler(
            _parsing(servicer.Check, check), response_serializer=reply
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            _parsing(servicer.Watch, check), response_serializer=reply
        ),
        "List": grpc.unary_unary_rpc_method_handler(
            _parsing(servicer.List, listed),
            response_serializer=health_pb2.HealthListResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(health.SERVICE_NAME, methods),)
    )


def _parsing(method: Callable, cls: type[message.Message]) -> Callable:
    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = cls.FromString(raw)
        except message.DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                unparsable(cls, exc, "grpc/health/v1/health.proto"),
            )
        return await method(request, context)

    return handler
