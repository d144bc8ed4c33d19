"""Connections as production gRPC clients hold them: keepalive pings, reflection."""

from __future__ import annotations

import time

import grpc

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.grpc_stubs import mlx_engine_pb2_grpc

from helpers import collect, prompt, request

# A client that pings every PING_MS while no data comes (gRPC's client makes
# that a second at least): gRPC servers' default takes more than one ping in
# five minutes without data as misbehaviour, and closes the connection after
# the third, some five seconds in.
PING_MS = 1000
KEEPALIVE = [
    ("grpc.keepalive_time_ms", PING_MS),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def test_clients_that_ping_to_keep_their_connection_are_not_cut_off(start_worker, model_dir):
    """A non-streamed answer sends nothing until it is whole (nor does a long
    prompt before its first token), and a client's keepalive pings go on
    meanwhile: the call completes, and the connection stays up while idle,
    rather than ending UNAVAILABLE ("Too many pings") with the work lost."""
    w = start_worker(model_dir)
    channel = grpc.insecure_channel(f"127.0.0.1:{w.worker.port}", options=KEEPALIVE)
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append, try_to_connect=True)
    stub = mlx_engine_pb2_grpc.MlxEngineStub(channel)
    try:
        started = time.monotonic()
        whole = request(prompt(8), stream=False, max_tokens=1900, ignore_eos=True)
        answer = collect(stub.Generate(whole, timeout=120))
        assert answer.complete.finish_reason == "length"
        time.sleep(max(0.0, 8 - (time.monotonic() - started)))  # idle, pinging
        stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        ready = states.index(grpc.ChannelConnectivity.READY)
        assert states[ready:] == [grpc.ChannelConnectivity.READY], states  # never dropped
    finally:
        channel.close()


def test_reflection_answers_under_its_stable_name_and_its_old_one(start_worker, model_dir):
    """Tools that ask grpc.reflection.v1 (as newer grpcurl and Postman do first)
    and those that ask v1alpha both learn the worker's services."""
    from grpc_reflection.v1alpha import reflection_pb2

    w = start_worker(model_dir)
    with grpc.insecure_channel(f"127.0.0.1:{w.worker.port}") as channel:
        for version in ("v1", "v1alpha"):
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            asked = reflection_pb2.ServerReflectionRequest(list_services="")
            (answer,) = list(call(iter([asked]), timeout=10))
            names = {s.name for s in answer.list_services_response.service}
            assert {"mlx.grpc.engine.MlxEngine", "grpc.health.v1.Health"} <= names, version
