"""The engine core driven directly, with no gRPC server and no event loop:
an Inbox in, a Sink out, as any front door (or a follower rank) uses it."""

from __future__ import annotations

import json
import logging
import queue
import re
import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest

from smg_mlx.config import EngineConfig
from smg_mlx.demo_model import build_model
from smg_mlx.engine import core as core_module
from smg_mlx.engine.batch import attention_shapes, warm_up
from smg_mlx.engine.batch.batch import Batch
from smg_mlx.engine.batch.row_places import PlacedGenerationBatch
from smg_mlx.engine.core import EngineCore
from smg_mlx.engine.handoff import Inbox
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier
from smg_mlx.engine.schedule.scheduler import Scheduler
from smg_mlx.engine.speculative.ragged_kv import Ragged
from smg_mlx.engine.types import (
    Event,
    GenerationSpec,
    LogitsSettings,
    Request,
    SamplingSettings,
    StepReport,
)

from helpers import prompt

TIMEOUT = 60


class Recorder:
    """A sink that keeps everything the engine reports."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.reports: queue.Queue[StepReport] = queue.Queue()
        self.ending: queue.Queue[str] = queue.Queue()

    def started(self, memory, ranks, mode, cache, speculation) -> None:
        self.ready.set()

    def stepping(self, expected_seconds) -> None:
        pass

    def step(self, report: StepReport) -> None:
        self.reports.put(report)

    def stopped(self) -> None:
        self.ending.put("stopped")

    def failed(self, message: str, permanent: bool = False) -> None:
        self.ending.put(f"{'refused' if permanent else 'failed'}: {message}")

    def next_report(self) -> StepReport:
        self.last = self.reports.get(timeout=TIMEOUT)
        return self.last

    def events_of(self, key: int, count: int | None = None) -> list[Event]:
        """This request's events, until `count` of them or its last."""
        events: list[Event] = []
        while not (events and events[-1].ends) and (count is None or len(events) < count):
            events += [e for e in self.next_report().events if e.key == key]
        return events

    def tokens_of(self, keys: list[int]) -> dict[int, list[int]]:
        """The tokens of these requests, running together, until each has ended."""
        tokens: dict[int, list[int]] = {key: [] for key in keys}
        left = set(keys)
        while left:
            for e in self.next_report().events:
                if e.key in tokens:
                    tokens[e.key].append(e.token)
                    if e.ends:
                        left.discard(e.key)
        return tokens

    def settled(self) -> StepReport:
        """The last report, once the engine has gone idle."""
        while not self.last.idle or not self.reports.empty():
            self.next_report()
        return self.last


def spec(ids: list[int], max_tokens: int, **sampling) -> GenerationSpec:
    return GenerationSpec(
        prompt=tuple(ids),
        max_tokens=max_tokens,
        stop_token_ids=frozenset(),
        sampling=SamplingSettings(**{"temperature": 0.0, **sampling}),
        logits=LogitsSettings(),
        logprobs=None,
    )


def start_core(
    model_dir, inbox: Inbox, sink: Recorder | None = None, **config
) -> tuple[Recorder, threading.Thread]:
    sink = sink or Recorder()
    core = EngineCore(EngineConfig(model_path=model_dir, **config), inbox, sink)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    assert sink.ready.wait(TIMEOUT)
    return sink, thread


@pytest.fixture
def core(model_dir):
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox)
    yield inbox, sink
    inbox.stop()
    thread.join(TIMEOUT)
    assert not thread.is_alive()


def test_a_request_streams_its_tokens_then_ends(core):
    inbox, sink = core
    inbox.submit(Request(1, spec(prompt(12), max_tokens=24)))
    events = sink.events_of(1)
    tokens = [e.token for e in events]
    assert len(tokens) == 24 and events[-1].finish_reason == "length"
    assert [e.first for e in events] == [True] + [False] * 23
    # Random weights drawn too small repeat one token: equality tests on such
    # a model would prove nothing.
    assert len(set(tokens)) > 3
    report = sink.settled()
    assert (report.running, report.waiting) == (0, 0)


def test_requests_that_end_together_are_reported_before_their_caches_are_kept(
    model_dir, monkeypatch
):
    """Copying each ended row's keys and values out of the batch for the prefix
    cache takes the engine thread about a millisecond a row on a GPU: a wave of
    requests ending together hears its ends first (its clients send their next
    requests meanwhile), and the next request still starts from the cache."""
    order = []
    insert = MemoryTier.insert

    def recorded(self, *args, **kwargs):
        order.append("kept")
        return insert(self, *args, **kwargs)

    monkeypatch.setattr(MemoryTier, "insert", recorded)
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox)
    step = sink.step

    def reported(report):
        ends = sum(e.ends for e in report.events)
        order.extend(["ended"] * ends)
        step(report)

    sink.step = reported
    order.clear()  # the warm-up's
    prompts = [prompt(40, 60 + k) for k in range(4)]
    for key, ids in enumerate(prompts):
        inbox.submit(Request(key, spec(ids, max_tokens=6)))
    tokens = sink.tokens_of(list(range(4)))
    inbox.submit(Request(9, spec(prompts[0] + tokens[0], max_tokens=2)))
    assert sink.events_of(9)[0].cached_tokens == len(prompts[0]) + len(tokens[0]) - 1
    inbox.stop()
    thread.join(TIMEOUT)
    assert order[:8] == ["ended"] * 4 + ["kept"] * 4


def test_a_batch_that_only_decodes_is_not_planned_again_at_every_step(model_dir, monkeypatch):
    plans = []
    schedule = Scheduler.schedule
    monkeypatch.setattr(
        Scheduler, "schedule", lambda self, *a, **k: plans.append(1) or schedule(self, *a, **k)
    )
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox)
    try:
        inbox.submit(Request(1, spec(prompt(12), max_tokens=40)))
        assert sink.events_of(1, count=1)[0].first
        planned = len(plans)
        inbox.submit(Request(2, spec(prompt(12, 2), max_tokens=4)))  # joins, then leaves
        events = sink.events_of(1)
        assert len(events) == 39 and events[-1].finish_reason == "length"
        # Planned again only around what changed (the second one's start,
        # prefill, first token and end), not at each of the 39 steps.
        assert 1 <= len(plans) - planned <= 12, len(plans) - planned
    finally:
        inbox.stop()
        thread.join(TIMEOUT)


def test_concurrent_requests_give_their_solo_output(core):
    inbox, sink = core
    solo = {}
    for key in (1, 2):
        inbox.submit(Request(key, spec(prompt(10 + key, key), max_tokens=16)))
        solo[key] = [e.token for e in sink.events_of(key)]
    assert solo[1] != solo[2]
    for key in (3, 4):
        inbox.submit(Request(key, spec(prompt(10 + key - 2, key - 2), max_tokens=16)))
    together = sink.tokens_of([3, 4])
    assert together[3] == solo[1] and together[4] == solo[2]


def test_an_abort_frees_the_slot(core):
    inbox, sink = core
    inbox.submit(Request(7, spec(prompt(8), max_tokens=1000)))
    assert sink.events_of(7, count=1)[0].first
    inbox.abort([7, 12345])  # an unknown key is ignored
    events = sink.events_of(7)
    assert events[-1].finish_reason == "abort" and len(events) < 1000
    report = sink.settled()
    assert (report.running, report.waiting, report.idle) == (0, 0, True)


def test_a_request_aborted_before_admission_never_runs(model_dir):
    inbox = Inbox()
    inbox.submit(Request(5, spec(prompt(8), max_tokens=10)))
    inbox.abort([5])
    sink, thread = start_core(model_dir, inbox)  # takes both in its first turn
    assert [(e.token, e.finish_reason) for e in sink.events_of(5)] == [(None, "abort")]
    inbox.stop()
    thread.join(TIMEOUT)


def test_stop_ends_the_loop_and_reports_it(model_dir):
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox)
    inbox.submit(Request(1, spec(prompt(8), max_tokens=1000)))
    sink.next_report()
    inbox.stop()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert sink.ending.get(timeout=1) == "stopped"


def test_the_thorough_warm_up_leaves_nothing_behind(model_dir, monkeypatch):
    """Where shapes cost kernel builds (CUDA), the warm-up runs every kind of
    step; afterwards requests see an empty batch and an empty prefix cache."""

    def outputs(inbox, sink) -> list[tuple[list[int], int]]:
        results = []
        for key, ids in ((1, warm_up.prompt(300)), (2, prompt(40, 2))):
            inbox.submit(Request(key, spec(list(ids), max_tokens=12)))
            events = sink.events_of(key)
            results.append(([e.token for e in events], events[0].cached_tokens))
        inbox.stop()
        return results

    inbox = Inbox()
    plain = outputs(inbox, start_core(model_dir, inbox)[0])
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    inbox = Inbox()
    thorough = outputs(inbox, start_core(model_dir, inbox)[0])
    assert thorough == plain
    assert [cached for _, cached in thorough] == [0, 0]  # the warm-up's prompt is not cached
    assert len(set(plain[0][0])) > 1  # the model's output varies


def test_the_thorough_warm_up_checks_proposals_where_speculation_is_on(model_dir, monkeypatch):
    """Where kernels are built on first use (CUDA: seconds, every stream
    stalled), the warm-up runs a pass checking proposals, passes sent while the
    one before runs (chained, whatever its rows' samplers, beside a place a
    row left: what they take back goes through the rows' places), and one
    over rows that end apart, lined up after, before the worker is ready; its
    passes count in no metric, and requests then answer as without speculation."""
    lined_up, chained, placed = [], [], []
    compact, ahead = Ragged.compact, Ragged.rewind_ahead
    routed = PlacedGenerationBatch.rewind_ahead

    def spied(self, *args: int | None) -> int | None:
        lined_up.append(self._ends is not None)  # the rows ended apart
        return compact(self, *args)

    monkeypatch.setattr(Ragged, "compact", spied)
    monkeypatch.setattr(Ragged, "rewind_ahead",
                        lambda self, *a: chained.append(1) or ahead(self, *a))  # fmt: skip
    monkeypatch.setattr(PlacedGenerationBatch, "rewind_ahead",
                        lambda self, *a: placed.append(self._route is not None)
                        or routed(self, *a))  # fmt: skip
    answers, counted = {}, {}
    for speculative, thorough in (("off", True), ("always", False), ("always", True)):
        monkeypatch.setattr(Batch, "shape_builds", property(lambda self, t=thorough: t))
        inbox = Inbox()
        chained.clear()
        sink, thread = start_core(model_dir, inbox, speculative=speculative)
        assert bool(chained) == ((speculative, thorough) == ("always", True))  # (ready now)
        assert any(placed) == ((speculative, thorough) == ("always", True))
        placed.clear()
        inbox.submit(Request(1, spec(prompt(40, 2), max_tokens=12)))
        answers[speculative, thorough] = [e.token for e in sink.events_of(1)]
        counted[speculative, thorough] = sink.settled().speculation
        inbox.stop()
        thread.join(TIMEOUT)
        assert any(lined_up) == ((speculative, thorough) == ("always", True))
    assert answers["always", True] == answers["always", False] == answers["off", True]
    assert counted["always", True] == counted["always", False]
    assert len(set(answers["off", True])) > 1  # the model's output varies


def test_every_index_the_engine_builds_is_int32(model_dir, monkeypatch):
    """On CUDA every gather or scatter of a new (dtype, index dtype) pair is a
    kernel compiled at a host's first start, seconds each, before the worker
    is ready: tokens, sampled ones too, and the indices made from them are
    int32 through the warm-up's every kind of step (speculation, sampling,
    penalties, logit bias, logprobs); nothing indexes logits by tokens, nor
    takes x[i] (mlx makes i a uint32 array)."""
    kinds = set()

    def index_kinds(index) -> None:
        if isinstance(index, int):  # mlx takes x[i] with i made a uint32 array
            kinds.add("int")
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(part, slice) for part in parts):
            kinds.update("slice with " + type(part).__name__ for part in parts
                         if isinstance(part, (mx.array, list)))  # fmt: skip
        for part in parts:
            if isinstance(part, mx.array):
                kinds.add(str(part.dtype))
            elif isinstance(part, list):
                kinds.add("list")

    def recording(original, index_at):
        def call(*args, **kwargs):
            index_kinds(args[index_at])
            return original(*args, **kwargs)

        return call

    monkeypatch.setattr(mx.array, "__getitem__", recording(mx.array.__getitem__, 1))
    monkeypatch.setattr(mx.array, "__setitem__", recording(mx.array.__setitem__, 1))
    for name in ("take", "take_along_axis", "put_along_axis"):
        monkeypatch.setattr(mx, name, recording(getattr(mx, name), 1))
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox, speculative="always")
    inbox.submit(Request(1, spec(prompt(40, 2), max_tokens=12)))
    assert len(sink.events_of(1)) == 12
    inbox.stop()
    thread.join(TIMEOUT)
    assert kinds <= {"mlx.core.int32", "list"}, kinds
    assert "mlx.core.int32" in kinds  # the recording saw the engine's indexing


def test_the_worker_is_ready_before_the_attention_shapes_are_built_and_builds_them_idle(
    tmp_path, monkeypatch, caplog
):
    """Where shapes cost kernel builds (CUDA), they take seconds at start-up: the
    engine reports ready first, builds them while it has nothing to run, and
    serves a request that arrives meanwhile."""
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    monkeypatch.setattr(core_module, "SHAPES_SECONDS", 0.0)  # one shape at a time
    monkeypatch.setattr(core_module, "SHAPES_QUIET_SECONDS", 0.01)
    # Keys of several rows padded to 512, not 4096: bfloat16 attention is slow on a CPU.
    monkeypatch.setattr(attention_shapes, "KEY_BUCKET", 512)
    started_at = []
    monkeypatch.setattr(Recorder, "started", lambda self, *a: (started_at.append(time.time()),
                                                               self.ready.set()))  # fmt: skip
    # bfloat16: where attention runs padded. Small shapes: built fast on the CPU.
    model_dir = build_model(tmp_path / "bf16", ["--dtype", "bfloat16", "--context-length", "512"])
    inbox = Inbox()
    with caplog.at_level(logging.INFO, logger="smg_mlx.engine.batch.attention_shapes"):
        sink, thread = start_core(model_dir, inbox, prefill_step_size=256)
        inbox.submit(Request(1, spec(prompt(30), max_tokens=4)))
        assert len(sink.events_of(1)) == 4
        deadline = time.monotonic() + TIMEOUT
        while "built in" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        inbox.stop()
        thread.join(TIMEOUT)
    queued = re.search(r"building (\d+) for prompts", caplog.text)
    built = [r for r in caplog.records if "built in" in r.getMessage()]
    assert queued and int(queued.group(1)) > 1
    assert f"{queued.group(1)} built in" in built[0].getMessage()
    assert built[0].created >= started_at[0]


REFERENCE = """
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
model, _ = load(sys.argv[1])
out = []
for ids in json.loads(sys.argv[2]):
    steps = generate_step(mx.array(ids), model, max_tokens=16, prefill_step_size=64)
    out.append([int(token) for token, _ in steps])
print(json.dumps(out))
"""


def test_greedy_output_equals_mlx_lms_own_generation(model_dir):
    """Prompts prefilled in chunks, alone and batched with padding: each gives
    the tokens mlx-lm's single-sequence generation gives (run apart, in a
    process of its own)."""
    prompts = [prompt(700, 1), prompt(300, 2), prompt(37, 3)]
    reference = json.loads(
        subprocess.run(
            [sys.executable, "-c", REFERENCE, str(model_dir), json.dumps(prompts)],
            check=True, capture_output=True, text=True, timeout=TIMEOUT,
        ).stdout
    )  # fmt: skip
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox, step_budget_seconds=1e-6)
    for key, ids in enumerate(prompts):
        inbox.submit(Request(key, spec(ids, max_tokens=16)))  # the first alone, then two together
        if key == 0:
            first = [e.token for e in sink.events_of(0)]
    rest = {key: [] for key in (1, 2)}
    while not all(tokens and len(tokens) == 16 for tokens in rest.values()):
        for event in sink.next_report().events:
            rest[event.key].append(event.token)
    inbox.stop()
    thread.join(TIMEOUT)
    assert [first, rest[1], rest[2]] == reference
    assert all(len(set(tokens)) > 1 for tokens in reference)  # the model's output varies


def test_a_model_that_cannot_load_is_reported(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    sink = Recorder()
    EngineCore(EngineConfig(model_path=tmp_path), Inbox(), sink).run()  # returns at once
    assert sink.ending.get(timeout=1).startswith("failed: model load failed")
    assert not sink.ready.is_set()


# ---- the scheduler at work (engine.schedule.scheduler): counted in steps, not seconds ----


@pytest.fixture
def chunked_core(model_dir):
    """A core whose step budget no step can meet: every step prefills the
    scheduler's minimum, so a long prompt takes many steps on any machine."""
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox, step_budget_seconds=1e-6)
    yield inbox, sink
    inbox.stop()
    thread.join(TIMEOUT)


def run_until_ended(sink: Recorder, keys: set[int]) -> list[StepReport]:
    """Every report until all these requests have ended."""
    reports, left = [], set(keys)
    while left:
        report = sink.next_report()
        reports.append(report)
        left -= {e.key for e in report.events if e.ends}
    return reports


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(chunked_core):
    inbox, sink = chunked_core
    inbox.submit(Request(1, spec(prompt(8), max_tokens=400)))
    assert sink.events_of(1, count=1)[0].first
    inbox.submit(Request(2, spec(prompt(1500, 2), max_tokens=2)))
    reports = run_until_ended(sink, {2})
    start = next(i for i, r in enumerate(reports) if 2 in r.admitted)
    first = next(i for i, r in enumerate(reports) if any(e.key == 2 for e in r.events))
    steps = [i for i in range(start, first) if reports[i].step_seconds is not None]
    assert len(steps) > 5  # it was prefilled in chunks...
    for i in steps:  # ...and the stream moved on at every one of them, its token
        early, step = reports[i - 1], reports[i]  # sent before the long prompt's chunk ran
        assert early.step_seconds is None
        assert [e.key for e in early.events if e.token is not None] == [1]
        assert not [e for e in step.events if e.token is not None]


def test_a_chat_beside_a_long_prompt_holds_a_cache_of_its_own_length(chunked_core):
    inbox, sink = chunked_core
    inbox.submit(Request(1, spec(prompt(1500, 1), max_tokens=300)))
    sink.events_of(1, count=2)
    alone = sink.last.memory.kv
    inbox.submit(Request(2, spec(prompt(20, 2), max_tokens=30)))
    sink.events_of(2, count=2)
    beside = sink.last.memory.kv
    # In one batch, mlx-lm would pad the chat's cache to the long prompt's length.
    assert alone < beside < 1.5 * alone


def test_a_short_request_overtakes_queued_long_ones_and_the_long_ones_finish(chunked_core):
    inbox, sink = chunked_core
    for key in (1, 2):
        inbox.submit(Request(key, spec(prompt(1500, key), max_tokens=4)))
    assert sink.next_report().admitted == (1,)  # one long prompt prefills at a time
    inbox.submit(Request(3, spec(prompt(20, 3), max_tokens=4)))
    reports = run_until_ended(sink, {1, 2, 3})
    admitted = [k for r in reports for k in r.admitted]
    firsts = [e.key for r in reports for e in r.events if e.first]
    assert admitted == [3, 2]  # the short one started while the first long one prefilled
    assert firsts == [3, 1, 2]
    ends = {e.key: e.finish_reason for r in reports for e in r.events if e.ends}
    assert ends == {1: "length", 2: "length", 3: "length"}


def test_the_next_long_prompt_starts_in_the_step_after_the_one_before_is_prefilled(
    model_dir, monkeypatch
):
    plans = []
    schedule = Scheduler.schedule

    def recorded(self, *args, **kwargs):
        plans.append(schedule(self, *args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(Scheduler, "schedule", recorded)
    inbox = Inbox()
    # Steps that meet their budget, in chunks small enough to make these prompts long.
    sink, thread = start_core(model_dir, inbox, step_budget_seconds=1.0, prefill_step_size=256)
    try:
        for key in (1, 2):
            inbox.submit(Request(key, spec(prompt(1500, key), max_tokens=4)))
        ends = {e.key: e.finish_reason for r in run_until_ended(sink, {1, 2}) for e in r.events}
    finally:
        inbox.stop()
        thread.join(TIMEOUT)
    assert {k: ends[k] for k in (1, 2)} == {1: "length", 2: "length"}
    first = next(i for i, plan in enumerate(plans) if plan.long == (1,))
    second = next(i for i, plan in enumerate(plans) if plan.long == (2,))
    # The first one's last chunk and its move into the decoding rows came in
    # one step: no step in between went to that move alone.
    assert all(plan.long_chunks for plan in plans[first:second])


def test_a_long_prompt_prefilled_beside_chats_gives_its_solo_output(model_dir):
    inbox = Inbox()
    # No prefix cache: the second run must compute everything again.
    sink, thread = start_core(model_dir, inbox, step_budget_seconds=1e-6, prompt_cache_bytes=0)
    try:
        long = spec(prompt(1500, 5), max_tokens=12)
        inbox.submit(Request(1, long))
        solo = [e.token for e in sink.events_of(1)]
        assert len(set(solo)) > 3
        inbox.submit(Request(2, long))
        reports, chats, left = [], [3, 4, 5], {2, 3, 4, 5}
        while left:
            reports.append(sink.next_report())
            left -= {e.key for e in reports[-1].events if e.ends}
            if chats and len(reports) % 2:  # chats arriving while it prefills
                key = chats.pop(0)
                inbox.submit(Request(key, spec(prompt(20, key), max_tokens=2)))
        assert [e.token for r in reports for e in r.events if e.key == 2] == solo
        firsts = [e.key for r in reports for e in r.events if e.first]
        assert firsts.index(3) < firsts.index(2)  # the chats did not wait for it
    finally:
        inbox.stop()
        thread.join(TIMEOUT)


def test_prefills_in_few_attention_shapes_answer_as_prefills_in_their_own(
    tmp_path_factory, monkeypatch
):
    """Where each attention shape costs a build (CUDA), prefills run padded to
    a few shapes (engine.batch.attention_shapes), keeping MLX's buffer cache between
    passes (engine.memory.buffer_cache): a follow-up that reuses a cached
    context, and prompts of several lengths prefilled together, get the tokens
    they get in shapes of their own."""
    model_dir = build_model(tmp_path_factory.mktemp("models") / "bf16", ["--dtype", "bfloat16"])
    context = prompt(300, 5)
    together = {3: prompt(7, 3), 4: prompt(50, 4), 6: prompt(23, 6)}

    def outputs(started=lambda: None) -> tuple[list[list[int]], int]:
        inbox = Inbox()
        sink, thread = start_core(model_dir, inbox, prefill_step_size=256, prefill_batch_size=3)
        started()
        inbox.submit(Request(1, spec(context, max_tokens=8)))
        answer = [e.token for e in sink.events_of(1)]
        inbox.submit(Request(2, spec(context + answer + prompt(40, 7), max_tokens=8)))
        events = sink.events_of(2)
        results, cached = [answer, [e.token for e in events]], events[0].cached_tokens
        for key, ids in together.items():
            inbox.submit(Request(key, spec(ids, max_tokens=8)))
        tokens = sink.tokens_of(list(together))
        inbox.stop()
        thread.join(TIMEOUT)
        return results + list(tokens.values()), cached

    plain, plain_cached = outputs()
    fused, shape_key = mx.fast.scaled_dot_product_attention, attention_shapes.shape_key
    clear = mx.clear_cache  # mlx-lm's passes skip it there (engine.memory.buffer_cache)...
    limit = mx.set_cache_limit(0)  # ...within a bound of the engine's (read, then put back)
    mx.set_cache_limit(limit)
    keys = []

    def recorded(*args):
        keys.append(shape_key(*args))
        return keys[-1]

    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    monkeypatch.setattr(attention_shapes, "shape_key", recorded)
    # The start's thorough warm-up (as on CUDA) runs several rows' passes with
    # their keys padded to a bucket of 512, not 4096: bfloat16 attention is slow
    # on a CPU (half this test's time). The requests below run in the served
    # bucket, put back once the engine is ready.
    bucket = attention_shapes.KEY_BUCKET
    monkeypatch.setattr(attention_shapes, "KEY_BUCKET", 512)
    padded, padded_cached = outputs(
        started=lambda: monkeypatch.setattr(attention_shapes, "KEY_BUCKET", bucket)
    )
    assert padded == plain and padded_cached == plain_cached > 300
    assert {(1, True), (3, False)} <= {(rows, regular) for rows, _, _, regular in keys}
    assert mx.fast.scaled_dot_product_attention is fused  # put back when the engine ended
    assert mx.clear_cache is clear
    assert mx.set_cache_limit(limit) == limit  # the bound went with the engine
    assert len({t for answer in plain for t in answer}) > 4  # the model's output varies


def test_a_chats_first_token_goes_out_before_the_long_prompts_chunks_of_its_step(chunked_core):
    inbox, sink = chunked_core
    inbox.submit(Request(1, spec(prompt(1500, 1), max_tokens=4)))
    assert sink.next_report().admitted == (1,)
    inbox.submit(Request(2, spec(prompt(8, 2), max_tokens=4)))
    reports = run_until_ended(sink, {1, 2})
    start = next(i for i, r in enumerate(reports) if 2 in r.admitted)
    first = next(i for i, r in enumerate(reports) if any(e.key == 2 for e in r.events))
    # Its prompt took one step; its first token went out early in the next,
    # not after one more step of the long prompt's chunks.
    assert len([r for r in reports[start:first] if r.step_seconds is not None]) == 1
    assert reports[first].step_seconds is None
    assert reports[first].events[0].first


@pytest.mark.parametrize("proposals, sooner", [(True, 1), (False, 0)],
                         ids=["proposals found", "none found"])  # fmt: skip
def test_a_new_streams_first_token_goes_out_a_step_sooner_where_passes_check_proposals(
    model_dir, proposals, sooner
):
    """A checking pass waits for the pass before it anyway: a prompt that
    moves into the decoding rows sends its first token in that step, not
    the next (a chat beside speculating streams waits one pass less). Where
    the streams find nothing to propose, their passes run plain, each
    overlapping the next, and the first token goes out as without speculation."""

    class JoinAfterFive(Recorder):
        """Sends the chat in on the engine's thread once the stream has made 5
        tokens, so it joins at the same pass however loaded the machine is
        (the stream's output changes course later, a pass with nothing to check)."""

        def __init__(self, inbox: Inbox) -> None:
            super().__init__()
            self.inbox, self.made = inbox, 0

        def step(self, report: StepReport) -> None:
            before, self.made = self.made, self.made + sum(e.key == 1 for e in report.events)
            if before < 5 <= self.made:
                self.inbox.submit(Request(2, spec(prompt(8, 2), max_tokens=4)))
            super().step(report)

    def steps_to_first_token(speculative: str) -> int:
        inbox = Inbox()
        sink, thread = start_core(model_dir, inbox, JoinAfterFive(inbox), speculative=speculative)
        try:
            # A phrase said four times: the stream finds proposals to check.
            opening = prompt(5, 1) * 4 if proposals else prompt(12, 1)
            inbox.submit(Request(1, spec(opening, max_tokens=60)))
            reports = run_until_ended(sink, {1, 2})
            start = next(i for i, r in enumerate(reports) if 2 in r.admitted)
            first = next(i for i, r in enumerate(reports) if any(e.key == 2 for e in r.events))
            assert next(e for e in reports[first].events if e.key == 2).first
            return len([r for r in reports[start:first + 1] if r.step_seconds is not None])
        finally:
            inbox.stop()
            thread.join(TIMEOUT)

    assert steps_to_first_token("always") == steps_to_first_token("off") - sooner


def test_the_prefill_chunk_is_the_backends_unless_one_is_given(model_dir, monkeypatch):
    def max_chunk(**config) -> int:
        batch = Batch(EngineConfig(model_path=model_dir, **config))
        batch.close()
        return batch.max_chunk

    assert max_chunk() == 2048
    # Where every pass costs a fixed time besides its tokens' (CUDA): fewer, larger.
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    assert max_chunk() == 4096
    assert max_chunk(prefill_step_size=1024) == 1024


def test_a_long_prefill_logs_its_progress(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(core_module, "PROGRESS_SECONDS", 0.0)  # every step
    inbox = Inbox()
    with caplog.at_level(logging.INFO, logger="smg_mlx.engine.core"):
        sink, thread = start_core(model_dir, inbox, step_budget_seconds=1e-6)
        inbox.submit(Request(1, spec(prompt(1500, 1), max_tokens=2), "doc-1"))
        sink.events_of(1)
        inbox.stop()
        thread.join(TIMEOUT)
    lines = re.finditer(r"'doc-1': (\d+) of 1500 prompt tokens prefilled", caplog.text)
    done = [int(line.group(1)) for line in lines]
    assert len(done) > 3 and done == sorted(done) and done[-1] < 1500


def test_a_stream_grown_long_moves_out_of_the_chats_lane_and_goes_on_as_alone(chunked_core):
    inbox, sink = chunked_core
    inbox.submit(Request(1, spec(prompt(8, 1), max_tokens=900)))
    alone = [e.token for e in sink.events_of(1)]
    inbox.submit(Request(2, spec(prompt(8, 1), max_tokens=900)))
    streamed = [e.token for e in sink.events_of(2, count=700)]  # long by now
    stream_kv = sink.last.memory.kv
    chats = (3, 4, 5)
    for key in chats:
        inbox.submit(Request(key, spec(prompt(20, key), max_tokens=30)))
    tokens: dict[int, list[int]] = {key: [] for key in (2, *chats)}
    beside = []  # the batch's KV while the chats run
    alone_kv = [stream_kv]  # and while the stream runs alone, before them and after
    while len(tokens[2]) + len(streamed) < 900:
        report = sink.next_report()
        for e in report.events:
            tokens[e.key] += [e.token] if e.token is not None else []
        if all(0 < len(tokens[key]) < 30 for key in chats):
            beside.append(report.memory.kv)
        elif all(len(tokens[key]) == 30 for key in chats):
            alone_kv.append(report.memory.kv)
    # In the stream's lane, mlx-lm would pad each chat's cache to its length
    # (4x the stream's alone); in a lane of their own they hold their own. (The
    # stream's own: the most reported alone. A steady turn's figures may be
    # FIGURES_SECONDS old: the report of its 700th token may show a block less.)
    assert beside and max(beside) < 2.5 * max(alone_kv)
    assert streamed + tokens[2] == alone and len(set(alone)) > 3
    assert all(len(tokens[key]) == 30 for key in chats)


class Replacing(Recorder):
    """A closed loop's clients at their quickest: when a wave of requests ends,
    one is replaced in the very call that reports the end, the others a moment
    later (as a client's replacements arrive over a few milliseconds)."""

    def __init__(self, inbox: Inbox, wave: list[int], replacements: list[Request]) -> None:
        super().__init__()
        self._inbox, self._wave, self._replacements = inbox, set(wave), replacements

    def step(self, report: StepReport) -> None:
        ended = {e.key for e in report.events if e.ends}
        if self._wave and ended >= self._wave:
            self._wave = set()
            first, *rest = self._replacements
            self._inbox.submit(first)
            threading.Timer(0.05, lambda: [self._inbox.submit(r) for r in rest]).start()
        super().step(report)


@pytest.mark.parametrize("beside", [False, True], ids=["idle", "beside a stream"])
def test_replacements_of_a_wave_that_ended_start_together(model_dir, beside):
    # Started one by one, they would stay out of step for good: each group costs
    # a prefill pass of its own, which halved throughput on a GPU. Beside a
    # stream still running, the batch steps on meanwhile.
    inbox = Inbox()
    wave = [Request(k, spec(prompt(12, k), max_tokens=4)) for k in (1, 2, 3, 4)]
    replacements = [Request(k, spec(prompt(12, k), max_tokens=4)) for k in (11, 12, 13, 14)]
    sink = Replacing(inbox, [r.key for r in wave], replacements)
    core = EngineCore(EngineConfig(model_path=model_dir, burst_window_seconds=0.3), inbox, sink)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    try:
        assert sink.ready.wait(TIMEOUT)
        admitted: list[set[int]] = []  # each admission's keys
        if beside:
            inbox.submit(Request(99, spec(prompt(12, 99), max_tokens=1000)))
            while not admitted:
                if keys := set(sink.next_report().admitted):
                    admitted.append(keys)
        for r in wave:
            inbox.submit(r)
        while not admitted[-1:] or not admitted[-1] & {11, 12, 13, 14}:
            if keys := set(sink.next_report().admitted):
                admitted.append(keys)
        assert admitted == [{99}] * beside + [{1, 2, 3, 4}, {11, 12, 13, 14}]
    finally:
        inbox.stop()
        thread.join(TIMEOUT)


def test_streams_grown_long_move_lanes_together_and_go_on_as_alone(model_dir, monkeypatch):
    """Streams that grew long beside chats leave the chats' lane in one turn
    (one at a time, both lanes would run a pass each step until the last had
    moved), each going on as it would have alone."""
    turns = []  # the keys each turn moved
    move = Batch.move

    def spied(self, keys):
        turns.append(sorted(keys))
        return move(self, turns[-1])

    monkeypatch.setattr(Batch, "move", spied)
    inbox = Inbox()
    sink, thread = start_core(model_dir, inbox, step_budget_seconds=1e-6)
    try:
        inbox.submit(Request(1, spec(prompt(8, 1), max_tokens=800)))
        alone = [e.token for e in sink.events_of(1)]
        streamed: dict[int, list[int]] = {key: [] for key in (2, 3, 4)}
        for key in streamed:
            inbox.submit(Request(key, spec(prompt(8, 1), max_tokens=800)))
        while min(len(tokens) for tokens in streamed.values()) < 600:  # long by now
            for e in sink.next_report().events:
                streamed[e.key].append(e.token)
        inbox.submit(Request(5, spec(prompt(20, 5), max_tokens=20)))  # a chat
        for key, tokens in sink.tokens_of([2, 3, 4, 5]).items():
            streamed.get(key, []).extend(t for t in tokens if t is not None)
        assert [keys for keys in turns if keys] == [[2, 3, 4]]
        assert all(tokens == alone for tokens in streamed.values())
        assert len(set(alone)) > 1  # the model's output varies
    finally:
        inbox.stop()
        thread.join(TIMEOUT)
