"""grpc.health.v1's servicer, with a refusal that names the services a worker reports."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    """grpcio's, but a Check of a service this worker does not report says which
    it does, instead of a bare NOT_FOUND."""

    def __init__(self) -> None:
        super().__init__()
        self._names: list[str] = []

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        if service not in self._names:
            self._names.append(service)
        await super().set(service, status)

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self._names:
            names = ", ".join(repr(name) for name in self._names) or "none yet"
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {request.service!r}; this worker reports {names}",
            )
        return await super().Check(request, context)
