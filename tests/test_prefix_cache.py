"""The prefix cache: the store on its own, then through a worker.

The store tests use MLX in the test process, on the main thread only (each
builds, stores and reads its arrays there); the worker tests compare a worker
with the cache against one without it, under greedy decoding.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from smg_mlx.demo_model import build_model
from smg_mlx.engine.prefix_cache.cache import PrefixCache
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier, Pace

from conftest import build_once
from helpers import abort_after, collect, generate, prompt, request, wait_until

# ---- the store ----


def kv(tokens: list[int], layers: int = 2) -> list[KVCache]:
    """A cache whose key at position i is tokens[i], so tests can read back what it holds."""
    cache = []
    for _ in range(layers):
        layer = KVCache()
        x = mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)
        layer.update_and_fetch(x, x)
        cache.append(layer)
    return cache


def held(cache: list) -> list[int]:
    """The tokens a cache built by `kv` holds."""
    keys, _ = cache[0].keys_and_values()
    return [int(t) for t in keys[0, 0, :, 0].tolist()]


def rotating(tokens: list[int], window: int) -> list[RotatingKVCache]:
    layer = RotatingKVCache(max_size=window)
    for t in tokens:  # one at a time, as decoding does: the window wraps
        x = mx.array([t], dtype=mx.float32).reshape(1, 1, 1, 1)
        layer.update_and_fetch(x, x)
    return [layer]


def recurrent() -> list[ArraysCache]:
    layer = ArraysCache(1)
    layer[0] = mx.zeros((1, 4))
    return [layer]


A = list(range(100, 120))


def test_longest_prefix_is_found_and_trimmed():
    store = MemoryTier(1 << 30)
    store.insert(A, kv(A))
    store.insert(A[:5] + [7, 8, 9], kv(A[:5] + [7, 8, 9]))
    # Extends A: all of A, no trimming.
    cache, n, _ = store.lookup(A + [1, 2])
    assert n == 20 and held(cache) == A and cache[0].offset == 20
    # Diverges from A after 12 tokens: A cut back to 12.
    cache, n, _ = store.lookup(A[:12] + [3, 4])
    assert n == 12 and cache[0].offset == 12 and held(cache) == A[:12]
    # Shares 7 with the second entry, 5 with A.
    cache, n, _ = store.lookup(A[:5] + [7, 8, 4, 4])
    assert n == 7 and held(cache) == A[:5] + [7, 8]
    assert store.lookup([1, 2, 3]) == (None, 0, None)


def test_a_whole_prompt_match_leaves_one_token_and_the_entry_intact():
    store = MemoryTier(1 << 30)
    store.insert(A, kv(A))
    cache, n, _ = store.lookup(A)
    assert n == len(A) - 1 and held(cache) == A[:-1]
    cache[0].trim(10)  # the caller owns what it got
    assert store.lookup(A + [5])[1] == len(A)
    assert store.lookup(A[:1]) == (None, 0, None)  # one token: nothing to reuse


def test_non_trimmable_caches_serve_only_prompts_that_extend_them():
    store = MemoryTier(1 << 30)
    wrapped = rotating(A, window=8)  # 20 tokens through an 8-token window
    assert not wrapped[0].is_trimmable()
    store.insert(A, wrapped)
    cache, n, _ = store.lookup(A + [1])
    assert n == 20 and cache[0].offset == 20
    assert store.lookup(A) == (None, 0, None)  # would need a trim
    assert store.lookup(A[:10] + [1, 2]) == (None, 0, None)
    # A shorter exact prefix is the fallback; a trimmable one is not made redundant.
    store.insert(A[:6], rotating(A[:6], window=8))
    assert store.lookup(A)[1] == 6
    assert store.lookup(A[:10] + [1, 2])[1] == 6
    store.insert([1, 2, 3], recurrent())
    assert store.lookup([1, 2, 3, 4])[1] == 3
    assert store.lookup([1, 2, 3]) == (None, 0, None)
    assert store.lookup([1, 2, 5, 5]) == (None, 0, None)
    assert len(store) == 3


def test_a_reused_entry_is_not_changed_by_its_user():
    store = MemoryTier(1 << 30)
    store.insert([1, 2, 3, 4], recurrent())
    cache, _, _ = store.lookup([1, 2, 3, 4, 5])
    cache[0][0] = mx.ones((1, 4))
    again, _, _ = store.lookup([1, 2, 3, 4, 5])
    assert again[0][0].sum().item() == 0


def test_longer_trimmable_entries_replace_their_prefixes():
    store = MemoryTier(1 << 30)
    store.insert(A[:5], kv(A[:5]))
    store.insert(A[:10], kv(A[:10]))
    store.insert(A[:10] + [1], kv(A[:10] + [1]))
    assert len(store) == 1
    assert store.lookup(A[:5] + [0])[1] == 5
    store.insert(A[:10], kv(A[:10]))  # already covered by a longer one
    assert len(store) == 1
    store.insert(A[:10] + [1], kv(A[:10] + [1]))  # same key again: replaced, not doubled
    assert len(store) == 1 and store.nbytes == sum(c.nbytes for c in kv(A))
    # A non-trimmable entry is not covered by a longer one, nor does it cover its prefixes.
    store.insert(A[:10] + [1, 2], rotating(A[:10] + [1, 2], window=4))
    store.insert(A[:4] + [0], rotating(A[:4] + [0], window=2))
    store.insert(A[:4], rotating(A[:4], window=2))
    assert len(store) == 4


def keep(store: MemoryTier, key: list[int]) -> None:
    """Insert, then apply the byte budget, as the engine does each turn."""
    store.insert(key, kv(key))
    store.drop(store.over(store.max_bytes))


def test_byte_bound_and_lru_order():
    size = sum(c.nbytes for c in kv([1]))
    store = MemoryTier(3 * size)
    keys = [[i, i + 1, i + 2] for i in range(0, 50, 10)]
    for key in keys[:3]:
        keep(store, key)
    assert store.nbytes == 3 * size and len(store) == 3
    store.lookup(keys[0] + [99])  # keys[0] is now the most recently used
    keep(store, keys[3])
    assert store.nbytes <= 3 * size
    present = [store.lookup(k + [99])[1] == 3 for k in keys[:4]]
    assert present == [True, False, True, True]  # keys[1] was least recently used
    keep(store, keys[4])
    # The lookups above touched 0, 2, 3 in that order: 0 goes next.
    assert [store.lookup(k + [99])[1] for k in keys] == [0, 0, 3, 3, 3]
    assert store.nbytes == 3 * size


def test_a_match_below_the_minimum_is_a_miss_and_no_use():
    size = sum(c.nbytes for c in kv([1]))
    store = MemoryTier(2 * size)
    old, new = [1, 2, 3], [5, 6, 7]
    keep(store, old)
    keep(store, new)
    assert store.lookup([1, 2, 9], minimum=3) == (None, 0, None)
    assert store.lookup([1, 2, 9], minimum=2)[1] == 2
    store.lookup([5, 6, 9])  # `new` is used last: `old` goes first
    store.lookup([1, 9], minimum=2)  # too short: must not refresh `old`
    keep(store, [8, 9, 10])
    assert store.lookup([1, 2, 3, 4])[1] == 0 and store.lookup([5, 6, 7, 4])[1] == 3


def test_an_entry_larger_than_the_budget_is_not_kept():
    size = sum(c.nbytes for c in kv([1]))
    store = MemoryTier(size - 1)
    keep(store, [1, 2, 3])
    assert len(store) == 0 and store.nbytes == 0
    assert store.lookup([1, 2, 3, 4]) == (None, 0, None)


def test_many_entries_keep_the_tree_consistent():
    # Random inserts under a tight budget: every lookup must return a cache
    # holding exactly the reused prefix of its prompt.
    import random

    rng = random.Random(0)
    size = sum(c.nbytes for c in kv([1]))
    store = MemoryTier(6 * size)
    for _ in range(300):
        key = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        keep(store, key)
        assert store.nbytes <= 6 * size
        probe = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        cache, n, _ = store.lookup(probe)
        assert n < len(probe)
        if cache is not None:
            assert held(cache) == probe[:n]


def test_a_replica_given_the_same_inserts_and_drops_holds_the_same():
    # A follower rank's store, whose caches differ in size (its shard), drops
    # what rank 0's store says to drop and so holds the same prefixes.
    size = sum(c.nbytes for c in kv([1]))
    leader, follower = MemoryTier(3 * size), MemoryTier(1 << 30)
    keys = [[i, i + 1, i + 2, i + 3] for i in range(0, 60, 10)]
    for key in keys:
        leader.insert(key, kv(key))
        follower.insert(key, kv(key, layers=1))
        leader.lookup(keys[0] + [99])
        follower.lookup(keys[0] + [99])
        ids = leader.over(leader.max_bytes)
        leader.drop(ids)
        follower.drop(ids)
    assert [leader.lookup(k + [99])[1] for k in keys] == [
        follower.lookup(k + [99])[1] for k in keys
    ]
    assert len(leader) == len(follower) == 3


# ---- through a worker ----


@pytest.fixture(scope="module")
def pair(model_dir):
    """A worker with the prefix cache and one without, on the same model."""
    from conftest import RunningWorker, worker_config

    cached = RunningWorker(worker_config(model_dir))
    cold = RunningWorker(worker_config(model_dir, prompt_cache_bytes=0))
    yield cached, cold
    cached.stop()
    cold.stop()


def test_greedy_output_with_the_cache_equals_output_without(pair):
    cached, cold = pair
    base = prompt(80, 3)
    first = generate(cached.stub, base, max_tokens=16)
    assert first.complete.cached_tokens == 0
    out = first.tokens
    cases = {
        "exact repeat": (base, len(base) - 1),
        "extends prompt and answer": (base + out + prompt(9, 5), len(base) + len(out)),
        "extends the prompt only": (base + prompt(9, 6), len(base)),
        "diverges": (base[:50] + prompt(30, 7), 50),
        "shares too little to be worth it": (base[:10] + prompt(70, 8), 0),
    }
    for name, (ids, reused) in cases.items():
        want = generate(cold.stub, ids, max_tokens=16)
        got = generate(cached.stub, ids, max_tokens=16)
        assert got.tokens == want.tokens, name
        assert got.complete.cached_tokens == reused, name
        assert all(c.cached_tokens == reused for c in got.chunks), name
        assert want.complete.cached_tokens == 0
        whole = generate(cached.stub, ids, max_tokens=16, stream=False)
        assert whole.tokens == want.tokens and whole.complete.cached_tokens >= reused, name


def test_concurrent_requests_on_shared_prefixes(pair):
    cached, cold = pair
    system = prompt(120, 11)
    generate(cached.stub, system + [7], max_tokens=4)  # leaves `system` in the cache
    prompts = []
    for i in range(12):
        if i % 3 == 0:
            prompts.append(system + prompt(5 + i, i))  # extends it
        elif i % 3 == 1:
            prompts.append(system[: 40 + 5 * i] + prompt(20, i))  # diverges inside it
        else:
            prompts.append(system)  # repeats it
    want = [generate(cold.stub, p, max_tokens=20).tokens for p in prompts]
    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda p: generate(cached.stub, p, max_tokens=20), prompts))
    assert [g.tokens for g in got] == want
    assert all(g.complete.cached_tokens >= 40 for g in got)


def test_conversations_that_end_together_continue_from_the_cache_exactly(pair):
    # Started together and asked for as many tokens, they end in one pass
    # (their rows are copied out of the batch together); prompts of
    # different lengths leave them different paddings there.
    cached, cold = pair
    firsts = [prompt(30 + 7 * i, 40 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda p: generate(cached.stub, p, max_tokens=12), firsts))
    assert len({tuple(a.tokens) for a in answers}) > 1, "output should vary"
    pairs = enumerate(zip(firsts, answers, strict=True))
    nexts = [p + a.tokens + prompt(5, 60 + i) for i, (p, a) in pairs]
    want = [generate(cold.stub, p, max_tokens=12).tokens for p in nexts]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: generate(cached.stub, p, max_tokens=12), nexts))
    assert [g.tokens for g in got] == want
    held = [len(p) + len(a.tokens) for p, a in zip(firsts, answers, strict=True)]
    assert [g.complete.cached_tokens for g in got] == held


def test_penalties_see_the_cached_tokens(pair):
    # A repetition penalty looks back over the last 20 tokens, most of them
    # cached here: the model's own favourite tokens, which it would repeat.
    cached, cold = pair
    ids = prompt(30, 9)
    ids += generate(cold.stub, ids, max_tokens=20).tokens
    generate(cached.stub, ids, max_tokens=4)
    want = generate(cold.stub, ids, max_tokens=12, repetition_penalty=5.0)
    got = generate(cached.stub, ids, max_tokens=12, repetition_penalty=5.0)
    assert got.complete.cached_tokens == len(ids) - 1
    assert got.tokens == want.tokens


def test_an_aborted_sequence_leaves_its_cache(pair):
    cached, cold = pair
    ids = prompt(70, 21)
    abort_after(cached.stub, ids, 5)
    r = generate(cached.stub, ids + [9], max_tokens=8)
    assert r.complete.cached_tokens == len(ids)
    assert r.tokens == generate(cold.stub, ids + [9], max_tokens=8).tokens


def test_abort_during_prefill_keeps_the_worker_sound(start_worker, model_dir):
    # Small prefill steps: a long prompt is likely still being prefilled when it
    # is aborted; many answer tokens make sure it cannot finish first.
    w = start_worker(model_dir, prefill_step_size=4)
    ids = prompt(1200, 4)
    call = w.stub.Generate(request(ids, max_tokens=500, ignore_eos=True), timeout=60)
    threading.Timer(0.05, call.cancel).start()
    with pytest.raises(grpc.RpcError):
        collect(call)
    time.sleep(0.2)
    again = generate(w.stub, ids + [5], max_tokens=6)
    assert again.complete.finish_reason == "length"
    fresh = start_worker(model_dir, prompt_cache_bytes=0)
    assert again.tokens == generate(fresh.stub, ids + [5], max_tokens=6).tokens


def test_sliding_window_caches_are_reused_only_whole(start_worker, tmp_path):
    # Every other layer keeps a 32-token window: once a sequence passes 32
    # tokens its cache cannot be cut back, so only prompts that extend its
    # whole key may reuse it.
    model = build_model(tmp_path / "tiny-sliding", ["--sliding-window", "32"])
    cached = start_worker(model)
    cold = start_worker(model, prompt_cache_bytes=0)

    def same(ids: list[int]) -> int:
        got = generate(cached.stub, ids, max_tokens=6)
        assert got.tokens == generate(cold.stub, ids, max_tokens=6).tokens
        return got.complete.cached_tokens

    long = prompt(40, 2)
    assert same(long) == 0
    out = generate(cold.stub, long, max_tokens=6).tokens
    assert same(long) == 0  # the same prompt would need a cut: not reused
    assert same(long[:20] + prompt(5, 3)) == 0  # diverging: not reused
    assert same(long + out + [7]) == len(long) + len(out)  # extends it whole
    short = prompt(20, 4)  # 26 tokens with its answer: within the window
    assert same(short) == 0
    assert same(short) == len(short) - 1  # cut back by one


def test_without_a_cap_a_large_entry_stays_until_memory_is_needed():
    store = MemoryTier()  # bounded by the memory budget alone
    big = list(range(5000))
    store.insert(big, kv(big))
    assert store.over(10 * store.nbytes) == []  # room enough: kept, whatever its size
    (id,) = store.over(store.nbytes - 1)  # a request needs the room: it goes
    store.drop([id])
    assert len(store) == 0


def test_memory_the_entries_hold_beside_their_own_counts_against_the_cap():
    # (the batch blocks kept entries view: ended_rows.SharedBlocks.waste)
    keys = [[i, i + 1, i + 2] for i in range(0, 30, 10)]
    store = MemoryTier(3 * sum(c.nbytes for c in kv(keys[0])))
    for key in keys:
        store.insert(key, kv(key))
    assert store.over(10 * store.nbytes) == []  # within the cap
    assert len(store.over(10 * store.nbytes, besides=1)) == 1  # past it with what they keep
    assert len(store.over(store.nbytes, besides=store.nbytes)) == 3


def test_entries_a_request_reuses_stay_those_carried_by_a_running_row_go_first_but_wanted_last():
    store = MemoryTier()
    keys = [[i, i + 1, i + 2] for i in range(0, 40, 10)]
    for key in keys:
        store.insert(key, kv(key))
    size = store.nbytes // len(keys)
    entries = [store.lookup(k + [99])[2] for k in keys]  # used in order: keys[0] is oldest
    store.carry(entries[2], 1)  # a running row holds all of it
    first = store.over(3 * size)
    assert first == [entries[2].id]
    # Pinned for a request starting now: never dropped, even if least recently used.
    assert entries[0].id not in store.over(0, keep={entries[0].id})
    # Requests waiting to start reuse it: it goes last (a row's copy serves that row alone).
    assert store.over(3 * size, wanted={entries[2].id}) == [entries[0].id]
    assert store.over(0, wanted={entries[2].id})[-1] == entries[2].id
    store.carry(entries[2], -1)
    assert store.over(3 * size) == [entries[0].id]


def take_turns(cache: PrefixCache, sessions: int, turns: int, first: int, more: int) -> list[int]:
    """Conversations taking turns, each sending its history and `more` new
    tokens (`first` on its first turn) and answering 7 tokens, the cache held
    to its cap as the engine holds it; how many were served their whole
    history from memory at each turn."""
    histories: list[list[int]] = [[] for _ in range(sessions)]
    served = []
    for turn in range(turns):
        served.append(0)
        for s, history in enumerate(histories):
            new = more if turn else first
            sent = history + [s * 10_000 + turn * 1_000 + i for i in range(new)]
            start = cache.start_from(sent)
            served[-1] += bool(history) and start.tokens == len(history)
            history[:] = sent + [7] * 7
            cache.keep(history, kv(history), start.pace)
            cache.drop(cache.over(cache.memory.max_bytes)[0])
    return served


def test_conversations_taking_turns_past_memory_keep_those_that_fit_served():
    """Four conversations take turns, their histories outgrowing memory. Least
    recently used alone drops each one just before its turn comes back (none
    served from turn 4 on); those memory serves keep their entries."""
    unit = sum(c.nbytes for c in kv([1]))  # the arrays of up to 256 tokens
    # Each history takes 1, 2, 2, 3, 3, 4 then 4 units after turns 1-7: the turn
    # that outgrows memory drops one served entry (the least recently used).
    served = take_turns(PrefixCache(10 * unit), 4, 7, first=249, more=121)
    assert served == [0, 4, 4, 3, 3, 2, 2]


def test_conversations_past_memory_from_their_first_turn_keep_those_that_fit_served():
    """Six conversations, memory for three: least recently used serves none
    ever. Those coming back to find their entries gone (their keys are
    remembered) have their new entries dropped first, so three are served."""
    unit = sum(c.nbytes for c in kv([1]))
    served = take_turns(PrefixCache(3 * unit), 6, 5, first=200, more=4)
    assert served == [0, 0, 3, 3, 3]


def _entry_bytes(pair, length: int, offset: int) -> int:
    """The bytes a worker's cache entry of a `length`-token prompt takes (measured
    on `pair`'s worker with the cache)."""
    cached, _ = pair
    engine = cached.worker.engine
    before = engine.cache.memory_bytes
    generate(cached.stub, prompt(length, offset), max_tokens=2)
    assert wait_until(lambda: engine.cache.memory_bytes != before)
    return engine.cache.memory_bytes - before


def test_the_cache_keeps_to_its_cap_once_the_worker_is_idle(start_worker, model_dir, pair):
    size = _entry_bytes(pair, 300, 50)
    cap = size * 5 // 2
    w = start_worker(model_dir, prompt_cache_bytes=cap)
    for offset in range(51, 54):
        generate(w.stub, prompt(300, offset), max_tokens=2)
    # The last request's entry came after the worker last planned: it must not wait
    # for the next request to be held to the cap.
    assert wait_until(lambda: w.worker.engine.cache.memory_entries == 2)
    assert w.worker.engine.cache.memory_bytes <= cap


def test_rows_ending_beside_the_one_kept_hold_nothing_past_the_cap(start_worker, model_dir, pair):
    """--prompt-cache-bytes bounds all the memory the cache holds: the rows a
    pass ends leave the batch as one block, and where the cache keeps only one
    of them (the others' tokens it holds already, in longer entries), it keeps
    none of the others' bytes."""
    size = _entry_bytes(pair, 74, 70)  # as long as a first below and its answer
    cap = 16 * size
    w = start_worker(model_dir, prompt_cache_bytes=cap, prompt_cache_disk_bytes=0,
                     burst_window_seconds=0.05)  # fmt: skip
    engine = w.worker.engine

    def together(prompts: list[list[int]], n: int) -> list:
        # (as many as prefill together: they end in one pass)
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(
                lambda p: generate(w.stub, p, max_tokens=n, ignore_eos=True), prompts
            ))  # fmt: skip

    firsts = [prompt(60, 71 + i) for i in range(7)]
    together(firsts, 16)
    for r in range(6):
        # The firsts again, shorter (their entries hold them), and one more.
        out = together([*firsts, firsts[r] + [r + 3]], 8)
        assert [o.complete.cached_tokens for o in out] == [59] * 7 + [60]
        assert wait_until(lambda: 0 < engine.memory.prefix_cache <= cap), (
            engine.memory.prefix_cache, cap
        )  # fmt: skip
    assert engine.cache.memory_evicted == 0  # (7 + 6 entries fit: nothing had to go)


def test_a_worker_whose_cache_holds_two_of_four_sessions_serves_two(
    start_worker, model_dir, pair
):
    """Four sessions take turns, the cache (no disk tier) holding two of their entries."""
    largest = _entry_bytes(pair, 320, 40)  # as long as the histories grow
    w = start_worker(model_dir, prompt_cache_bytes=largest * 5 // 2)
    histories = [prompt(300, 41 + s) for s in range(4)]
    served = []
    for _ in range(5):
        served.append(0)
        for history in histories:
            sent = history + [5, 6, 7]
            out = generate(w.stub, sent, max_tokens=2)
            served[-1] += out.complete.cached_tokens == len(history)
            history[:] = sent + out.tokens
    # From the third turn on (the second finds its entries gone, and learns who returns).
    # Least recently used alone drops each entry just before its turn: none served.
    assert served[2:] == [2, 2, 2]


def test_a_returning_conversation_that_stays_away_counts_as_new_again():
    store = MemoryTier()
    old, new = list(range(100)), list(range(200, 300))
    returning, _ = store.insert(old, kv(old), pace=Pace(1.0, served=True))
    fresh, _ = store.insert(new, kv(new))  # a new conversation, kept later
    half = store.nbytes // 2
    assert store.over(half) == [fresh.id]
    returning.value.used -= 11  # no turn for 11 s: over 3 times its pace, and 10 s
    assert store.over(half) == [returning.id]  # now the least recently used of new ones


# ---- what a tight memory budget leaves the cache ----


def _budget_for(pair, extra_mib: float) -> int:
    """A memory budget of the model's weights (as `pair`'s workers measured them)
    and `extra_mib` MiB."""
    cached, _ = pair
    return cached.worker.engine.memory.weights + int(extra_mib * 2**20)


def test_a_prompt_resent_under_a_tight_budget_reuses_its_entry(start_worker, model_dir, pair):
    # Room for one request of about twice the prompt: reusing its entry needs less
    # than prefilling it again, so the entry must not go to make room for it.
    w = start_worker(model_dir, memory_budget_bytes=_budget_for(pair, 5))
    ids = prompt(600, 12)
    assert w.worker.engine.memory.longest_sequence < 3 * len(ids)
    first = generate(w.stub, ids, max_tokens=16)
    for _ in range(2):
        again = generate(w.stub, ids, max_tokens=16)
        assert again.complete.cached_tokens == len(ids) - 1
        assert again.tokens == first.tokens


def _wide_kv_workers(start_worker, models_root):
    """Much KV per token beside little else: a worker with 9 MiB beside the
    weights, and one of the same model without a prompt cache."""
    model = build_once(
        models_root / "wide-kv",
        ["--layers", "4", "--kv-heads", "4", "--head-dim", "64"],
    )
    budget = (model / "model.safetensors").stat().st_size + (9 << 20)
    return start_worker(model, memory_budget_bytes=budget), start_worker(
        model, prompt_cache_bytes=0
    )


def test_prompts_near_the_memory_limit_start_from_their_entries(start_worker, models_root):
    # A prompt's entry and its row's copy of it do not both fit, and the entry
    # leaves once copied. Before, such a prompt waited for room that never came
    # and, once it had waited 10 s, held back every request behind it.
    w, cold = _wide_kv_workers(start_worker, models_root)
    longest = w.worker.engine.memory.longest_sequence

    def within(stub, ids: list[int], max_tokens: int):
        return collect(stub.Generate(request(ids, max_tokens=max_tokens), timeout=30))

    for share in (0.8, 0.9, 0.97):
        ids = prompt(longest - 1, int(100 * share))
        within(w.stub, ids, 1)
        cut = ids[: int(share * longest)]
        out = within(w.stub, cut, longest - len(cut))
        assert out.complete.cached_tokens == len(cut) - 1
        assert out.tokens == within(cold.stub, cut, longest - len(cut)).tokens
        assert within(w.stub, prompt(10, 18), 4).complete.finish_reason == "length"
        assert within(w.stub, cut, 1).complete.cached_tokens == len(cut) - 1


def test_a_fresh_worker_holds_only_what_its_clients_sent(start_worker, model_dir):
    w = start_worker(model_dir)
    generate(w.stub, prompt(100, 16), max_tokens=4)
    # (kept once its end is out: the figure follows the answer by a step)
    assert wait_until(lambda: w.worker.engine.cache.memory_entries == 1)  # the warm-up's are gone


def test_an_entry_stays_while_memory_allows_and_goes_when_a_request_needs_the_room(
    start_worker, model_dir, pair
):
    w = start_worker(model_dir, memory_budget_bytes=_budget_for(pair, 5))
    engine = w.worker.engine
    longest = engine.memory.longest_sequence
    ids = prompt(longest // 2, 15)
    first = generate(w.stub, ids, max_tokens=8)
    assert wait_until(lambda: engine.cache.memory_entries == 1)  # nothing needs the room: kept
    again = generate(w.stub, ids + first.tokens + [7], max_tokens=8)
    assert again.complete.cached_tokens == len(ids) + len(first.tokens)
    # A request that needs nearly all the memory starts at once; the entry gives way.
    big = generate(w.stub, prompt(longest - 40, 16), max_tokens=8)
    assert big.complete.finish_reason == "length" and engine.cache.memory_evicted >= 1
    assert generate(w.stub, ids + [7], max_tokens=8).complete.cached_tokens == 0


def _chats_end_while_it_runs(w, long_prompt: list[int]):
    """Send `long_prompt` (500 tokens out) and, once it decodes, six chats of
    250 tokens: all six end while it still runs. Returns its response."""
    with ThreadPoolExecutor(7) as pool:
        long = pool.submit(generate, w.stub, long_prompt, max_tokens=500, ignore_eos=True)
        engine = w.worker.engine
        assert wait_until(lambda: engine.running == 1 and not engine.prefilling, 30)
        chats = [
            pool.submit(generate, w.stub, prompt(40, 14 + i), max_tokens=250, ignore_eos=True)
            for i in range(6)
        ]
        assert all(len(chat.result().tokens) == 250 for chat in chats)
        assert not long.done()
        response = long.result()
    assert len(response.tokens) == 500
    return response


def test_chats_beside_a_long_request_are_not_charged_its_length(start_worker, model_dir, pair):
    # A tiny step budget makes a 1,200-token prompt long: it runs in a lane of its
    # own, and chats in the other lane cost their own length only, so all six run
    # at once and end while the long request still generates. Charged the long
    # request's length, two at a time would fit, and the last would end after it.
    w = start_worker(
        model_dir, step_budget_seconds=1e-6, memory_budget_bytes=_budget_for(pair, 7)
    )
    _chats_end_while_it_runs(w, prompt(1200, 13))


def test_chats_beside_a_long_history_resent_from_the_cache_start_at_once(
    start_worker, model_dir, pair
):
    # The history has little to prefill once cached, but is long: in the chats'
    # lane each chat's row would be padded to its length, so few would fit
    # beside it. In the long prompts' lane all six run while it generates.
    w = start_worker(
        model_dir, step_budget_seconds=1e-6, memory_budget_bytes=_budget_for(pair, 7)
    )
    history = prompt(1200, 30)
    first = generate(w.stub, history, max_tokens=8)
    resent = _chats_end_while_it_runs(w, history + first.tokens + prompt(8, 31))
    assert resent.complete.cached_tokens == len(history) + len(first.tokens)


def test_a_document_many_ask_about_at_once_is_prefilled_once(start_worker, models_root):
    # The document's entry and a few rows reusing it fit, not all of them.
    # Those that wait for room start from the entry too: it stays while
    # requests waiting reuse it.
    w, cold = _wide_kv_workers(start_worker, models_root)
    document = prompt(w.worker.engine.memory.longest_sequence // 5, 40)
    generate(w.stub, document, max_tokens=1)
    questions = [document + prompt(8, 41 + i) for i in range(6)]
    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(lambda ids: generate(w.stub, ids, max_tokens=24), questions))
    assert [a.complete.cached_tokens >= len(document) for a in answers] == [True] * 6
    assert [a.tokens for a in answers] == [generate(cold.stub, q, max_tokens=24).tokens
                                           for q in questions]  # fmt: skip
