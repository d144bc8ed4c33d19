"""`smg-mlx health`: an exec probe that exits 0 only while a worker reports SERVING.

grpcurl exits 0 on any answer, NOT_SERVING included, so supervisors without
gRPC probes need a command whose exit code is the verdict.
"""

from __future__ import annotations

import socket
import ssl
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smg_mlx.logs import host_port, one_line

SERVING = health_pb2.HealthCheckResponse.SERVING


def probe(host: str, port: int, timeout: float, tls_ca: Path | None = None) -> str | None:
    """None when the worker at host:port reports SERVING, else why not, in one line."""
    target = host_port(host, port)
    if tls_ca is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(tls_ca.read_bytes()))
    with channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
                .status
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"{target} did not answer within {timeout:g}s"
            if tls_ca is None and _speaks_tls(host, port, timeout):
                # gRPC says no more than "Socket closed" of a plaintext call to it.
                return f"{target} serves TLS: pass --tls-ca with the certificate to trust"
            details = one_line(exc.details() or "")
            return f"cannot check {target}: {exc.code().name}: {details}"
    if status == SERVING:
        return None
    return f"{target} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether host:port answers a TLS handshake (its certificate unchecked)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout) as raw:
            with context.wrap_socket(raw):
                return True
    except OSError:  # refused, closed, or not TLS (ssl.SSLError is one)
        return False


def main(host: str, port: int, timeout: float, tls_ca: Path | None) -> int:
    """Print SERVING and return 0, or print the reason to stderr and return 1."""
    if tls_ca is not None and not tls_ca.is_file():
        print(f"{tls_ca} is not a readable file", file=sys.stderr)
        return 1
    reason = probe(host, port, timeout, tls_ca)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    print("SERVING")
    return 0
