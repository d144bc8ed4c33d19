"""Generate end to end over real gRPC, on the regression model (llama3 rope)."""

from __future__ import annotations

import asyncio
import math
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from smg_mlx.api import streaming
from smg_mlx.api.engine_client import EngineClient
from smg_mlx.api.jobs import Job
from smg_mlx.api.streaming import StreamPublisher, tokens_per_message
from smg_mlx.engine.types import (
    CacheStats,
    Event,
    GenerationSpec,
    LogitsSettings,
    Memory,
    SamplingSettings,
    SpeculationStats,
    StepReport,
)
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from helpers import generate, prompt, request


def test_sixteen_concurrent_streams_on_the_lazy_rope_model(worker, caplog):
    # The seed bug: lazily built rope frequencies evaluated on another thread
    # raise "There is no Stream(cpu, 0) in current thread" on the first step.
    with ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(lambda i: generate(worker.stub, prompt(8 + i, i), max_tokens=24), range(16))
        )
    for r in results:
        assert len(r.tokens) == 24
        assert r.complete.finish_reason == "length"
        assert r.complete.completion_tokens == 24
        assert [c.completion_tokens for c in r.chunks][-1] == 24
    assert "There is no Stream" not in caplog.text


def test_batched_output_equals_solo_output(worker):
    prompts = [prompt(3 + 9 * i, i) for i in range(16)]
    solo = [generate(worker.stub, p, max_tokens=20).tokens for p in prompts]

    def staggered(i: int) -> list[int]:
        # Later requests join a batch that is already decoding.
        responses = worker.stub.Generate(request(prompts[i], max_tokens=20 + i), timeout=60)
        return [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids][:20]

    with ThreadPoolExecutor(16) as pool:
        batched = list(pool.map(staggered, range(16)))
    assert batched == solo


def test_tokens_stream_as_they_are_made(worker):
    r = generate(worker.stub, prompt(5), max_tokens=12)
    # One chunk per step at this load, with running counts, then the final message.
    assert len(r.chunks) > 1
    assert [c.completion_tokens for c in r.chunks] == sorted(c.completion_tokens for c in r.chunks)
    assert all(c.prompt_tokens == 5 for c in r.chunks)
    assert r.complete.prompt_tokens == 5 and list(r.complete.output_ids) == []


def test_non_streaming_returns_everything_in_one_message(worker):
    streamed = generate(worker.stub, prompt(6), max_tokens=10)
    whole = generate(worker.stub, prompt(6), max_tokens=10, stream=False)
    assert whole.chunks == []
    assert list(whole.complete.output_ids) == streamed.tokens
    assert whole.complete.completion_tokens == 10


def test_seeded_sampling_is_reproducible_under_concurrency(worker):
    params = dict(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234)
    alone = generate(worker.stub, prompt(7), **params).tokens

    def noise(i: int) -> list[int]:
        return generate(worker.stub, prompt(5 + i, i), temperature=1.0, max_tokens=30).tokens

    with ThreadPoolExecutor(9) as pool:
        others = [pool.submit(noise, i) for i in range(8)]
        crowded = pool.submit(lambda: generate(worker.stub, prompt(7), **params).tokens)
        [f.result() for f in others]
    assert crowded.result() == alone
    other_seed = generate(worker.stub, prompt(7), **{**params, "seed": 99}).tokens
    assert other_seed != alone


def test_stop_token_ends_generation(worker):
    free = generate(worker.stub, prompt(9), max_tokens=12).tokens
    stop = free[4]
    r = generate(worker.stub, prompt(9), max_tokens=12, stop_token_ids=[stop])
    assert r.tokens == free[: free.index(stop) + 1]
    assert r.complete.finish_reason == "stop"
    assert r.complete.matched_stop_token_id == stop


def test_eos_stops_unless_ignore_eos(worker):
    eos = worker.stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids[0]
    forced = {eos: 100.0}
    r = generate(worker.stub, prompt(4), max_tokens=8, logit_bias=forced)
    assert r.tokens == [eos] and r.complete.finish_reason == "stop"
    assert r.complete.matched_stop_token_id == eos
    r = generate(worker.stub, prompt(4), max_tokens=8, logit_bias=forced, ignore_eos=True)
    assert r.tokens == [eos] * 8 and r.complete.finish_reason == "length"
    assert not r.complete.HasField("matched_stop_token_id")


def test_unset_max_tokens_runs_to_the_context_end(start_worker, short_model_dir):
    w = start_worker(short_model_dir)
    r = generate(w.stub, prompt(50))
    assert len(r.tokens) == 64 - 50 and r.complete.finish_reason == "length"
    r = generate(w.stub, prompt(60), max_tokens=100)
    assert len(r.tokens) == 4 and r.complete.finish_reason == "length"


def test_logprobs_shape_and_values(worker):
    r = generate(worker.stub, prompt(6), max_tokens=6, logprobs=3)
    lps = [c.output_logprobs for c in r.chunks]
    assert [t for lp in lps for t in lp.token_ids] == r.tokens
    for lp in lps:
        for chosen, value, top in zip(
            lp.token_ids, lp.token_logprobs, lp.top_logprobs, strict=True
        ):
            assert len(top.token_ids) == len(top.values) == 3
            assert list(top.values) == sorted(top.values, reverse=True)
            assert value <= 0
            # Greedy: the chosen token is the most likely one.
            assert top.token_ids[0] == chosen and math.isclose(top.values[0], value)
    whole = generate(worker.stub, prompt(6), max_tokens=6, logprobs=0, stream=False)
    out = whole.complete.output_logprobs
    assert list(out.token_ids) == r.tokens and len(out.token_logprobs) == 6
    assert all(len(t.token_ids) == 0 for t in out.top_logprobs)
    assert not generate(worker.stub, prompt(6), max_tokens=2).chunks[0].HasField("output_logprobs")


def test_text_input_is_tokenized_with_the_model_tokenizer(worker):
    from transformers import AutoTokenizer

    text = "The quick brown fox"
    ids = AutoTokenizer.from_pretrained(worker.worker.model_dir).encode(text)
    by_text = generate(worker.stub, text=text, max_tokens=8)
    assert by_text.complete.prompt_tokens == len(ids)
    assert by_text.tokens == generate(worker.stub, ids, max_tokens=8).tokens


def test_sampling_options_are_accepted(worker):
    r = generate(
        worker.stub,
        prompt(6),
        temperature=0.7,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        max_tokens=10,
        ignore_eos=True,  # unseeded sampling may otherwise draw EOS early
    )
    assert len(r.tokens) == 10
    # A repetition penalty changes greedy output of a model that repeats itself.
    plain = generate(worker.stub, prompt(6), max_tokens=30).tokens
    penalized = generate(worker.stub, prompt(6), max_tokens=30, repetition_penalty=5.0).tokens
    assert len(set(penalized)) > len(set(plain))


@pytest.mark.parametrize("settings", [{}, {"logprobs": 2}])
def test_identical_requests_give_identical_output(worker, settings):
    a = generate(worker.stub, prompt(11), max_tokens=9, **settings)
    b = generate(worker.stub, prompt(11), max_tokens=9, **settings)
    assert a.tokens == b.tokens


def test_stream_interval_groups_tokens_but_not_the_first(start_worker, model_dir):
    interval = 3
    w = start_worker(model_dir, stream_interval=interval)
    r = generate(w.stub, prompt(6), max_tokens=20, ignore_eos=True)
    sizes = [len(c.token_ids) for c in r.chunks]
    assert sum(sizes) == 20 and sizes[0] == 1
    # Tokens wait for a group of `interval`; the end sends what is left.
    assert all(size >= interval for size in sizes[1:-1])
    assert (
        r.tokens == generate(w.stub, prompt(6), max_tokens=20, ignore_eos=True, stream=False).tokens
    )


@pytest.mark.parametrize("interval", [1, 2])
def test_chunks_grow_under_load_unless_every_token_was_asked_for(start_worker, model_dir, interval):
    # 48 long streams at once: the message budget makes chunks of several
    # tokens (--stream-interval 2); --stream-interval 1 still sends each alone.
    w = start_worker(model_dir, stream_interval=interval, completion_batch_size=48)
    with ThreadPoolExecutor(48) as pool:
        results = list(
            pool.map(
                lambda i: generate(w.stub, prompt(8, i), max_tokens=200, ignore_eos=True),
                range(48),
            )
        )
    assert all(len(r.tokens) == 200 for r in results)
    assert all(len(r.chunks[0].token_ids) == 1 for r in results)  # first tokens never wait
    middle = [len(c.token_ids) for r in results for c in r.chunks[1:-1]]
    if interval == 1:
        assert set(middle) == {1}
    else:
        assert statistics.median(middle) >= 3


def test_chunk_size_keeps_to_a_message_budget_but_tokens_wait_at_most_150_ms():
    assert tokens_per_message(2, running=1, step_seconds=0.01) == 2  # 50 messages/s
    assert tokens_per_message(2, running=1, step_seconds=0.001) == 10  # 100 messages/s
    assert tokens_per_message(2, running=16, step_seconds=0.015) == 10  # 107 messages/s
    assert tokens_per_message(2, running=16, step_seconds=0.003) == 50  # 54 would be 162 ms
    assert tokens_per_message(2, running=64, step_seconds=0.015) == 10  # 43 would be 645 ms
    assert tokens_per_message(2, running=64, step_seconds=0.04) == 3  # 4 steps would be 160 ms
    assert tokens_per_message(3, running=1, step_seconds=0.02) == 3  # the flag, at light load
    assert tokens_per_message(3, running=64, step_seconds=0.06) == 2  # 3 would hold 180 ms
    assert tokens_per_message(3, running=64, step_seconds=0.5) == 1  # a slow step: each alone
    assert tokens_per_message(1, running=64, step_seconds=0.001) == 1


def _at_once(callback, *args):
    """Runs what the publisher posts at once (it posts from the engine thread)."""
    callback(*args)


def test_a_held_token_goes_before_a_step_that_would_hold_it_too_long():
    handed = []

    class Receiver:
        def deliver(self, reports, per_message, cadence):
            handed.append(len(reports))

    publisher = StreamPublisher(_at_once, Receiver(), minimum=2)
    memory = Memory(*[0] * 11)
    report = StepReport((Event(1, token=5),), 0.045, 1, 1, 0, 0, (), memory, idle=False)
    publisher.step(report)  # a 45 ms step: its token waits for the next one's
    publisher.stepping(0.04)  # ...which is expected to be short: it still waits
    assert handed == []
    publisher.step(report)
    assert handed == [2]  # two steps' tokens in one message
    publisher.step(report)
    publisher.stepping(0.12)  # a long prompt's chunk: the held token goes first
    assert handed == [2, 1]


def test_with_every_token_alone_a_steps_early_tokens_go_before_it_ends():
    handed = []

    class Receiver:
        def deliver(self, reports, per_message, cadence):
            handed.append([e.token for r in reports for e in r.events])

    publisher = StreamPublisher(_at_once, Receiver(), minimum=2)
    memory = Memory(*[0] * 11)

    def report(token: int | None, seconds: float | None) -> StepReport:
        events = (Event(1, token=token),) if token is not None else ()
        return StepReport(events, seconds, 1, 1, 0, 0, (), memory, idle=False)

    publisher.step(report(None, 0.15))  # slow steps: every token alone
    publisher.step(report(5, None))  # the short lane's token, the long one still to run
    assert handed[-1] == [5]
    publisher.step(report(None, 0.15))  # the step's end
    publisher.step(report(6, None))
    assert handed[-1] == [6]
    # With tokens in chunks (fast steps), early tokens wait for the chunk.
    publisher.step(report(None, 0.01))
    publisher.step(report(7, None))
    assert handed[-1] != [7]


def test_a_stream_never_holds_a_token_much_past_a_chunks_time_whatever_starts_beside_it():
    """--stream-interval 1000 over steps of 1.5 ms: chunks of about 100 tokens
    (150 ms). Another stream's start hands tokens over out of step, and a
    stream counting its chunk from that hand-off held its oldest tokens
    through two chunks' time (a probe saw gaps of 200-315 ms, 150 promised)."""
    memory = Memory(*[0] * 11)
    spec = GenerationSpec((1, 2, 3), 10_000, frozenset(), SamplingSettings(), LogitsSettings(),
                          None)  # fmt: skip

    async def scenario() -> list[int]:
        client = EngineClient(asyncio.get_running_loop(), stream_interval=1000)
        client.started(memory, 1, "batched", CacheStats(), SpeculationStats())
        publisher = StreamPublisher(_at_once, client, minimum=1000)
        job, other = Job("r", spec), Job("o", spec)
        client.submit(job)
        client.submit(other)
        now = 0  # the step running
        held: list[int] = []  # by message after the first: steps its oldest token waited

        async def stream() -> None:
            async for message in streaming.chunks(job, True, lambda: client.tokens_per_message,
                                                  10_000):  # fmt: skip
                held.append(now - message.chunk.token_ids[0])

        task = asyncio.create_task(stream())
        for now in range(1, 700):
            seconds = 0.0007 if now % 97 == 0 else 0.0015  # now and then a faster step
            events = [Event(job.key, token=now, first=now == 1)]
            if now % 150 == 0:  # the other stream starts, or ends: handed over at once
                events.append(Event(other.key, token=now, first=now == 150))
            publisher.stepping(seconds)
            publisher.step(StepReport(tuple(events), seconds, 2, 2, 0, 0, (), memory, idle=False))
            for _ in range(3):
                await asyncio.sleep(0)
        task.cancel()
        return held[1:]

    held = asyncio.run(scenario())
    assert len(held) >= 5
    assert max(held) <= 105, held  # 100 steps is 150 ms


def test_a_stream_sends_what_it_holds_before_a_slow_step():
    # Fast steps: the stream sends its tokens two at a time. Then a long
    # prompt's chunk comes (a slow step): the token held from the fast steps
    # reaches the client before it, not with the next token after it.
    memory = Memory(*[0] * 11)
    spec = GenerationSpec((1, 2, 3), 100, frozenset(), SamplingSettings(), LogitsSettings(), None)

    async def scenario() -> tuple[list[list[int]], list[list[int]]]:
        client = EngineClient(asyncio.get_running_loop(), stream_interval=2)
        client.started(memory, 1, "batched", CacheStats(), SpeculationStats())
        publisher = StreamPublisher(_at_once, client, minimum=2)
        job = Job("r", spec)
        client.submit(job)
        sent: list[list[int]] = []

        async def stream() -> None:
            async for message in streaming.chunks(job, True, lambda: client.tokens_per_message, 99):
                sent.append(list(message.chunk.token_ids))

        task = asyncio.create_task(stream())

        def report(token: int, seconds: float) -> StepReport:
            event = Event(job.key, token=token, first=token == 1)
            return StepReport((event,), seconds, 1, 1, 0, 0, (), memory, idle=False)

        async def step(token: int, seconds: float) -> None:
            publisher.stepping(seconds)
            await asyncio.sleep(0.01)  # the step runs; the stream sends what it has
            publisher.step(report(token, seconds))
            await asyncio.sleep(0.01)

        for token in range(1, 8):
            await step(token, 0.005)
        # (the streams' cadence, every two steps, counted from the first)
        assert sent == [[1], [2, 3, 4], [5, 6]]  # token 7 waits for a chunk of two
        publisher.stepping(0.15)
        await asyncio.sleep(0.01)
        before = [list(c) for c in sent]
        await step(8, 0.15)
        # Two slow steps' tokens found together (the stream's handler was
        # busy) go in one message: chunks of one are for fresh tokens.
        publisher.step(report(9, 0.15))
        publisher.step(report(10, 0.15))
        await asyncio.sleep(0.01)
        task.cancel()
        return before, sent

    before, after = asyncio.run(scenario())
    assert before == [[1], [2, 3, 4], [5, 6], [7]]
    assert after == [[1], [2, 3, 4], [5, 6], [7], [8], [9, 10]]  # slow steps: a token a step
