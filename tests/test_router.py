"""End to end through the real SMG router (`smg launch`), OpenAI API in front of the worker."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.workers import free_port

from conftest import RunningWorker, worker_config
from docs import OPERATIONS, section, table
from helpers import SMG, Router, wait_until

pytestmark = pytest.mark.skipif(SMG is None, reason="the router (pip install smg) is not installed")


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    worker = RunningWorker(worker_config(model_dir))
    router = Router([worker.worker.port], model_dir, tmp_path_factory.mktemp("router") / "smg.log")
    assert wait_until(router.worker_healthy, 30)
    # (and has fetched its tokenizer: until then it answers 503, and no test asks for that)
    router.complete({"model": NAME, "prompt": "Hi", "max_tokens": 1, **GREEDY})
    yield worker, router
    router.stop()
    worker.stop()


NAME = "tiny-llama3"
GREEDY = {"temperature": 0, "ignore_eos": True}


def test_models_lists_the_served_name(stack):
    _, router = stack
    assert [m["id"] for m in router.get("/v1/models")["data"]] == [NAME]


def test_completion_counts_and_usage(stack):
    _, router = stack
    r = router.post(
        "/v1/completions", {"model": NAME, "prompt": "Hello world", "max_tokens": 7, **GREEDY}
    )
    usage = r["usage"]
    assert usage["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
    # The worker counted the same prompt tokens the model's tokenizer makes.
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(stack[0].worker.model_dir).encode("Hello world")
    assert usage["prompt_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_streaming_completion(stack):
    _, router = stack
    events = router.stream(
        "/v1/completions", {"model": NAME, "prompt": "Hello world", "max_tokens": 9, **GREEDY}
    )
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 9
    whole = router.post(
        "/v1/completions", {"model": NAME, "prompt": "Hello world", "max_tokens": 9, **GREEDY}
    )
    assert text == whole["choices"][0]["text"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion(stack, stream):
    _, router = stack
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 6,
        **GREEDY,
    }
    if stream:
        events = router.stream("/v1/chat/completions", body)
        usage = events[-1]["usage"]
        finish = [
            c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")
        ]
    else:
        r = router.post("/v1/chat/completions", body)
        usage, finish = r["usage"], [r["choices"][0]["finish_reason"]]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 3
    assert finish == ["length"]


def test_a_repeated_chat_reports_cached_tokens(stack):
    _, router = stack
    body = {
        "model": NAME,
        "messages": [
            {"role": "user", "content": "How are you today, fox? Tell me how the hounds are."}
        ],
        "max_tokens": 5,
        **GREEDY,
    }
    first = router.post("/v1/chat/completions", body)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 16  # long enough to be worth reusing
    # The chat template's opening, shared with earlier chats, is too short to reuse.
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = router.post("/v1/chat/completions", body)
    # The whole prompt but its last token, which is prefilled for the first logits.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    streamed = router.stream("/v1/chat/completions", body)[-1]["usage"]
    assert streamed["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
# A request for each row of docs/operations.md's table of what the router refuses.
REFUSED = {
    "`stop` strings (chat and completions)": ("/v1/chat/completions", {**CHAT, "stop": ["a"]}),
    "`n` > 1": ("/v1/chat/completions", {**CHAT, "n": 2}),
    "`response_format` (`json_object`, `json_schema`)": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}},
    ),
    "images in a chat message": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, IMAGE]}]},
    ),
    "`/v1/embeddings`": ("/v1/embeddings", {"model": NAME, "input": "Hi"}),
}


def test_the_router_refuses_what_the_docs_say_it_refuses(stack):
    _, router = stack
    rows = {row[0]: row[1] for row in table(section(OPERATIONS, "## Router behaviour to know"))}
    assert set(REFUSED) <= set(rows)
    for row, (path, body) in REFUSED.items():
        status, said = re.match(r"(\d+)[^`]*`([^`]*)`", rows[row]).groups()
        with pytest.raises(urllib.error.HTTPError) as refused:
            router.post(path, body)
        assert (refused.value.code, said in refused.value.msg) == (int(status), True), row
    assert rows["`stop_token_ids`"] == "works"
    assert router.post("/v1/chat/completions", {**CHAT, "stop_token_ids": [5]})["choices"]


def test_temperature_zero_is_repeatable(stack):
    _, router = stack
    body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 12, **GREEDY}
    texts = {router.post("/v1/completions", body)["choices"][0]["text"] for _ in range(2)}
    assert len(texts) == 1


def test_stop_token_id_ends_with_stop(stack):
    worker, router = stack
    from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

    body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 12, **GREEDY}
    free = router.post("/v1/completions", body)
    assert free["usage"]["completion_tokens"] == 12
    # Ask the worker for the token ids behind that text, then stop on the fourth.
    ids = [
        t
        for r in worker.stub.Generate(
            pb.GenerateRequest(
                text="The quick brown fox",
                stream=False,
                sampling_params=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            )
        )
        for t in r.complete.output_ids
    ]
    stop = ids[3]
    r = router.post("/v1/completions", {**body, "stop_token_ids": [stop]})
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == ids.index(stop) + 1


def test_client_disconnect_makes_the_router_abort(stack):
    worker, router = stack
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 1900, "stream": True, **GREEDY}
    sock = socket.create_connection(("127.0.0.1", router.port))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    assert sock.recv(4096)  # the stream has started
    assert wait_until(lambda: worker.active_requests() == 1, 5)
    sock.close()
    left = time.monotonic()
    assert wait_until(lambda: worker.active_requests() == 0, 5)
    assert time.monotonic() - left < 1.0
    assert worker.worker.engine.running == 0


def test_thirty_two_concurrent_chat_streams(stack):
    worker, router = stack

    def chat(i: int) -> int:
        events = router.stream(
            "/v1/chat/completions",
            {
                "model": NAME,
                "messages": [{"role": "user", "content": f"Question number {i}"}],
                "max_tokens": 16,
                **GREEDY,
            },
        )
        return events[-1]["usage"]["completion_tokens"]

    with ThreadPoolExecutor(32) as pool:
        assert list(pool.map(chat, range(32))) == [16] * 32
    assert worker.active_requests() == 0


def test_router_sees_the_worker_healthy_only_when_ready(model_dir, tmp_path, monkeypatch):
    from smg_mlx.engine.batch.batch import Batch

    release = threading.Event()
    load = Batch.__init__

    def slow_load(self, *args):
        release.wait(60)  # hold the engine in its loading phase
        load(self, *args)

    monkeypatch.setattr(Batch, "__init__", slow_load)
    port = free_port()
    holder = {}
    starting = threading.Thread(
        target=lambda: holder.update(w=RunningWorker(worker_config(model_dir, port=port)))
    )
    starting.start()
    # The router's own health checking, as the README's Quick start runs it (a
    # check a minute), but looking again every second for a worker to register.
    quick_start = ["--health-check-interval-secs", "60", "--health-failure-threshold", "3"]
    quick_start += ["--health-success-threshold", "2", "--worker-startup-check-interval", "1"]
    router = Router([port], model_dir, tmp_path / "smg.log", *quick_start)
    try:
        # The worker listens, and answers HealthCheck with UNAVAILABLE while it
        # loads: smg 1.13.0 registers a worker, healthy, once that call succeeds
        # (whatever it answers), and would then route to it for a minute.
        end = time.monotonic() + 5
        while time.monotonic() < end:
            assert not router.worker_healthy()  # None: not registered yet
            time.sleep(0.1)
        release.set()
        starting.join(60)
        assert wait_until(router.worker_healthy, 30)
        body = {"model": NAME, "prompt": "Hi", "max_tokens": 3, **GREEDY}
        assert router.complete(body, 10)["usage"]["completion_tokens"] == 3
    finally:
        release.set()
        router.stop()
        if "w" in holder:
            holder["w"].stop()
