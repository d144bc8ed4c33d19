"""The memory budget: requests wait for room instead of killing the worker, one that can
never fit is refused at once, and a step that still runs out of memory is contained."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mlx_lm.generate import BatchGenerator

from smg_mlx.engine.memory.costs import MemoryModel
from smg_mlx.engine.memory.planner import Cost, MemoryPlanner, is_out_of_memory
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb

from helpers import SERVING, generate, memory_in_use, prompt, request, wait_until

MIB = 2**20

# ---- the planner's arithmetic ----

MODEL = MemoryModel(
    weights=100 * MIB, kv_per_token=1024, prefill_per_token=4096, prefill_per_context=16
)


def planner(budget_mib: int, **options) -> MemoryPlanner:
    options = {"max_chunk": 2048, "prefill_rows": 8, **options}
    return MemoryPlanner(MODEL, budget_mib * MIB, **options)


def test_the_batch_cache_costs_its_longest_row_for_every_row_alive():
    p = planner(1000)
    one_long = p.kv_bytes([Cost(10, 10_000, 0)])
    assert p.kv_bytes([Cost(10, 10_000, 0)] * 2) == pytest.approx(2 * one_long)
    # A chat ends while a stream beside it is short: it is charged the
    # stream's length then, not what the stream may grow to.
    assert p.kv_bytes([Cost(10, 10_000, 0), Cost(10, 100, 0)]) == one_long
    # Far along, the stream is long while the chat lives: the chat costs a long row.
    far = Cost(10, 10_000, 0, generated=9000)
    assert p.kv_bytes([far, Cost(10, 100, 0)]) > 1.7 * one_long
    # A prompt still to prefill lives as many passes as it has tokens left.
    prompt = Cost(5000, 5100, 5000)
    assert p.kv_bytes([Cost(10, 10_000, 0), prompt]) > 1.9 * one_long


def test_each_lane_costs_its_own_longest_row():
    p = planner(1000)
    long_row = Cost(10_000, 12_000, 0, long=True)
    chats = [Cost(40, 100, 0)] * 8
    beside = p.kv_bytes([long_row, *chats])
    # In the long prompts' lane it is not padded onto the chats' rows.
    assert beside < p.kv_bytes([Cost(10_000, 12_000, 0), *chats]) / 4
    assert beside < 2.5 * p.kv_bytes([long_row]) / 2


def test_a_full_prefix_cache_leaves_a_draft_model_room_to_catch_up():
    """A draft model catches up on a stream's prompt in passes that fit what
    the plan leaves free (engine.speculative.draft_model). The prefix cache
    fills what work leaves: were it to fill that too, every new stream's
    draft would catch up 16 tokens a pass. It leaves room for a pass of
    CATCH_UP_TOKENS at the longest stream's context."""
    from dataclasses import replace

    from smg_mlx.engine.memory.planner import CATCH_UP_TOKENS
    from smg_mlx.engine.speculative.draft_model import CatchUp

    drafted = MemoryPlanner(replace(MODEL, draft_width=0.5), 1000 * MIB, max_chunk=2048,
                            prefill_rows=8)  # fmt: skip
    streams = [Cost(6000, 6500, 0), Cost(40, 100, 0)]
    kept = planner(1000).prefix_allowance(streams) - drafted.prefix_allowance(streams)
    assert kept == pytest.approx(drafted.catch_up_bytes(streams), abs=1) and kept > 0
    catch_up = CatchUp()
    catch_up.measured(drafted.model)
    # What a step leaves free with the prefix cache full (as the scheduler plans it).
    full = drafted.prefix_allowance(streams)
    free = drafted.budget - drafted.need(streams, drafted.max_chunk) - full
    catch_up.room = free / drafted.safety
    assert catch_up.tokens(6000, 2048) >= CATCH_UP_TOKENS
    catch_up.room = 0  # work took it all: the draft still gains ground, slowly
    assert 0 < catch_up.tokens(6000, 2048) < CATCH_UP_TOKENS


def test_after_an_out_of_memory_step_a_draft_catches_up_within_the_wider_margin_too():
    """An out-of-memory step widens the planner's margin on every estimate; a
    draft catching up on a long prompt takes it as well, else its passes would
    fail again where everything else now fits."""
    from dataclasses import replace

    from smg_mlx.engine.memory.costs import PrefillSpeed
    from smg_mlx.engine.memory.planner import draft_pass_bytes
    from smg_mlx.engine.schedule.scheduler import Running, Scheduler
    from smg_mlx.engine.speculative.draft_model import CatchUp

    drafted = MemoryPlanner(replace(MODEL, draft_width=0.5), 300 * MIB, max_chunk=2048,
                            prefill_rows=8)  # fmt: skip
    scheduler = Scheduler(drafted, PrefillSpeed(4e-5, 4e-9), batch_size=8, prefill_rows=8,
                          step_seconds=0.1)  # fmt: skip
    streams = [Running(Cost(6000, 6500, 0), 0, 6000)]
    catch_up = CatchUp()
    catch_up.measured(drafted.model)
    passes = []
    for _ in range(3):
        catch_up.room = scheduler.schedule(streams, 0).spare_bytes
        n = catch_up.tokens(6000, 2048)
        free = drafted.budget - drafted.need([s.cost for s in streams], drafted.max_chunk)
        assert draft_pass_bytes(drafted.model, n, 6000, drafted.safety) <= free
        passes.append(n)
        drafted.learn()
    assert passes[-1] < passes[0]  # (the margin did bind)


def test_a_prompt_from_a_cached_prefix_counts_only_the_rest_as_prefill():
    p = planner(1000)
    whole = p.prefill_bytes([Cost(20_000, 20_016, 20_000)], 2048)
    rest = p.prefill_bytes([Cost(20_000, 20_016, 50)], 2048)
    assert rest < whole / 20


def test_copies_of_the_keys_cost_each_row_its_context_whatever_the_chunk():
    copies = MemoryModel(100 * MIB, 1024, prefill_per_token=4096, prefill_per_context=0,
                         prefill_row_per_key=1024)  # fmt: skip
    p = MemoryPlanner(copies, 1000 * MIB, max_chunk=2048, prefill_rows=8)
    one = p.prefill_bytes([Cost(30_000, 30_016, 4096)], 2048)
    assert p.prefill_bytes([Cost(30_000, 30_016, 4096)] * 2, 2048) == pytest.approx(2 * one)
    halved = p.prefill_bytes([Cost(30_000, 30_016, 4096)], 1024)
    # Half the chunk saves half its tokens' set, not half of the copies.
    assert one - halved == pytest.approx(1024 * (4096 + 1024) * p.safety)
    assert halved > 30_000 * 1024 * p.safety


def test_a_request_waits_when_the_batch_with_it_would_not_fit():
    p = planner(180)
    running = [Cost(1000, 20_000, 0)]
    assert p.fits(running)
    assert not p.fits([*running, Cost(1000, 20_000, 1000)])
    # A short one waits beside a long row that has grown long...
    grown = [Cost(1000, 20_000, 0, generated=18_000)]
    assert p.fits(grown)
    assert not p.fits([*grown, Cost(100, 200, 100)])
    # ...and starts beside one that is short while it lives.
    assert p.fits([*running, Cost(100, 200, 100)])


def test_long_prompts_prefill_in_smaller_chunks_and_alone():
    p = planner(400)
    long = Cost(40_000, 40_100, 40_000)
    assert p.chunk([long], 0) < 2048
    assert p.fits([long])
    assert not p.fits([long, Cost(40_000, 40_100, 40_000)])  # two at once do not
    assert p.chunk([Cost(100, 200, 100)], 0) == 2048


def test_the_prefix_cache_gives_way_before_work_waits():
    p = planner(200)
    running = [Cost(1000, 20_000, 0)]
    allowance = p.prefix_allowance(running)
    assert 0 < allowance < 100 * MIB
    assert p.prefix_allowance([*running, Cost(1000, 20_000, 0)]) < allowance


def test_a_full_prefix_cache_still_leaves_a_long_prompt_full_chunks():
    p = planner(2000)
    costs = [Cost(20_000, 20_100, 4096)]
    assert p.chunk(costs, p.prefix_allowance(costs)) == 2048


def test_the_longest_sequence_fits_alone_and_a_little_more_does_not():
    p = planner(300)
    longest = p.longest_sequence
    assert p.fits([Cost(longest, longest, longest)])
    assert not p.fits([Cost(longest + 300, longest + 300, longest + 300)])


def test_an_out_of_memory_error_raises_the_estimates():
    p = planner(300)
    before = p.longest_sequence
    p.learn()
    assert p.longest_sequence < before


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("cudaMallocAsync(&data, size, stream) failed: out of memory", True),
        ("[METAL] Command buffer execution failed: Insufficient Memory", True),
        ("[metal::malloc] Attempting to allocate 9 bytes which is greater than the max", True),
        ("[malloc] Unable to allocate 1073741824 bytes.", True),
        ("There is no Stream(gpu, 1) in current thread.", False),
    ],
)
def test_out_of_memory_errors_are_told_apart(message, expected):
    assert is_out_of_memory(RuntimeError(message)) is expected


# ---- a worker under a small budget ----

PROMPTS = [prompt(600, i) for i in range(6)]


@pytest.fixture(scope="module")
def unbounded_memory(model_dir):
    """What a worker with no budget to speak of measured of the model (its weights),
    apart from `unbounded_outputs`: the tests that only size a budget from it
    wait for no generation (a test process may run none of the others)."""
    from conftest import RunningWorker, worker_config

    w = RunningWorker(worker_config(model_dir))
    try:
        return w.worker.engine.memory
    finally:
        w.stop()


@pytest.fixture(scope="module")
def unbounded_outputs(model_dir):
    """Greedy outputs of the 600-token prompts from a worker with no budget to speak of."""
    from conftest import RunningWorker, worker_config

    w = RunningWorker(worker_config(model_dir))
    try:
        return [generate(w.stub, p, max_tokens=200, ignore_eos=True).tokens for p in PROMPTS]
    finally:
        w.stop()


def small_budget(unbounded_memory, extra_mib: int = 5) -> int:
    return unbounded_memory.weights + extra_mib * MIB


def test_a_small_budget_queues_requests_and_changes_no_output(
    start_worker, model_dir, unbounded_memory, unbounded_outputs
):
    budget = small_budget(unbounded_memory)
    before = memory_in_use()
    w = start_worker(model_dir, memory_budget_bytes=budget)
    engine = w.worker.engine
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append((engine.memory.waiting_for_memory, engine.memory.peak))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = list(
                pool.map(lambda p: generate(w.stub, p, max_tokens=200, ignore_eos=True), PROMPTS)
            )
    finally:
        done.set()
        watcher.join()
    assert [r.tokens for r in outputs] == unbounded_outputs
    assert all(r.complete.finish_reason == "length" for r in outputs)  # nothing refused
    assert max(queued for queued, _ in seen) > 0  # some had to wait for memory
    assert max(peak for _, peak in seen) - before <= budget


def test_requests_waiting_for_memory_count_toward_max_pending(
    start_worker, model_dir, unbounded_memory
):
    """Where memory, not the batch, bounds what runs, --max-pending still bounds
    what waits: past it a request is refused at once (for the router to send
    it elsewhere), not queued behind every running one."""
    w = start_worker(model_dir, memory_budget_bytes=small_budget(unbounded_memory), max_pending=1)
    engine = w.worker.engine
    # Taken in before the engine first says memory is full: they all wait their turn.
    streams = [
        w.stub.Generate(request(p, max_tokens=600, ignore_eos=True), timeout=120) for p in PROMPTS
    ]
    assert wait_until(lambda: engine.memory.waiting_for_memory > 0, 30)
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(5), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "as many as memory holds, --max-pending waiting" in err.value.details()
    # Those taken in all finish.
    ends = [[r for r in s if r.HasField("complete")][-1].complete for s in streams]
    assert [e.finish_reason for e in ends] == ["length"] * len(streams)
    assert generate(w.stub, prompt(5), max_tokens=2).complete.finish_reason == "length"


def test_a_prompt_that_can_never_fit_is_refused_at_once(start_worker, model_dir, unbounded_memory):
    w = start_worker(model_dir, memory_budget_bytes=small_budget(unbounded_memory))
    longest = w.worker.engine.longest_sequence
    assert 100 < longest < 2000
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(longest + 10), max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"holds at most {longest} tokens" in err.value.details()
    # What GetModelInfo tells a router is the limit refusals apply.
    info = w.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_req_input_len == longest - 1 < info.max_context_length - 1
    # A prompt that fits, asking for more than fits: it stops where memory ends.
    fitting = generate(w.stub, prompt(longest - 20), max_tokens=1000, ignore_eos=True)
    assert len(fitting.tokens) == 20 and fitting.complete.finish_reason == "length"


def test_chats_beside_long_streams_start_while_they_are_short(
    start_worker, model_dir, unbounded_memory
):
    # Three streams that may each grow to nearly the longest sequence: charged
    # at that length, a chat beside them would wait for one to end. While the
    # streams are short, a chat that ends soon costs little, so chats start
    # and end while all three run.
    w = start_worker(model_dir, memory_budget_bytes=small_budget(unbounded_memory))
    engine = w.worker.engine
    grow = engine.longest_sequence - 50
    with ThreadPoolExecutor(6) as pool:
        streams = [
            pool.submit(generate, w.stub, prompt(40, 20 + i), max_tokens=grow, ignore_eos=True)
            for i in range(3)
        ]
        assert wait_until(lambda: engine.running == 3, 30)
        chats = [
            pool.submit(generate, w.stub, prompt(40, 23 + i), max_tokens=16, ignore_eos=True)
            for i in range(3)
        ]
        assert all(len(chat.result().tokens) == 16 for chat in chats)
        assert not any(stream.done() for stream in streams)
        assert all(len(stream.result().tokens) == grow for stream in streams)


def test_a_budget_below_the_model_is_refused_at_start(refused, model_dir):
    refusal = refused(model_dir, memory_budget_bytes=1000)
    assert refusal.exit_code == 2  # a flag to fix: no supervisor should restart it
    assert "cannot hold the model: its weights alone take" in str(refusal)
    assert "raise --memory-budget" in str(refusal)


def test_a_budget_that_holds_the_model_but_no_request_is_refused_as_a_flag(refused, model_dir):
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    refusal = refused(model_dir, memory_budget_bytes=weights + 1024)
    assert refusal.exit_code == 2  # a restart cannot cure it
    assert "does not hold the model" in str(refusal)
    assert "and one short request: raise --memory-budget" in str(refusal)


OUT_OF_MEMORY = RuntimeError("[metal::malloc] Unable to allocate 8589934592 bytes")
# Not memory: what gemma2's mask raised in a padded batch.
BAD_SHAPES = ValueError("[broadcast_shapes] Shapes (3,1,22,22) and (3,2,2,22,22)")


class FailingStep:
    """Makes BatchGenerator.next raise `error` once, `steps` calls after `arm`."""

    def __init__(self, monkeypatch, error: Exception) -> None:
        self.countdown = -1
        step = BatchGenerator.next

        def next_or_fail(generator):
            self.countdown -= 1
            if self.countdown == 0:
                raise error
            return step(generator)

        monkeypatch.setattr(BatchGenerator, "next", next_or_fail)

    def arm(self, steps: int) -> None:
        self.countdown = steps


def test_an_out_of_memory_step_is_contained(
    start_worker, model_dir, unbounded_outputs, monkeypatch
):
    failure = FailingStep(monkeypatch, OUT_OF_MEMORY)
    w = start_worker(model_dir)
    health = health_pb2_grpc.HealthStub(w.channel)
    streams = [
        w.stub.Generate(request(p, max_tokens=200, ignore_eos=True), timeout=60)
        for p in PROMPTS[:4]
    ]
    tokens = [list(next(s).chunk.token_ids) for s in streams]  # all four are streaming
    failure.arm(5)
    for i, s in enumerate(streams):
        for message in s:
            if message.HasField("chunk"):
                tokens[i] += message.chunk.token_ids
            else:
                assert message.complete.finish_reason == "length"
    # Every stream went on where it was, token for token as if nothing happened.
    assert tokens == unbounded_outputs[:4]
    assert health.Check(health_pb2.HealthCheckRequest()).status == SERVING
    assert w.worker.engine.memory.out_of_memory_steps == 1
    assert len(generate(w.stub, prompt(5), max_tokens=3).tokens) == 3


def test_steps_that_keep_running_out_of_memory_shed_load_and_the_worker_serves_on(
    start_worker, model_dir, unbounded_outputs, monkeypatch
):
    """Something beyond the worker's estimates holds the device's memory (another
    process on the GPU, say): any step with more than two requests runs out of
    it. Each such step puts its batch back and at most half as many run after
    it, so the worker does not fail step after step at the same size until it
    gives up: every request ends whole, as it would have, and it still serves."""
    step = BatchGenerator.next
    failed = []

    def next_or_fail(generator):
        rows = len(generator._generation_batch) + len(generator._prompt_batch)
        if rows + len(generator._unprocessed_sequences) > 2:
            failed.append(rows)
            raise RuntimeError(OUT_OF_MEMORY.args[0])
        return step(generator)

    w = start_worker(model_dir)
    monkeypatch.setattr(BatchGenerator, "next", next_or_fail)
    with ThreadPoolExecutor(6) as pool:
        calls = [pool.submit(generate, w.stub, p, max_tokens=200, ignore_eos=True)
                 for p in PROMPTS[:6]]  # fmt: skip
        outputs = [c.result().tokens for c in calls]
    assert outputs == unbounded_outputs[:6]
    assert len(failed) >= 2  # (steps of more than two did run out of memory, again and again)
    health = health_pb2_grpc.HealthStub(w.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == SERVING
    assert len(generate(w.stub, prompt(5), max_tokens=3).tokens) == 3


def test_a_long_prompts_pass_out_of_memory_loses_and_repeats_none_of_a_streams_tokens(
    start_worker, model_dir, monkeypatch
):
    # The short lane's tokens go out before the long lane runs: a long pass
    # that then runs out of memory must not send them again, nor drop them.
    called: list[BatchGenerator] = []  # the generator of each call to `next`, in order
    step = BatchGenerator.next
    failing = threading.Event()

    def next_or_fail(generator):
        # The short lane ran the stream's steps: the other one is the long lane.
        if failing.is_set() and generator is not short:
            failing.clear()
            raise RuntimeError("[cuda::malloc] out of memory")
        called.append(generator)
        return step(generator)

    monkeypatch.setattr(BatchGenerator, "next", next_or_fail)
    # A budget no step meets: prompts past 512 tokens are long, 128 tokens a step.
    w = start_worker(model_dir, step_budget_seconds=1e-6, prompt_cache_bytes=0)
    chat, document = prompt(30, 1), prompt(1500, 2)
    solo = [generate(w.stub, p, max_tokens=n, ignore_eos=True).tokens for p, n in
            ((chat, 60), (document, 8))]  # fmt: skip
    assert len(set(solo[0])) > 3
    stream = w.stub.Generate(request(chat, max_tokens=60, ignore_eos=True), timeout=60)
    tokens = list(next(stream).chunk.token_ids)
    short = called[-1]
    failing.set()  # the long lane's first pass, after the stream's token went out
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(generate, w.stub, document, max_tokens=8, ignore_eos=True)
        for message in stream:
            if message.HasField("chunk"):
                tokens += message.chunk.token_ids
        assert long.result().tokens == solo[1]
    assert not failing.is_set()  # the long lane did run out of memory
    assert tokens == solo[0]
    assert w.worker.engine.memory.out_of_memory_steps == 1


def test_a_request_alone_that_runs_out_of_memory_ends_and_the_worker_serves(
    start_worker, model_dir, monkeypatch
):
    failure = FailingStep(monkeypatch, OUT_OF_MEMORY)
    w = start_worker(model_dir)
    failure.arm(3)
    with pytest.raises(grpc.RpcError) as err:
        generate(w.stub, prompt(50), max_tokens=100, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ran out of memory" in err.value.details()
    assert w.stub.HealthCheck(pb.HealthCheckRequest()).healthy
    assert wait_until(lambda: w.active_requests() == 0)
    assert len(generate(w.stub, prompt(5), max_tokens=3).tokens) == 3


def test_a_failed_step_ends_only_its_requests_and_the_worker_serves_on(
    start_worker, model_dir, monkeypatch
):
    failure = FailingStep(monkeypatch, BAD_SHAPES)
    w = start_worker(model_dir)
    streams = [
        w.stub.Generate(request(p, max_tokens=200, ignore_eos=True), timeout=60)
        for p in PROMPTS[:2]
    ]
    for s in streams:
        next(s)  # both are in the batch, streaming
    failure.arm(3)
    for s in streams:
        with pytest.raises(grpc.RpcError) as err:
            list(s)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "can be retried" in err.value.details()
    # The requests after it run as usual: the engine started the batch over.
    assert len(generate(w.stub, prompt(5), max_tokens=3).tokens) == 3
    health = health_pb2_grpc.HealthStub(w.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == SERVING
    assert w.worker.engine.memory.failed_steps == 1
