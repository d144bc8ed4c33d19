"""`smg-mlx health`: an exec probe that exits 0 only while a worker reports SERVING.

grpcurl exits 0 on any answer, NOT_SERVING included, so supervisors without
gRPC probes need a command whose exit code is the verdict.
"""

from __future__ import annotations

import signal
import socket
import ssl
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smg_mlx.logs import host_port, one_line
from smg_mlx.stop_signals import stop_signals

SERVING = health_pb2.HealthCheckResponse.SERVING
# A probe asks a worker on its own host or pod: never through http_proxy or
# grpc_proxy, which a unit may set for its model downloads.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def probe(host: str, port: int, timeout: float, tls_ca: Path | None = None) -> str | None:
    """None when the worker at host:port reports SERVING, else why not, in one line."""
    target = host_port(host, port)
    try:
        status = _check(target, timeout, tls_ca)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"{target} did not answer within {timeout:g}s"
        details = one_line(exc.details() or "")
        tls = _speaks_tls(host, port, timeout)
        if tls is True and tls_ca is None:
            # gRPC says no more than "Socket closed" of a plaintext call to it.
            return f"{target} serves TLS: pass --tls-ca with the certificate to trust"
        if tls is False and tls_ca is not None:
            if _answers_grpc(target, timeout):
                return f"{target} serves plaintext: leave out --tls-ca"
            return f"{target} answers neither TLS nor gRPC (is {port} a worker's --port?)"
        if tls is True:  # and the handshake failed: gRPC's words name no certificate
            if "certificate has expired" in details:
                return (
                    f"cannot check {target}: its certificate has expired: renew the "
                    f"worker's --tls-cert ({exc.code().name}: {details})"
                )
            return (
                f"cannot check {target}: its certificate is not one --tls-ca {tls_ca} "
                f"trusts for {host} ({exc.code().name}: {details})"
            )
        said = f"cannot check {target}: {exc.code().name}: {details}"
        return said + ("" if _grpc_answered(exc) else f" (is {port} a worker's --port?)")
    if status == SERVING:
        return None
    return f"{target} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"


def _check(target: str, timeout: float, tls_ca: Path | None) -> int:
    """The status the health service at `target` reports (grpc.RpcError: none)."""
    if tls_ca is None:
        channel = grpc.insecure_channel(target, CHANNEL_OPTIONS)
    else:
        trust = grpc.ssl_channel_credentials(tls_ca.read_bytes())
        channel = grpc.secure_channel(target, trust, CHANNEL_OPTIONS)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status


def _grpc_answered(exc: grpc.RpcError) -> bool:
    """Whether a failed call was answered in gRPC: not where an HTTP server (the
    router's, the metrics port) answered instead."""
    return exc.code() != grpc.StatusCode.UNIMPLEMENTED and "HTTP/2" not in (exc.details() or "")


def _answers_grpc(target: str, timeout: float) -> bool:
    """Whether `target` answers a plaintext health check in gRPC."""
    try:
        _check(target, timeout, None)
    except grpc.RpcError as exc:
        return _grpc_answered(exc)
    return True


def _speaks_tls(host: str, port: int, timeout: float) -> bool | None:
    """Whether host:port answers a TLS handshake (its certificate unchecked);
    None where nothing accepts the connection."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        raw = socket.create_connection((host, port), timeout)
    except OSError:
        return None
    with raw:
        try:
            with context.wrap_socket(raw):
                return True
        except OSError:  # closed, or not TLS (ssl.SSLError is one)
            return False


def main(host: str, port: int, timeout: float, tls_ca: Path | None) -> int:
    """Print SERVING and return 0, or print the reason to stderr and return 1
    (2: the probe itself is told wrong, which no restart of the worker cures)."""
    for sig in stop_signals():  # stopped before an answer: no verdict, so not 0
        signal.signal(sig, _interrupted)
    if tls_ca is not None:
        try:
            pem = tls_ca.read_bytes()
        except OSError as exc:
            print(f"--tls-ca {tls_ca}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        if b"-----BEGIN CERTIFICATE-----" not in pem:
            print(f"--tls-ca {tls_ca} holds no PEM certificate: give the certificate the "
                  "worker serves (its --tls-cert), not a key", file=sys.stderr)  # fmt: skip
            return 2
    reason = probe(host, port, timeout, tls_ca)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    print("SERVING")
    return 0


def _interrupted(signum: int, frame: object) -> None:
    print(f"stopped by {signal.Signals(signum).name} before an answer", file=sys.stderr)
    raise SystemExit(1)
