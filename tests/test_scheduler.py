"""The scheduling policy on its own: no model, no gRPC, no clock but the one it is given."""

from __future__ import annotations

from smg_mlx.engine.batch.attention_shapes import shape_key, windows_for
from smg_mlx.engine.memory.costs import MemoryModel, PrefillSpeed
from smg_mlx.engine.memory.planner import Cost, MemoryPlanner
from smg_mlx.engine.schedule.scheduler import LONG_PROMPT_STEPS, Plan, Running, Scheduler
from smg_mlx.engine.schedule.step_plan import (
    MIN_STEP_TOKENS,
    SHORT,
    Attended,
    Builds,
    Passes,
    chunk_sizes,
)
from smg_mlx.engine.schedule.waiting_room import AGING_SECONDS, Prefixes, Reuse
from smg_mlx.engine.types import GenerationSpec, LogitsSettings, Request, SamplingSettings

from helpers import prompt

MIB = 2**20
MODEL = MemoryModel(weights=100 * MIB, kv_per_token=1024, prefill_per_token=4096,
                    prefill_per_context=16)  # fmt: skip
# 40 ms per 1000 prompt tokens, and as much again per 10k tokens of context: a
# 100 ms budget prefills 2048 tokens at no context, and less further in.
SPEED = PrefillSpeed(per_token=4e-5, per_context=4e-9)


def make(budget_mib: int = 10_000, *, step_ms: float = 100, rows: int = 8, batch: int = 32,
         speed: PrefillSpeed = SPEED, builds: Builds | None = None,
         attended: Attended | None = None, prefixes: Prefixes | None = None,
         equal_lengths: bool = False) -> Scheduler:  # fmt: skip
    planner = MemoryPlanner(MODEL, budget_mib * MIB, max_chunk=2048, prefill_rows=rows)
    return Scheduler(planner, speed, batch_size=batch, prefill_rows=rows,
                     step_seconds=step_ms / 1000, builds=builds, attended=attended,
                     prefixes=prefixes, equal_lengths=equal_lengths)  # fmt: skip


def req(key: int, length: int, max_tokens: int = 16) -> Request:
    spec = GenerationSpec(tuple(prompt(length, key)), max_tokens, frozenset(),
                          SamplingSettings(), LogitsSettings(), None)  # fmt: skip
    return Request(key, spec)


def prefilling(length: int, done: int = 0, max_tokens: int = 16, long: bool = False) -> Running:
    """A prompt of `length` tokens with `done` of them prefilled (`long`: in
    the long prompts' lane)."""
    cost = Cost(length, length + max_tokens, length - done, long)
    return Running(cost, length - 1 - done, done)


def decoding(length: int = 64, max_tokens: int = 64) -> Running:
    return Running(Cost(length, length + max_tokens, 0), 0, length)


def took(seconds: float, long: bool = False) -> Passes:
    """A step of one pass, in the long prompts' lane or the other one."""
    return Passes(long=(seconds,)) if long else Passes(short=seconds)


def keys(requests) -> list[int]:
    return [r.key for r in requests]


def test_chunks_are_powers_of_two_that_end_on_a_multiple_of_themselves():
    assert chunk_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert chunk_sizes(3000)[-2:] == [2048, 3000]
    s = make()
    assert s.schedule([prefilling(100_000, done=0)], 0).chunk == 2048
    # A prompt whose first 1000 tokens came from the prefix cache first catches up
    # with the grid, then keeps to it: the same attention shapes every time.
    assert s.schedule([prefilling(100_000, done=1000)], 0).chunk == 1048
    catch_up = s.schedule([prefilling(100_000, done=30_000)], 0).chunk
    deep = s.schedule([prefilling(100_000, done=30_000 + catch_up)], 0).chunk
    assert deep < 2048 and (30_000 + catch_up) % deep == 0


def test_a_short_request_starts_ahead_of_queued_long_ones():
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    s.add([req(1, 2 * long_tokens), req(2, 2 * long_tokens)], now=0)
    first = s.schedule([], 0, now=0)
    assert keys(first.admit) == [1]  # one long prompt prefills at a time
    assert first.long == (1,) and first.long_chunks
    s.add([req(3, 40)], now=1)
    plan = s.schedule([prefilling(2 * long_tokens, done=2048, long=True)], 0, now=1)
    assert keys(plan.admit) == [3] and plan.long == ()
    assert plan.long_chunks  # it goes on beside the chat, in its own lane
    assert len(s) == 1  # the second long one still waits


def test_a_chat_starts_ahead_of_queued_documents_just_short_of_long():
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    document = long_tokens * 3 // 4
    s.add([req(i, document) for i in range(1, 9)], now=0)
    # Prefilled side by side they would pad each other into more than a long
    # prompt's work: one at a time.
    assert keys(s.schedule([], 0, now=0).admit) == [1]
    s.add([req(99, 40)], now=1)
    started = prefilling(document, done=2048)
    assert keys(s.schedule([started], 0, now=1).admit) == [99]
    assert keys(s.schedule([decoding(document)], 0, now=2).admit) == [2]


def test_among_short_prompts_the_shortest_goes_first_until_one_has_aged():
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    document = long_tokens * 3 // 4
    s.add([req(1, document), req(2, document)], now=0)
    s.add([req(3, 40)], now=1)
    assert keys(s.schedule([], 0, now=1).admit) == [3, 1]
    # The other document has waited its limit: a chat arriving now does not
    # pass it while it waits for the one prefilling.
    s.add([req(4, 40)], now=AGING_SECONDS)
    running = prefilling(document, done=2048)
    assert keys(s.schedule([running], 0, now=AGING_SECONDS).admit) == []
    assert keys(s.schedule([decoding(document)], 0, now=AGING_SECONDS).admit) == [2, 4]


def test_the_next_long_prompt_starts_once_the_one_before_is_prefilled():
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    s.add([req(1, 3 * long_tokens), req(2, 3 * long_tokens)], now=0)
    assert keys(s.schedule([], 0, now=0).admit) == [1]
    tail = prefilling(3 * long_tokens, done=3 * long_tokens - 10, long=True)
    assert keys(s.schedule([tail], 0).admit) == []
    assert keys(s.schedule([decoding(3 * long_tokens)], 0).admit) == [2]


def test_a_long_prompts_last_chunk_and_its_move_to_the_decoding_rows_share_a_step():
    s = make()
    tail = prefilling(20_480 + 1 + 300, done=20_480, long=True)
    # Its last 300 tokens, then a pass that moves it into its lane's decoding
    # rows: the next long prompt can start at the next step.
    plan = s.schedule([tail], 0)
    assert len(plan.long_chunks) == 2 and plan.long_chunks[0] >= 300
    assert plan.expected_seconds <= s.steps.step_seconds
    # Where the budget has no room left for that pass, it waits for the next step.
    s.schedule([Running(Cost(30_000, 30_016, 0, long=True), 0, 30_000)], 0)
    s.observe(took(1.0, long=True), 1)  # its lane's decoding pass: far over the budget
    assert len(s.schedule([tail], 0).long_chunks) == 1


def test_the_step_budget_is_shared_by_the_rows_and_shrinks_as_the_context_grows():
    s = make()
    alone = s.schedule([prefilling(100_000, done=0)], 0).chunk
    deep = s.schedule([prefilling(100_000, done=65_536)], 0).chunk
    assert alone == 2048 and deep < alone
    s.add([req(1, 4000), req(2, 4000)], now=0)
    shared = s.schedule([], 0, now=0)
    assert keys(shared.admit) == [1, 2]
    assert shared.chunk <= alone // 2  # two rows, padded to one chunk, share the budget
    assert shared.expected_seconds <= s.steps.step_seconds


def test_the_long_lane_takes_chunks_while_the_step_stays_within_its_budget():
    s = make(100_000, step_ms=300)
    long = prefilling(100_000, done=2048, long=True)
    plan = s.schedule([long, decoding()], 0)
    assert plan.chunk is not None and len(plan.long_chunks) >= 2
    assert all(c <= 2048 for c in plan.long_chunks)  # each at most --prefill-step-size
    assert plan.expected_seconds <= s.steps.step_seconds
    # Short prompts come first in the budget; the long one still moves.
    alone = make(100_000, step_ms=300)
    for scheduler in (s, alone):
        scheduler.add([req(1, 4000), req(2, 4000)], now=0)
    beside = s.schedule([long, decoding()], 0, now=0)
    assert keys(beside.admit) == [1, 2] and beside.long_chunks
    assert beside.chunk == alone.schedule([decoding()], 0, now=0).chunk
    assert beside.expected_seconds <= s.steps.step_seconds


def test_a_long_context_found_cheaper_than_the_probe_predicts_gets_more_chunks_a_step():
    s = make(step_ms=300)
    deep = [prefilling(100_000, done=40_960, long=True)]
    shallow = [prefilling(100_000, done=0, long=True)]
    before = s.schedule(deep, 0)
    assert len(before.long_chunks) == 1
    for _ in range(3):  # one-chunk steps at this context, at a third of the prediction
        s.observe(took(s.schedule(deep, 0).expected_seconds / 3, long=True), 1)
    assert len(s.schedule(deep, 0).long_chunks) > 1
    # What the clock learnt at one context does not carry over to another.
    assert s.schedule(shallow, 0) == make(step_ms=300).schedule(shallow, 0)


def test_the_long_lane_takes_the_chunks_that_the_short_lanes_pass_leaves_room_for():
    s = make(step_ms=420)
    state = [prefilling(100_000, done=2048, long=True), decoding()]

    def steps(short_pass: float) -> Plan:
        """Steps whose short-lane pass took `short_pass`, each long pass 100 ms."""
        for _ in range(30):
            plan = s.schedule(state, 0)
            s.observe(Passes(short_pass, (0.1,) * len(plan.long_chunks)), 2)
        return s.schedule(state, 0)

    quick = steps(0.005)
    assert len(quick.long_chunks) >= 3 and quick.expected_seconds <= s.steps.step_seconds
    busy = steps(0.3)
    assert len(busy.long_chunks) == 1
    # Each lane's clock learns from its own passes alone.
    assert 0.25 < s.steps.clocks[SHORT].decode_seconds <= 0.3


def test_a_short_prompt_prefilling_beside_a_long_one_does_not_shrink_the_long_ones_chunk():
    s = make(step_ms=300)
    long = prefilling(100_000, done=2048, long=True)
    beside = s.schedule([long, prefilling(3000, done=1000)], 0)
    assert beside.chunk == 1999  # the short one's last 1,999 tokens: one pass
    assert beside.long_chunks[0] == 2048


def test_a_long_prompt_moves_every_step_however_busy_the_short_lane():
    s = make()
    shorts = [prefilling(5000, done=1024) for _ in range(4)]
    plan = s.schedule([*shorts, prefilling(100_000, done=8192, long=True)], 0)
    assert plan.expected_seconds >= s.steps.step_seconds  # the short lane takes it all
    assert len(plan.long_chunks) == 1 and plan.long_chunks[0] >= MIN_STEP_TOKENS
    # Its last chunk ends where its prompt does (then a pass that prefills nothing).
    tail = s.schedule([prefilling(10_000, done=10_000 - 2 - 100, long=True)], 0)
    assert len(tail.long_chunks) == 2 and tail.long_chunks[0] >= 101


def test_a_tiny_budget_still_prefills_a_minimum_per_step():
    s = make(step_ms=0.001)
    plan = s.schedule([prefilling(10_000)], 0)
    assert plan.chunk == MIN_STEP_TOKENS
    s.add([req(1, 200), req(2, 200)], now=0)
    both = s.schedule([], 0, now=0)
    assert keys(both.admit) == [1, 2] and 2 * both.chunk == MIN_STEP_TOKENS


def test_slower_steps_than_expected_shrink_the_chunk():
    s = make()
    before = s.schedule([prefilling(100_000, done=8192)], 0).chunk
    for _ in range(3):
        s.observe(took(0.5), 1)  # five times the budget
    after = s.schedule([prefilling(100_000, done=8192)], 0).chunk
    assert after < before
    assert s.steps.clocks[SHORT].seconds(after, 8192 + after // 2) <= s.steps.step_seconds


def test_one_slow_step_does_not_shrink_every_chunk_after_it():
    s = make()
    plan = s.schedule([prefilling(100_000, done=8192)], 0)
    for seconds in (plan.expected_seconds, 3.0, plan.expected_seconds):  # a kernel build
        s.observe(took(seconds), 1)
    assert s.schedule([prefilling(100_000, done=8192)], 0).chunk == plan.chunk


def test_a_shape_far_slower_than_the_clock_expects_gets_a_smaller_chunk_from_then_on():
    s = make()
    deep = [prefilling(100_000, done=16_384)]
    deeper = [prefilling(100_000, done=32_768)]
    shallow = [prefilling(100_000, done=0)]
    chunk = s.schedule(deep, 0).chunk

    def step(state: list[Running], seconds: float | None = None) -> None:
        """A step of `state` that took `seconds` (None: what the start-up probe
        predicts, so that the clock's own correction comes back to none)."""
        plan = s.schedule(state, 0)
        correction = s.steps.clocks[SHORT].correction(state[0].context)
        s.observe(took(plan.expected_seconds / correction if seconds is None else seconds), 1)

    def slow_deep_step() -> None:
        step(deep, 10 * s.steps.step_seconds)
        step(deep)
        step(deep)

    slow_deep_step()  # once: a one-off (a compile, a copy)
    assert s.schedule(deep, 0).chunk == chunk
    slow_deep_step()  # twice: this shape is slow at this context
    assert s.schedule(deep, 0).chunk < chunk
    # A short prompt's step does not fill its chunk: however slow, it tells
    # nothing of what that chunk costs.
    fresh_chunk = s.schedule(shallow, 0).chunk
    for _ in range(2):
        step([prefilling(40)], 10 * s.steps.step_seconds)
        step(shallow)
        step(shallow)
    assert s.schedule(shallow, 0).chunk == fresh_chunk
    # Other contexts keep their chunks, as do shapes only somewhat over the budget.
    deeper_chunk = s.schedule(deeper, 0).chunk
    for _ in range(3):
        step(deeper, 1.5 * s.steps.step_seconds)
        step(deeper)
        step(deeper)
    assert s.schedule(deeper, 0).chunk == deeper_chunk


# Three streams growing to 14,000 tokens each, in a budget where a request that
# may grow to 22k tokens fits alone but not beside them (they grow long while
# it lives).
STREAMS = [decoding(4000, max_tokens=10_000)] * 3


def test_a_request_that_does_not_fit_lets_smaller_ones_pass():
    s = make(budget_mib=230)
    s.add([req(1, 5000, max_tokens=17_000), req(2, 200)], now=0)
    plan = s.schedule(STREAMS, 0, now=0)
    assert keys(plan.admit) == [2]
    assert plan.waiting_for_memory == 1 and len(s) == 1


def test_an_aged_request_that_does_not_fit_holds_back_younger_ones():
    s = make(budget_mib=230)
    s.add([req(1, 5000, max_tokens=17_000)], now=0)
    s.add([req(2, 200)], now=AGING_SECONDS)
    plan = s.schedule(STREAMS, 0, now=AGING_SECONDS + 0.1)
    assert keys(plan.admit) == []
    assert len(s) == 2
    # Once the batch has room, the aged one goes first.
    assert keys(s.schedule([], 0, now=AGING_SECONDS + 1).admit)[0] == 1


def test_a_request_that_can_never_fit_is_refused():
    s = make(budget_mib=250)
    s.add([req(1, 100_000), req(2, 100)], now=0)
    plan = s.schedule([], 0, now=0)
    assert keys(plan.refuse) == [1] and keys(plan.admit) == [2]


def test_a_full_batch_admits_nobody_and_counts_its_slots():
    s = make(batch=2, rows=8)
    s.add([req(1, 10)], now=0)
    assert keys(s.schedule([decoding(), decoding()], 0, now=0).admit) == []
    rows = make(rows=1)
    rows.add([req(1, 10)], now=0)
    assert keys(rows.schedule([prefilling(100)], 0, now=0).admit) == []


def test_requests_put_back_after_an_error_go_first():
    s = make()
    s.add([req(1, 10)], now=0)
    s.put_back([req(7, 10), req(8, 10)])
    assert keys(s.schedule([], 0, now=0).admit) == [7, 8, 1]


def test_removed_requests_leave_the_room():
    s = make()
    s.add([req(1, 10), req(2, 10)], now=0)
    assert keys(s.remove([2, 99])) == [2]
    assert keys(s.schedule([], 0, now=0).admit) == [1]


def test_an_idle_batch_plans_no_step():
    assert make().schedule([], 0).chunk is None


def test_a_long_prompt_starts_beside_short_ones_in_its_own_lane():
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    s.add([req(1, 2 * long_tokens), req(2, 40)], now=0)
    plan = s.schedule([decoding(40)], 0, now=0)
    assert keys(plan.admit) == [2, 1] and plan.long == (1,)


def test_where_shapes_cost_a_build_a_first_seen_shape_does_not_shrink_later_chunks():
    built: set[tuple[int, int, int]] = set()  # a backend where a shape costs a build once
    s = make(builds=lambda rows, tokens, context: (rows, tokens, context) not in built)
    context = 8192
    first = s.schedule([prefilling(100_000, done=context)], 0)
    assert first.expected_seconds > s.steps.clocks[SHORT].seconds(first.chunk, context)
    built.add((1, first.chunk, context))
    s.observe(took(first.expected_seconds + 0.2), 1)  # the step also built its kernels
    again = s.schedule([prefilling(100_000, done=context)], 0)
    assert again.chunk == first.chunk  # the same shape: its tokens cost what they did
    assert again.expected_seconds == first.expected_seconds
    # A shape not seen yet now counts what a build costs, and gets a smaller chunk
    # when its build would not fit the budget beside the largest one.
    further = s.schedule([prefilling(100_000, done=context + 4 * 2048)], 0)
    assert further.expected_seconds <= s.steps.step_seconds or further.chunk < first.chunk
    clock = s.steps.clocks[SHORT]
    assert further.expected_seconds > clock.seconds(further.chunk, context + 4 * 2048)


def test_where_attention_runs_padded_each_turn_of_a_long_history_keeps_to_the_budget():
    windows = windows_for(2048)

    def attended(rows: int, tokens: int, context: int) -> int:
        return shape_key(rows, tokens, context + tokens, rows == 1, windows)[1]

    def device(tokens: int, context: int) -> float:
        """What a pass takes where attention runs its padded queries (CUDA)."""
        queries = attended(1, tokens, context)
        return tokens * SPEED.per_token + queries * SPEED.per_context * (context + tokens / 2)

    s = make(step_ms=150, attended=attended)
    context = 20_000
    for _ in range(4):  # turns of 2,100 tokens: each ends in a short, padded chunk
        end, done = context + 2100, context
        while done < end - 1:
            plan = s.schedule([prefilling(end, done=done, long=True)], 0)
            passes = []
            for chunk in plan.long_chunks:
                tokens = min(chunk, end - 1 - done)
                passes.append(device(tokens, done) if tokens > 0 else 0.0)
                done += max(tokens, 0)
            s.observe(Passes(long=tuple(passes)), 1)
            assert sum(passes) <= s.steps.step_seconds  # a running stream's pause
            assert abs(plan.expected_seconds - sum(passes)) <= 0.05 * sum(passes)
        context = end + 32


def test_a_turns_new_tokens_after_a_cached_history_take_one_pass_wherever_they_end():
    windows = windows_for(2048)

    def attended(rows: int, tokens: int, context: int) -> int:
        return shape_key(rows, tokens, context + tokens, rows == 1, windows)[1]

    history = 20_000 + 32  # not on the chunks' grid
    s = make(step_ms=1000, attended=attended)
    for lane in (False, True):
        turn = s.schedule([prefilling(history + 2000, done=history, long=lane)], 0)
        assert (turn.long_chunks[:1] if lane else (turn.chunk,)) == (1999,)
    # More than a chunk to go: first to the grid, as ever.
    assert s.schedule([prefilling(history + 3000, done=history)], 0).chunk == 448
    # Where the one pass would not fit the step budget (its attention padded to
    # the spanning window), first to the grid too.
    tight = make(step_ms=150, attended=attended)
    turn = tight.schedule([prefilling(history + 2000, done=history)], 0)
    assert turn.chunk == 448 and turn.expected_seconds <= 0.15


def test_no_long_prompt_starts_in_the_step_where_the_one_before_ends():
    s = make()
    s.add([req(1, 40), req(2, 30_000)], now=0)
    # Every prompt token but the last is in: it joins its lane's decoding rows next.
    ending = prefilling(30_000, done=30_000 - 1, long=True)
    assert ending.remaining == 0 and ending.cost.prefilling
    assert keys(s.schedule([ending], 0, now=0).admit) == [1]
    assert keys(s.schedule([decoding(30_000)], 0, now=0).admit) == [2]


def test_an_aged_long_prompt_goes_first_and_a_chat_still_starts_beside_it():
    s = make()
    s.add([req(1, 30_000)], now=0)
    s.add([req(2, 40)], now=AGING_SECONDS)
    first = s.schedule([], 0, now=AGING_SECONDS)
    assert keys(first.admit) == [1, 2] and first.long == (1,)


class Cached:
    """A prefix cache holding `tokens` of every prompt in entry 7, and for
    prompts over 1,000 tokens a read from disk that ends when the test says so."""

    def __init__(self, tokens: int, entry_bytes: int = MIB, reading: bool = False) -> None:
        self.version = 0
        self.tokens = tokens
        self.entry_bytes = entry_bytes
        self.read = Read() if reading else None

    def reuse(self, prompt):
        return Reuse(self.tokens, 7, self.entry_bytes) if self.tokens else Reuse()

    def fetch(self, prompt, reuse):
        return self.read if len(prompt) > 1000 else None


class Read:
    done = False
    failed = False
    deadline = 100.0


def test_a_long_history_from_the_cache_goes_to_the_long_lane_where_it_is_free():
    # 10 tokens to prefill, but 40k long: beside chats it would pad their rows.
    s = make(prefixes=Cached(39_990))
    s.add([req(1, 40_000)], now=0)
    plan = s.schedule([], 0, now=0)
    assert keys(plan.admit) == [1] and plan.long == (1,)
    assert plan.keep == (7,)
    # Beside a long prompt prefilling it starts at once all the same, in the short lane.
    busy = make(prefixes=Cached(39_990))
    busy.add([req(1, 40_000)], now=0)
    plan = busy.schedule([prefilling(20_000, done=4096, long=True)], 0, now=0)
    assert keys(plan.admit) == [1] and plan.long == ()
    # An exact repeat has only its last token to run: the long lane runs once.
    repeat = make(prefixes=Cached(39_999))
    repeat.add([req(1, 40_000)], now=0)
    plan = repeat.schedule([], 0, now=0)
    assert plan.long == (1,) and plan.long_chunks == ()


def test_the_entry_a_request_reuses_stays_beside_it_where_memory_holds_both():
    def plan(entry_mib: int) -> Plan:
        s = make(150, prefixes=Cached(9_000, entry_mib * MIB))
        s.add([req(1, 9_016)], now=0)
        return s.schedule([], 0, now=0)

    both = plan(10)
    assert keys(both.admit) == [1] and both.keep == (7,) and both.release == ()
    # No room for both: it starts all the same, from its entry, which stays
    # until its row has a copy and leaves the cache then.
    one = plan(40)
    assert keys(one.admit) == [1] and one.keep == (7,) and one.release == (7,)


def test_an_entry_others_wait_for_stays_and_the_request_waits_for_room_beside_it():
    # 40 MiB of shared prefix (a document), a stream running beside it, room
    # for the entry or a second row, not both.
    def plan(*waiting: int, running: bool = True) -> Plan:
        s = make(150, prefixes=Cached(9_000, 40 * MIB))
        s.add([req(key, 9_016) for key in waiting], now=0)
        return s.schedule([decoding(9_000)] if running else [], 0, now=0)

    # Alone, it starts from the entry, which leaves once its row has a copy.
    alone = plan(1)
    assert keys(alone.admit) == [1] and alone.release == (7,)
    # Others want the entry too: letting it go would make each prefill the
    # whole document again. They wait for the stream's room, the entry kept.
    shared = plan(1, 2, 3)
    assert shared.admit == () and shared.release == () and shared.wanted == (7,)
    assert shared.waiting_for_memory == 3
    # Nothing running frees room: the first starts all the same.
    idle = plan(1, 2, 3, running=False)
    assert keys(idle.admit)[:1] == [1] and idle.release == (7,)


def test_a_request_waits_for_its_prefix_from_disk_until_read_or_its_deadline():
    cached = Cached(0, reading=True)
    s = make(prefixes=cached)
    s.add([req(1, 3000), req(2, 40)], now=0)
    assert keys(s.schedule([], 0, now=1).admit) == [2]  # the other one waits for its read
    cached.read.done, cached.tokens, cached.version = True, 2990, 1
    plan = s.schedule([], 0, now=2)
    assert keys(plan.admit) == [1] and plan.keep == (7,)  # what memory holds now
    late = Cached(0, reading=True)
    s = make(prefixes=late)
    s.add([req(1, 3000)], now=0)
    assert keys(s.schedule([], 0, now=99).admit) == []
    assert keys(s.schedule([], 0, now=101).admit) == [1]  # past the deadline: prefills


def test_with_equal_lengths_only_short_prompts_prefill_together_at_one_length():
    s = make(equal_lengths=True)
    s.add([req(1, 300), req(2, 100), req(3, 300), req(4, 100)], now=0)
    assert keys(s.schedule([], 0, now=0).admit) == [2, 4]  # the shortest first, one length
    # Beside a prompt with 299 tokens left, only another of as many starts.
    s.add([req(5, 300)], now=1)
    assert keys(s.schedule([prefilling(300)], 0, now=1).admit) == [1, 3, 5]
    # Without the rule they would all have gone together.
    free = make()
    free.add([req(1, 300), req(2, 100), req(3, 300), req(4, 100)], now=0)
    assert keys(free.schedule([], 0, now=0).admit) == [2, 4, 1, 3]


def stream(key: int, length: int, left: int = 10_000) -> Running:
    """A sequence decoding in the short lane, `length` tokens in its cache, `left` to go."""
    return Running(Cost(length, length + left, 0), 0, length, key)


def test_a_stream_grown_long_leaves_the_chats_lane_while_the_long_lane_prefills_nothing():
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    grown, chat = stream(1, long_tokens + 10), stream(2, 60, left=20)
    assert s.schedule([grown, chat], 0, now=0).move == (1,)
    assert s.schedule([grown], 0, now=0).move == ()  # alone: no chat to spare its padding
    assert s.schedule([stream(1, long_tokens - 10), chat], 0, now=0).move == ()  # not long yet
    busy = prefilling(3 * long_tokens, done=long_tokens, long=True)
    assert s.schedule([grown, chat, busy], 0, now=0).move == ()  # it would be padded to that


def test_streams_grown_long_leave_the_chats_lane_together():
    # One at a time, both lanes would run a pass each step until the last moved
    # (each pass over 32k-token rows about as long as one over all of them).
    s = make()
    long_tokens = LONG_PROMPT_STEPS * s.steps.row_chunk(1, 0)
    grown = [stream(key, long_tokens + 10 * key) for key in (1, 2, 3)]
    chat = stream(4, 60, left=20)
    assert s.schedule([*grown, chat], 0, now=0).move == (3, 2, 1)
    # Only long streams in the chats' lane: moving them spares nothing...
    assert s.schedule(grown, 0, now=0).move == ()
    # ...unless the long lane decodes too: then one pass a step serves them all.
    there = Running(Cost(long_tokens + 5, long_tokens + 100, 0, True), 0, long_tokens + 5, 9)
    assert s.schedule([*grown, there], 0, now=0).move == (3, 2, 1)
    # As many as memory holds there.
    tight = make(budget_mib=210)  # two of them there: 199 MiB in all; three: 220
    assert tight.schedule([*grown, chat], 0, now=0).move == (3, 2)


def test_a_stream_moves_sooner_where_chats_wait_for_the_memory_its_padding_holds():
    s = make(budget_mib=140)
    running = [stream(1, 3000, left=100)]
    s.add([req(key, 200) for key in range(2, 10)], now=0)
    plan = s.schedule(running, 0, now=0)
    assert plan.waiting_for_memory and plan.move == (1,)
    moved = [Running(Cost(3001, 3100, 0, True), 0, 3000, 1)]  # as the batch then holds it
    chats = [Running(Cost(200, 216, 0, generated=1), 0, 200, 2 + i) for i in range(len(plan.admit))]
    assert keys(s.schedule(moved + chats, 0, now=0).admit) == list(range(2 + len(chats), 10))


def test_on_a_machine_too_slow_for_the_minimum_chunk_prompts_move_in_smaller_ones():
    """The minimum chunk keeps a pass's fixed part (the weights read, the
    streams decoded) from wasting the device. Where 128 prompt tokens take
    seconds (a large model on a CPU: 26 ms a token, 150 ms a pass that only
    decodes), a running stream beside a long prompt would wait that long
    between tokens; there a chunk whose prompt work is four decoding passes'
    worth wastes little, and the pause shrinks to under a second."""
    s = make(step_ms=150, speed=PrefillSpeed(per_token=0.026, per_context=0.0))
    assert s.schedule([prefilling(10_000)], 0).chunk == MIN_STEP_TOKENS  # no pass timed yet
    for _ in range(20):
        s.schedule([decoding()], 0)
        s.observe(took(0.15), 1)
    short = s.schedule([prefilling(10_000), decoding()], 0)
    assert short.chunk == 32 and short.expected_seconds < 1.0  # 0.83 s of prompt work
    long = s.schedule([prefilling(100_000, done=4096, long=True), decoding()], 0)
    assert long.long_chunks == (32,)
    # A question is no long prompt for that: it does not wait for the document.
    s.add([req(1, 400)], now=0)
    beside = s.schedule([prefilling(100_000, done=4096, long=True), decoding()], 0, now=0)
    assert keys(beside.admit) == [1] and beside.long == ()
    fast = make(step_ms=150)  # 40 us a token: 128 tokens are under a decoding pass
    for _ in range(20):
        fast.schedule([decoding()], 0)
        fast.observe(took(0.15), 1)
    assert fast.schedule([prefilling(10_000)], 0).chunk == MIN_STEP_TOKENS
