"""Prometheus metrics of one worker, served on `--metrics-port`.

Everything is recorded on the event loop: per request when it ends, per step
from the one callback that already carries a step's tokens. The engine thread
only times its step, so metrics cost it nothing measurable.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.utils import floatToGoString

from smg_mlx.api.jobs import Job
from smg_mlx.engine.core import MAX_FAILED_STEPS_IN_A_ROW
from smg_mlx.engine.types import CacheStats, Memory, SpeculationStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """The worker's instruments, in a registry of its own."""

    def __init__(
        self,
        *,
        active: Callable[[], int],
        running: Callable[[], int],
        prefilling: Callable[[], int],
        memory: Callable[[], Memory | None],
        cache: Callable[[], CacheStats],
        speculation: Callable[[], SpeculationStats] | None = None,
    ) -> None:
        """`speculation`: its counts, None where --speculative is off (none exported)."""
        self.registry = registry = CollectorRegistry()
        registry.register(_CacheCollector(cache))
        if speculation is not None:
            registry.register(_SpeculationCollector(speculation))

        def metric(kind: type, name: str, doc: str, **options: object) -> Any:
            # Every name gets the smg_mlx_ prefix.
            return kind("smg_mlx_" + name, doc, registry=registry, **options)

        self.requests = metric(
            Counter,
            "requests",
            "Generate requests that ended, by finish reason (stop, length, abort; "
            "cancelled: the client left or its deadline passed; undelivered: finished, but "
            "the client was gone before its last message; shutdown: turned away at a stop, "
            "for another worker; error: the engine failed)",
            labelnames=["finish_reason"],
        )
        self.rpcs = metric(
            Counter,
            "grpc_requests",
            "RPCs that ended, by method and gRPC status code",
            labelnames=["method", "code"],
        )
        metric(Gauge, "running_requests", "Requests being prefilled or decoded").set_function(
            running
        )
        metric(Gauge, "queued_requests", "Requests accepted but not yet in the batch").set_function(
            lambda: max(active() - running(), 0)
        )
        metric(
            Gauge, "prefilling_requests", "Requests in the batch whose prompt is being prefilled"
        ).set_function(prefilling)
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of ended requests")
        self.generated_tokens = metric(Counter, "generation_tokens", "Tokens generated")
        self.cached_tokens = metric(
            Counter,
            "prefix_cache_hit_tokens",
            "Prompt tokens reused from the prefix cache instead of prefilled",
        )
        self.cache_hits = metric(
            Counter, "prefix_cache_hits", "Requests that started from a cached prefix"
        )

        def memory_gauge(name: str, doc: str, field: str) -> None:
            metric(Gauge, name, doc).set_function(
                lambda: getattr(memory(), field) if memory() is not None else 0
            )

        memory_gauge(
            "prefix_cache_bytes", "Bytes of KV cache held by the prefix cache", "prefix_cache"
        )
        memory_gauge("memory_budget_bytes", "The memory budget the engine keeps", "budget")
        memory_gauge("memory_weights_bytes", "Memory the loaded model takes", "weights")
        memory_gauge("memory_kv_bytes", "KV caches of the running batch", "kv")
        memory_gauge(
            "memory_kv_bytes_per_token",
            "What one token's keys and values take as stored (less with --kv-bits)",
            "kv_per_token",
        )
        memory_gauge(
            "memory_prefill_bytes", "Estimated working set of the last prefill step", "prefill"
        )
        memory_gauge("memory_active_bytes", "All memory MLX has allocated now", "active")
        memory_gauge("memory_peak_bytes", "The most MLX has had allocated while serving", "peak")
        memory_gauge(
            "queued_for_memory_requests", "Requests waiting for memory", "waiting_for_memory"
        )
        memory_gauge(
            "out_of_memory_steps",
            "Steps that ran out of memory since start (their requests were put back)",
            "out_of_memory_steps",
        )
        self.serving_mode = metric(
            Gauge, "serving_mode", "How requests are batched (1 for the mode the model is "
            "served in; other than batched is slower: docs/serving.md, Model families)",
            labelnames=["mode"],
        )  # fmt: skip
        self.kv_format = metric(
            Gauge, "kv_cache_format", "How the KV caches are stored (1 for the format served: "
            "unquantized, or --kv-bits and --kv-group-size, e.g. '8-bit KV, group 64'; as "
            "GetServerInfo's kv-format header says)", labelnames=["format"],
        )  # fmt: skip
        self.speculative_drafter = metric(
            Gauge, "speculative_decoding", "What proposes tokens to check (1 for the drafter: "
            "prompt_lookup, draft_model, or off; as GetServerInfo's speculative-decoding header "
            "says)", labelnames=["drafter"],
        )  # fmt: skip
        memory_gauge(
            "failed_steps",
            "Steps that failed otherwise since start (their requests ended with INTERNAL; "
            f"the engine stops after {MAX_FAILED_STEPS_IN_A_ROW} failed steps in a row)",
            "failed_steps",
        )
        self.wait = metric(
            Histogram,
            "queue_wait_seconds",
            "From request arrival to its start in the batch (its turn, memory or a free slot)",
            buckets=TTFT_BUCKETS,
        )
        self.ttft = metric(
            Histogram,
            "time_to_first_token_seconds",
            "From request arrival to its first token",
            buckets=TTFT_BUCKETS,
        )
        self.itl = metric(
            _ManyAtOnce,
            "inter_token_latency_seconds",
            "Between consecutive tokens of one request",
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = metric(
            Histogram,
            "request_duration_seconds",
            "From request arrival to its end",
            buckets=REQUEST_BUCKETS,
        )
        self.step_seconds = metric(
            _ManyAtOnce,
            "engine_step_duration_seconds",
            "One BatchGenerator step (prefill or decode) on the engine thread",
            buckets=LATENCY_BUCKETS,
        )
        self.batch_size = metric(
            _ManyAtOnce,
            "engine_batch_size",
            "Sequences in the batch at each engine step",
            buckets=BATCH_BUCKETS,
        )
        self.model_load_seconds = metric(
            Gauge, "model_load_seconds", "Time to load and warm up the model"
        )

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics over HTTP from a background thread; any other path is
        404, so a scraper pointed at the wrong one hears so. Raises OSError."""
        metrics = make_wsgi_app(self.registry)

        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            if environ.get("PATH_INFO") == "/metrics":
                if environ.get("REQUEST_METHOD") != "HEAD":
                    return metrics(environ, start_response)
                # An uptime check's HEAD: GET's status and headers, its length
                # included, no body (prometheus_client answers it 405).
                said: list = []
                body = b"".join(metrics({**environ, "REQUEST_METHOD": "GET"},
                                        lambda *answer: said.extend(answer[:2])))  # fmt: skip
                status, headers = said
                start_response(status, [*headers, ("Content-Length", str(len(body)))])
                return []
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: the metrics are at /metrics\n"]

        class Server(ThreadingWSGIServer):
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

            def handle_error(self, request: Any, client_address: Any) -> None:
                # A connection reset or cut off mid-request (a load balancer's TCP
                # check, a port scan): no traceback on stderr for each.
                log.debug("metrics: a connection from %s failed", client_address, exc_info=True)

        server = make_server(host, port, app, Server, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()

    def rpc_ended(self, method: str, code: str) -> None:
        self.rpcs.labels(method, code).inc()

    def steps(self, seconds: list[float], batch_sizes: list[int]) -> None:
        self.step_seconds.observe_all(seconds)
        self.batch_size.observe_all(batch_sizes)

    def request_ended(self, job: Job, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(len(job.spec.prompt))
        self.generated_tokens.inc(len(job.tokens))
        if job.cached_tokens:
            self.cache_hits.inc()
            self.cached_tokens.inc(job.cached_tokens)
        if job.started_at is not None:
            self.wait.observe(job.started_at - job.arrived_at)
        if job.first_token_at is not None:
            self.ttft.observe(job.first_token_at - job.arrived_at)
        self.itl.observe_all(job.token_gaps)
        self.e2e.observe(job.ended_at - job.arrived_at)


class _ManyAtOnce:
    """A histogram that takes many values at once (a request's token gaps as it
    ends, the steps of a hand-over from the engine): prometheus_client's takes
    a lock and walks its buckets for each value, on the event loop, while the
    engine thread waits for the GIL."""

    def __init__(
        self, name: str, doc: str, *, registry: CollectorRegistry, buckets: tuple[float, ...]
    ) -> None:
        self._name, self._doc = name, doc
        registry.register(self)
        self._bounds = list(buckets)
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape reads all of one request's values or none

    def observe_all(self, values: list[float] | list[int]) -> None:
        with self._lock:
            for value in values:
                self._counts[bisect.bisect_left(self._bounds, value)] += 1
            self._sum += sum(values)

    def collect(self) -> Any:
        with self._lock:
            counts, total = list(self._counts), self._sum
        bounds = [*(floatToGoString(b) for b in self._bounds), "+Inf"]
        cumulative = list(itertools.accumulate(counts))
        yield HistogramMetricFamily(
            self._name, self._doc, buckets=list(zip(bounds, cumulative, strict=True)),
            sum_value=total,
        )  # fmt: skip


class _Quiet(WSGIRequestHandler):
    """No line on stderr per scrape."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - its signature
        pass


class _CacheCollector:
    """The prefix cache's tiers, from the engine's last report."""

    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self._stats = stats

    def collect(self) -> Any:
        s = self._stats()

        def by_tier(kind: type, name: str, doc: str, memory: float, disk: float) -> Any:
            family = kind("smg_mlx_prefix_cache_" + name, doc, labels=["tier"])
            family.add_metric(["memory"], memory)
            family.add_metric(["disk"], disk)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily("smg_mlx_prefix_cache_" + name, doc, value=value)

        yield by_tier(
            CounterMetricFamily, "served_tokens", "Prompt tokens served from each tier instead "
            "of prefilled (disk: from entries read back for the request)",
            s.memory_tokens, s.disk_tokens,
        )  # fmt: skip
        yield by_tier(GaugeMetricFamily, "entries", "Entries held in each tier",
                      s.memory_entries, s.disk_entries)  # fmt: skip
        yield by_tier(GaugeMetricFamily, "tier_bytes", "Bytes held in each tier",
                      s.memory_bytes, s.disk_bytes)  # fmt: skip
        yield by_tier(
            CounterMetricFamily, "evicted", "Entries dropped from each tier for room",
            s.memory_evicted, s.disk_evicted,
        )  # fmt: skip
        yield counter("spilled", "Entries written to disk", s.written)
        yield counter("spilled_bytes", "Bytes written to disk", s.written_bytes)
        yield counter("loaded", "Entries read back from disk", s.loaded)
        yield counter("loaded_bytes", "Bytes read back from disk", s.loaded_bytes)
        yield counter("write_seconds", "Seconds spent writing entries to disk", s.write_seconds)
        yield counter(
            "read_seconds", "Seconds spent reading entries from disk and copying them in",
            s.read_seconds,
        )  # fmt: skip
        yield counter(
            "corrupt_files", "Files that failed their checks, ignored and deleted", s.corrupt
        )


class _SpeculationCollector:
    """Speculative decoding's counts, from the engine's last report."""

    def __init__(self, stats: Callable[[], SpeculationStats]) -> None:
        self._stats = stats

    def collect(self) -> Any:
        s = self._stats()
        if not s.drafter:  # the engine found speculation could not run with this model
            return

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily("smg_mlx_speculative_" + name, doc, labels=["drafter"])
            family.add_metric([s.drafter], value)
            return family

        yield counter("proposed_tokens", "Proposed tokens checked by the model", s.proposed)
        yield counter("accepted_tokens", "Proposed tokens kept (the model agreed)", s.accepted)
        yield counter("passes", "Passes that checked proposals", s.passes)
        yield counter(
            "pass_tokens", "Tokens returned by passes that checked proposals, every "
            "stream in them counted (over passes: tokens a pass; accepted over proposed: "
            "the share of proposals kept)", s.tokens,
        )  # fmt: skip
