"""Prometheus metrics and per-request log lines move by what the requests did."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.workers import free_port
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.logs import JsonFormatter

from helpers import generate, prompt, request, wait_until


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture
def metered(start_worker, model_dir):
    port = free_port()
    return start_worker(model_dir, metrics_port=port), port


def test_only_the_metrics_path_answers(metered):
    _, port = metered
    assert ("smg_mlx_memory_budget_bytes", ()) in scrape(port)
    for path in ("/", "/metricsx", "/health", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
        assert err.value.code == 404, path
    # An uptime check's HEAD: the headers GET has, the body's length among them, no body.
    head = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD")
    with urllib.request.urlopen(head, timeout=5) as answer:
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
        assert int(answer.headers["Content-Length"]) > 1000
        assert answer.read() == b""


def test_connections_reset_before_their_request_print_nothing(metered, capfd):
    """As a load balancer's TCP check or a port scan does."""
    _, port = metered
    for _ in range(3):
        probe = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.05)  # accepted, its handler reading the request
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        probe.close()  # a reset
    time.sleep(0.5)
    assert ("smg_mlx_memory_budget_bytes", ()) in scrape(port)
    assert "Traceback" not in capfd.readouterr().err


def test_counters_move_by_what_requests_did(metered):
    w, port = metered
    before = scrape(port)
    sizes = [(5, 7), (12, 3), (30, 10)]  # (prompt tokens, generated tokens)
    for i, (p, n) in enumerate(sizes):
        generate(w.stub, prompt(p, i), max_tokens=n, ignore_eos=True)
    with pytest.raises(grpc.RpcError):
        generate(w.stub, [])
    call = w.stub.Generate(request(prompt(4), request_id="gone", max_tokens=1900), timeout=60)
    first = next(call)
    w.stub.Abort(pb.AbortRequest(request_ids=["gone"]))
    aborted = len(first.chunk.token_ids) + sum(len(r.chunk.token_ids) for r in call)
    assert wait_until(lambda: w.active_requests() == 0)
    after = scrape(port)

    def m(name, **labels):
        return moved(before, after, name, **labels)

    assert m("smg_mlx_requests_total", finish_reason="length") == 3
    assert m("smg_mlx_requests_total", finish_reason="abort") == 1
    assert m("smg_mlx_grpc_requests_total", method="Generate", code="OK") == 4
    assert m("smg_mlx_grpc_requests_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert m("smg_mlx_grpc_requests_total", method="Abort", code="OK") == 1
    assert m("smg_mlx_prompt_tokens_total") == sum(p for p, _ in sizes) + 4
    assert m("smg_mlx_generation_tokens_total") == sum(n for _, n in sizes) + aborted
    assert m("smg_mlx_time_to_first_token_seconds_count") == 4
    assert m("smg_mlx_queue_wait_seconds_count") == 4  # arrival to start in the batch
    assert m("smg_mlx_request_duration_seconds_count") == 4
    # One gap between each pair of consecutive tokens of a request.
    gaps = sum(n - 1 for _, n in sizes) + aborted - 1
    assert m("smg_mlx_inter_token_latency_seconds_count") == gaps
    assert m("smg_mlx_inter_token_latency_seconds_sum") > 0
    steps = m("smg_mlx_engine_step_duration_seconds_count")
    assert steps >= max(n for _, n in sizes)
    assert m("smg_mlx_engine_batch_size_count") == steps
    assert after[("smg_mlx_model_load_seconds", ())] > 0


def test_running_and_queued_gauges(start_worker, model_dir):
    port = free_port()
    w = start_worker(model_dir, metrics_port=port, completion_batch_size=1, prefill_batch_size=1)
    calls = [w.stub.Generate(request(prompt(4, i), max_tokens=1900), timeout=60) for i in range(3)]
    assert wait_until(lambda: w.active_requests() == 3)

    def gauges() -> tuple[float, float]:
        now = scrape(port)
        return now[("smg_mlx_running_requests", ())], now[("smg_mlx_queued_requests", ())]

    # The engine updates its count at its next step; then one runs and two wait.
    assert wait_until(lambda: gauges() == (1, 2)), gauges()
    assert scrape(port)[("smg_mlx_prefilling_requests", ())] == 0
    # GetServerInfo's headers say the same (its message has no fields for them).
    _, call = w.stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
    headers = dict(call.initial_metadata())
    assert (headers["running-requests"], headers["waiting-requests"]) == ("1", "2")
    assert headers["prefilling-requests"] == "0"
    for c in calls:
        c.cancel()
    assert wait_until(lambda: scrape(port)[("smg_mlx_running_requests", ())] == 0)
    assert scrape(port)[("smg_mlx_requests_total", (("finish_reason", "cancelled"),))] == 3


def test_metrics_port_in_use_is_a_clear_start_up_error(refused, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refusal = refused(model_dir, metrics_port=port)
        assert refusal.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is in use" in str(refusal)
    assert "choose another --metrics-port" in str(refusal)


def test_one_log_line_per_request_with_its_id_and_counts(worker, caplog):
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        generate(worker.stub, prompt(9), request_id="req-42", max_tokens=6, ignore_eos=True)
        assert wait_until(lambda: any("req-42" in r.getMessage() for r in caplog.records))
    lines = [r for r in caplog.records if "req-42" in r.getMessage()]
    assert len(lines) == 1
    text = lines[0].getMessage()
    for part in (
        "request_id=req-42",
        "prompt_tokens=9",
        "completion_tokens=6",
        "finish_reason=length",
    ):
        assert part in text
    entry = json.loads(JsonFormatter().format(lines[0]))
    assert entry["request_id"] == "req-42"
    # An id with spaces or quotes is quoted, so that key=value parsers keep it whole.
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        generate(worker.stub, prompt(3), request_id='id 🙂 "x"=1', max_tokens=1)
        assert wait_until(lambda: any("🙂" in r.getMessage() for r in caplog.records))
    spaced = next(r.getMessage() for r in caplog.records if "🙂" in r.getMessage())
    assert 'request_id="id 🙂 \\"x\\"=1" prompt_tokens=3' in spaced
    assert entry["prompt_tokens"] == 9 and entry["completion_tokens"] == 6
    assert entry["cached_tokens"] == 0 and entry["finish_reason"] == "length"
    assert entry["ttft_ms"] >= 0 and entry["duration_ms"] >= entry["ttft_ms"]


def test_a_refused_request_logs_what_the_client_was_told(worker, caplog):
    # (Its client may log nothing: the operator finds the misbehaving one here.)
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        with pytest.raises(grpc.RpcError) as err:
            generate(worker.stub, prompt(5), temperature=-1.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wait_until(lambda: any("refused" in r.getMessage() for r in caplog.records))
    (line,) = [r for r in caplog.records if "refused" in r.getMessage()]
    text = line.getMessage()
    assert "request refused method=Generate status=INVALID_ARGUMENT details=" in text
    assert err.value.details() in json.loads(JsonFormatter().format(line))["details"]
    # A stream its deadline ended is not a refusal.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        with pytest.raises(grpc.RpcError) as err:
            list(worker.stub.Generate(request(prompt(5), max_tokens=400, ignore_eos=True),
                                      timeout=0.05))  # fmt: skip
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(lambda: any("request done" in r.getMessage() for r in caplog.records))
    assert not any("refused" in r.getMessage() for r in caplog.records)


def test_json_log_format_flag(spawn, model_dir):
    p = spawn("--model", str(model_dir), "--log-format", "json")
    p.wait_serving()
    generate(p.stub, prompt(3), request_id="json-1", max_tokens=2, ignore_eos=True)
    p.stop()
    entries = [json.loads(line) for line in p.log.read_text().splitlines() if line.startswith("{")]
    assert any(e.get("request_id") == "json-1" and e["completion_tokens"] == 2 for e in entries)
    assert any("SERVING" in e["message"] for e in entries)


def test_deadline_and_cancel_are_told_apart(metered):
    w, port = metered
    before = scrape(port)
    with pytest.raises(grpc.RpcError):
        list(w.stub.Generate(request(prompt(4), max_tokens=1900), timeout=0.3))
    call = w.stub.Generate(request(prompt(4), max_tokens=1900), timeout=60)
    next(call)
    call.cancel()
    assert wait_until(lambda: w.active_requests() == 0)

    def code_moved(code: str) -> float:
        return moved(
            before, scrape(port), "smg_mlx_grpc_requests_total", method="Generate", code=code
        )

    assert wait_until(lambda: code_moved("DEADLINE_EXCEEDED") == 1)
    assert wait_until(lambda: code_moved("CANCELLED") == 1)
    assert moved(before, scrape(port), "smg_mlx_requests_total", finish_reason="cancelled") == 2


def test_a_response_the_client_never_got_is_not_a_success(metered, monkeypatch, caplog):
    """The client leaves once its request has finished, while the response is
    being built (megabytes for a long one with logprobs): counted and logged
    as undelivered, never as the finish reason the client did not see."""
    w, port = metered
    servicer = w.worker.servicer
    building = threading.Event()

    async def slow_complete(job, streamed):
        building.set()
        await asyncio.sleep(60)  # the client leaves meanwhile

    monkeypatch.setattr(servicer, "_complete", slow_complete)
    before = scrape(port)
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        call = w.stub.Generate(
            request(prompt(4), request_id="gone", max_tokens=3, stream=False), timeout=60
        )
        assert building.wait(30)
        call.cancel()
        assert wait_until(lambda: any("gone" in r.getMessage() for r in caplog.records))
    after = scrape(port)
    assert moved(before, after, "smg_mlx_requests_total", finish_reason="undelivered") == 1
    assert moved(before, after, "smg_mlx_requests_total", finish_reason="length") == 0
    assert moved(before, after, "smg_mlx_grpc_requests_total", method="Generate", code="OK") == 0
    line = next(r.getMessage() for r in caplog.records if "gone" in r.getMessage())
    assert "completion_tokens=3 " in line and "finish_reason=undelivered" in line


def test_a_client_that_stops_reading_once_it_has_the_last_message_got_it(metered, caplog):
    """A client may stop reading once it has the final message (GenerateComplete)
    rather than wait for the stream's end; gRPC then ends the call before it
    asks the worker for anything more. The message was sent: the request counts
    by its finish reason, not as undelivered (it did in 1 of 30 such calls)."""
    w, port = metered
    servicer = w.worker.servicer

    class Context:
        async def abort(self, code, details):
            raise AssertionError(f"{code}: {details}")

    async def read_the_last_message_and_leave() -> object:
        call = servicer.Generate(
            request(prompt(4), request_id="read", max_tokens=3, stream=False), Context()
        )
        last = await call.__anext__()  # (not streamed: the one message)
        await call.aclose()  # as gRPC closes it when the client has gone
        return last

    before = scrape(port)
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        assert w.call(read_the_last_message_and_leave())
    after = scrape(port)
    assert moved(before, after, "smg_mlx_requests_total", finish_reason="length") == 1
    assert moved(before, after, "smg_mlx_requests_total", finish_reason="undelivered") == 0
    line = next(r.getMessage() for r in caplog.records if "read" in r.getMessage())
    assert "finish_reason=length" in line


def test_prefix_cache_metrics_and_log(metered, caplog):
    w, port = metered
    before = scrape(port)
    ids = prompt(40, 77)
    generate(w.stub, ids, max_tokens=4, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="smg_mlx.requests"):
        again = generate(w.stub, ids, request_id="again", max_tokens=4, ignore_eos=True)
        assert wait_until(lambda: any("again" in r.getMessage() for r in caplog.records))
    assert again.complete.cached_tokens == 39
    after = scrape(port)
    assert moved(before, after, "smg_mlx_prefix_cache_hits_total") == 1
    assert moved(before, after, "smg_mlx_prefix_cache_hit_tokens_total") == 39
    assert after[("smg_mlx_prefix_cache_bytes", ())] > 0
    line = next(r for r in caplog.records if "again" in r.getMessage())
    assert "cached_tokens=39" in line.getMessage()


FORGED = "ok\n2026-01-01 00:00:00,000 ERROR smg_mlx.server: engine failure: FORGED\u2028LINE"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_request_id_cannot_forge_log_lines(spawn, model_dir, log_format):
    p = spawn("--model", str(model_dir), "--log-format", log_format)
    p.wait_serving()
    generate(p.stub, prompt(3), request_id=FORGED, max_tokens=2)
    generate(p.stub, prompt(3), request_id="long-" + "x" * 5000, max_tokens=2)
    p.stop()
    lines = p.log.read_text().splitlines()
    assert not any(line.startswith("2026-01-01") or "LINE" == line[:4] for line in lines)
    request_lines = [line for line in lines if "FORGED" in line]
    assert len(request_lines) == 1
    if log_format == "json":
        assert json.loads(request_lines[0])["request_id"] == FORGED
    else:
        assert 'request_id="ok\\n2026-01-01' in request_lines[0]  # quoted: it holds spaces
    long_line = next(line for line in lines if "long-" in line)
    assert "x" * 200 not in long_line and "(5005 characters)" in long_line


def test_the_serving_mode_is_a_short_name_and_the_log_says_what_it_means(
    start_worker, model_dir, caplog
):
    caplog.set_level(logging.INFO, "smg_mlx.engine.start_up")
    port = free_port()
    w = start_worker(model_dir, metrics_port=port, batching="equal-lengths")
    assert scrape(port)[("smg_mlx_serving_mode", (("mode", "equal-lengths"),))] == 1
    _, call = w.stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
    assert dict(call.initial_metadata())["serving-mode"] == "equal-lengths"
    assert (
        "serving equal-lengths, which is slower than batched: prompts prefill together only "
        "at equal lengths, since --batching asks for it"
    ) in caplog.text


def test_no_speculation_counters_where_speculation_is_off(start_worker, model_dir):
    """--speculative off (the default): zeros labelled prompt_lookup would read as
    speculation on and never paying; a gauge says it is off."""
    port = free_port()
    start_worker(model_dir, metrics_port=port)
    assert _speculative(scrape(port)) == SPECULATION_OFF


# What a worker that does not speculate exports of speculation: a gauge saying so.
SPECULATION_OFF = {("smg_mlx_speculative_decoding", (("drafter", "off"),)): 1}


def _speculative(scraped: dict) -> dict:
    """The series of speculation: none but the gauge saying what proposes tokens."""
    assert any(name == "smg_mlx_memory_budget_bytes" for name, _ in scraped)
    return {k: v for k, v in scraped.items() if k[0].startswith("smg_mlx_speculative_")}


def test_no_speculation_counters_where_the_model_cannot_speculate(start_worker, family_model):
    """--speculative always on a model whose caches cannot take tokens back
    (a sliding window): the worker serves without speculation, and says so
    in its log; no counter reads as speculation on."""
    port = free_port()
    w = start_worker(family_model("gemma3_text"), metrics_port=port, speculative="always")
    for _ in range(2):  # from the start, and after a request
        assert _speculative(scrape(port)) == SPECULATION_OFF
        generate(w.stub, prompt(20, 1), max_tokens=4)
        assert wait_until(lambda: w.worker.engine.speculation.drafter == "")


def test_speculation_counters_name_the_drafter_from_the_start(start_worker, model_dir):
    """Before any request the counters read 0, labelled with what proposes."""
    port = free_port()
    start_worker(model_dir, metrics_port=port, draft_model=model_dir, speculative="auto")
    series = _speculative(scrape(port))
    assert series.pop(("smg_mlx_speculative_decoding", (("drafter", "draft_model"),))) == 1
    assert len(series) == 4 and not any(series.values())
    assert {labels for _, labels in series} == {(("drafter", "draft_model"),)}


def test_speculation_counters_move_by_what_was_proposed_and_kept(start_worker, model_dir):
    port = free_port()
    w = start_worker(model_dir, metrics_port=port, speculative="always")
    before = scrape(port)
    assert before[("smg_mlx_speculative_passes_total", (("drafter", "prompt_lookup"),))] == 0
    for i, n in enumerate((30, 90)):  # prompts that repeat themselves: lookups find proposals
        generate(w.stub, (prompt(n, i)[:7] * 40)[:n], max_tokens=40, ignore_eos=True)
    after = scrape(port)

    def m(name):
        return moved(before, after, f"smg_mlx_speculative_{name}_total", drafter="prompt_lookup")

    s = w.worker.engine.speculation
    assert 0 < m("accepted_tokens") == s.accepted <= m("proposed_tokens") == s.proposed
    # A checking pass returns a token a row and the proposals it kept.
    assert 0 < m("passes") == s.passes < m("pass_tokens") == s.tokens
