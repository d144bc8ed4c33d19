"""--kv-bits through the engine (CPU): greedy output is the same solo and in a
batch, and whether a prefix came from memory, from disk after a restart, or
was prefilled; entries of another KV format are never used; models whose
caches cannot be quantized are refused at start-up (exit 2).

The model is float32 with heads of 64 (one quantization group); every check
first makes sure its greedy output varies, so that equal outputs mean something.
"""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models import base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache
from test_engine_core import TIMEOUT, spec, start_core
from test_metrics import scrape

from smg_mlx.demo_model import build_model
from smg_mlx.engine.batch import batch_check, quantized_attention, quantized_kv
from smg_mlx.engine.batch.batch import Batch
from smg_mlx.engine.batch.quantized_kv import BatchQuantizedKVCache
from smg_mlx.engine.handoff import Inbox
from smg_mlx.engine.prefix_cache import kv_files
from smg_mlx.engine.prefix_cache.folder_contents import SUFFIX
from smg_mlx.engine.prefix_cache.memory_tier import MemoryTier
from smg_mlx.engine.types import Request
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.logs import format_bytes

from conftest import build_once
from helpers import free_port, generate, memory_in_use, prompt, wait_until

A = prompt(400, 1)  # longer than the disk tier's minimum
PROMPTS = [prompt(n, i) for i, n in enumerate((3, 40, 130, 300))]


@pytest.fixture(scope="module")
def model64(models_root: Path) -> Path:
    return build_once(models_root / "tiny-head64", ["--head-dim", "64"])


@pytest.fixture(scope="module", params=[8, 4])
def bits(request: pytest.FixtureRequest) -> int:
    return request.param


@pytest.fixture(scope="module")
def cold(model64, bits):
    """A worker of these bits without a prefix cache or speculation: every prompt
    prefilled, every token decoded one pass at a time."""
    from conftest import RunningWorker, worker_config

    config = worker_config(model64, kv_bits=bits, prompt_cache_bytes=0, speculative="off")
    w = RunningWorker(config)
    yield w
    w.stop()


def varied(tokens: list[int]) -> list[int]:
    assert len(set(tokens)) > 2, tokens  # greedy output that could tell a difference
    return tokens


def same_as_cold(worker, cold, ids: list[int], max_tokens: int = 8):
    got = generate(worker.stub, ids, max_tokens=max_tokens)
    assert varied(got.tokens) == generate(cold.stub, ids, max_tokens=max_tokens).tokens
    return got


def test_outputs_are_the_same_solo_and_in_a_batch(start_worker, model64, cold, bits):
    solo = [varied(generate(cold.stub, p, max_tokens=12).tokens) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: generate(cold.stub, p, max_tokens=12).tokens, PROMPTS))
    assert together == solo
    if bits == 4:  # the quantized caches are in use: some output is not unquantized KV's
        plain = start_worker(model64, prompt_cache_bytes=0)
        assert [generate(plain.stub, p, max_tokens=12).tokens for p in PROMPTS] != solo


@pytest.mark.parametrize("bits", [8], indirect=True, scope="module")  # one width does
def test_long_prompts_waiting_their_turn_beside_chats_come_back(start_worker, model64, cold, bits):
    """A long prompt waits in its lane, with fresh caches, while another
    prefills there, and the chats' lane reports each step between them: what it
    reports counts those caches (mlx-lm's own count of a fresh quantized cache
    failed the step, and every request in it)."""
    w = start_worker(model64, kv_bits=bits, step_budget_seconds=1e-6, prompt_cache_bytes=0)
    prompts = [prompt(1200, 13), prompt(1100, 17), *(prompt(40, 14 + i) for i in range(3))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: generate(w.stub, p, max_tokens=24).tokens, prompts))
    assert together == [varied(generate(cold.stub, p, max_tokens=24).tokens) for p in prompts]


@pytest.mark.parametrize("bits", [4], indirect=True, scope="module")  # one width does
def test_a_long_prompt_in_its_own_lane_beside_chats_is_as_alone(start_worker, model64, cold, bits):
    # A tiny step budget makes a 1,200-token prompt long: it runs in the long
    # prompts' lane, the chats beside it in the other.
    w = start_worker(model64, kv_bits=bits, step_budget_seconds=1e-6, prompt_cache_bytes=0)
    prompts = [prompt(1200, 13), *(prompt(40, 14 + i) for i in range(3))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: generate(w.stub, p, max_tokens=24).tokens, prompts))
    assert together == [varied(generate(cold.stub, p, max_tokens=24).tokens) for p in prompts]


def test_a_prefix_from_memory_is_as_prefilled(start_worker, model64, cold, bits):
    w = start_worker(model64, kv_bits=bits)
    history = A + same_as_cold(w, cold, A).tokens
    got = same_as_cold(w, cold, history + prompt(30, 4))
    assert got.complete.cached_tokens == len(history)
    # Diverging inside an entry: it is cut back to the prefix shared.
    assert same_as_cold(w, cold, A[:300] + prompt(50, 6)).complete.cached_tokens == 300


@pytest.mark.parametrize("bits", [4], indirect=True, scope="module")  # one width does
def test_a_prefix_from_disk_after_a_restart_is_as_prefilled(
    start_worker, model64, cold, bits, tmp_path
):
    w = start_worker(model64, kv_bits=bits, prompt_cache_dir=tmp_path)
    history = A + same_as_cold(w, cold, A).tokens
    w.stop()  # a graceful stop writes what memory holds
    (entry,) = tmp_path.rglob("*.kv")
    assert b"QuantizedKVCache" in entry.read_bytes()[:4096]
    again = start_worker(model64, kv_bits=bits, prompt_cache_dir=tmp_path)
    got = same_as_cold(again, cold, history + prompt(30, 5))
    assert got.complete.cached_tokens == len(history)
    assert again.worker.engine.cache.disk_tokens == len(history)
    # Diverging inside it: the entry read back is cut back to the prefix shared.
    assert same_as_cold(again, cold, A[:300] + prompt(50, 6)).complete.cached_tokens == 300


def test_prefixes_reused_together_from_memory_and_from_disk_are_as_prefilled(
    start_worker, model64, cold, bits, tmp_path
):
    """Conversations going on at once, each from its own cached history (of
    other lengths), beside a prompt that reuses nothing: in one batch, from
    memory, then from disk after a restart."""
    w = start_worker(model64, kv_bits=bits, prompt_cache_dir=tmp_path)
    starts = [prompt(n, 20 + i) for i, n in enumerate((260, 330, 410))]
    histories = [p + same_as_cold(w, cold, p).tokens for p in starts]

    def together(worker, turn: int) -> list:
        asks = [h + prompt(20 + 9 * i, turn + i) for i, h in enumerate(histories)]
        asks.append(prompt(120, turn + 9))  # nothing cached
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda p: generate(worker.stub, p, max_tokens=10), asks))
        assert [g.tokens for g in got] == [
            varied(generate(cold.stub, p, max_tokens=10).tokens) for p in asks
        ]
        return [g.complete.cached_tokens for g in got]

    assert together(w, 30) == [*map(len, histories), 0]
    w.stop()  # a graceful stop writes what memory holds
    again = start_worker(model64, kv_bits=bits, prompt_cache_dir=tmp_path)
    assert together(again, 40) == [*map(len, histories), 0]
    assert again.worker.engine.cache.disk_tokens == sum(map(len, histories))


def server_headers(worker) -> dict[str, str]:
    _, call = worker.stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
    return dict(call.initial_metadata())


def kv_bytes_per_token(worker) -> int:
    return int(server_headers(worker)["kv-bytes-per-token"])


def test_an_entry_of_another_kv_format_is_never_used(start_worker, model64, tmp_path, caplog):
    w = start_worker(model64, kv_bits=8, prompt_cache_dir=tmp_path)
    history = A + generate(w.stub, A, max_tokens=8).tokens
    per_token = {8: kv_bytes_per_token(w)}
    w.stop()
    # A file of the user's in the 8-bit entries' folder does not hide them.
    (stray,) = [entry.parent / "notes.txt" for entry in tmp_path.glob(f"*/*{SUFFIX}")]
    stray.write_text("mine")
    for other in ({"kv_bits": 4}, {"kv_bits": 8, "kv_group_size": 32}, {}):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            w = start_worker(model64, prompt_cache_dir=tmp_path, **other)
            assert wait_until(lambda: "from earlier runs" in caplog.text, 10)
        assert generate(w.stub, history + [7], max_tokens=4).complete.cached_tokens == 0, other
        # The start says why the disk tier looks cold: the entries are kept apart.
        said = [r.getMessage() for r in caplog.records]
        opened = next(line for line in said if "from earlier runs" in line)
        assert "0 entries (0 B) from earlier runs" in opened, opened
        kept = re.search(
            r"; (\d+) entr(?:y|ies) \([^)]*\) of this model under other settings "
            r"\(.*\) (is|are) kept apart, unused",
            opened,
        )
        assert kept and (kept[1] == "1") == (kept[2] == "is"), opened
        per_token.setdefault(other.get("kv_bits", 16), kv_bytes_per_token(w))
        w.stop()
    # What GetServerInfo tells of a token's cost: float32 keys and values, 8 bits and
    # 4 bits with a (float32) scale and bias for every 64 of them.
    assert per_token[8] / per_token[16] == pytest.approx((8 + 64 / 64) / 32)
    assert per_token[4] / per_token[16] == pytest.approx((4 + 64 / 64) / 32)
    stray.unlink()
    w = start_worker(model64, kv_bits=8, prompt_cache_dir=tmp_path)  # its own format: used
    assert generate(w.stub, history + [7], max_tokens=4).complete.cached_tokens == len(history)
    # ... and its log line, for an operator who reads the log rather than headers.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="smg_mlx.api.servicer"):
        kv_bytes_per_token(w)
    line = next(r.getMessage() for r in caplog.records if "GetServerInfo" in r.getMessage())
    assert f"KV {format_bytes(per_token[8])} per token" in line, line
    assert "0 running (0 prefilling), 0 waiting; serving mode batched" in line, line


def test_start_up_checks_batching_anew_and_speculation_stays_exact(
    start_worker, model64, cold, bits, tmp_path, caplog
):
    # The batch check's verdicts are kept in the prompt cache's directory.
    port = free_port()
    unquantized = start_worker(model64, prompt_cache_dir=tmp_path, metrics_port=port)
    # GetServerInfo's headers say how KV is stored and what proposes tokens; so
    # does a metric.
    headers = server_headers(unquantized)
    assert (headers["kv-format"], headers["speculative-decoding"]) == ("unquantized", "off")
    scraped = scrape(port)
    assert scraped[("smg_mlx_kv_cache_format", (("format", "unquantized"),))] == 1
    assert scraped[("smg_mlx_speculative_decoding", (("drafter", "off"),))] == 1
    unquantized.stop()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        w = start_worker(model64, kv_bits=bits, speculative="always", prompt_cache_dir=tmp_path,
                         metrics_port=(port := free_port()))  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    assert any("speculative decoding: prompt lookup" in line for line in said), said
    # The plain caches' verdict is not taken for the quantized ones'.
    assert any(line.startswith("batch check: running prompts") for line in said), said
    # Against the model's own KV, named: a float32 model's is twice a 16-bit one's.
    stored = next(line for line in said if line.startswith("KV caches stored as"))
    assert stored.startswith(f"KV caches stored as {bits}-bit KV, group 64: ")
    assert "x of the model's own float32 KV (" in stored
    headers = server_headers(w)
    assert headers["kv-format"] == f"{bits}-bit KV, group 64"
    formats = {k: v for k, v in scrape(port).items() if k[0] == "smg_mlx_kv_cache_format"}
    assert formats == {("smg_mlx_kv_cache_format", (("format", f"{bits}-bit KV, group 64"),)): 1}
    assert headers["speculative-decoding"] == "prompt_lookup"
    drafters = {k: v for k, v in scrape(port).items() if k[0] == "smg_mlx_speculative_decoding"}
    assert drafters == {("smg_mlx_speculative_decoding", (("drafter", "prompt_lookup"),)): 1}
    assert server_headers(cold)["speculative-decoding"] == "off"
    # Rows take back their rejected proposals from quantized caches: the tokens
    # are plain decoding's, solo and together.
    repeating = [(prompt(n, i)[:7] * 40)[:n] for i, n in enumerate((30, 90, 200))]
    plain = [varied(generate(cold.stub, p, max_tokens=40).tokens) for p in repeating]
    with ThreadPoolExecutor(len(repeating)) as pool:
        ours = list(pool.map(lambda p: generate(w.stub, p, max_tokens=40).tokens, repeating))
    assert ours == plain
    assert 0 < w.worker.engine.speculation.accepted < w.worker.engine.speculation.proposed


def test_models_whose_caches_cannot_be_quantized_are_refused(model_dir, tmp_path, refused):
    # The regression model's heads are 16 wide: no whole group of 64.
    refusal = refused(model_dir, kv_bits=8)
    assert refusal.exit_code == 2
    why = (
        "--kv-bits 8: this model's head sizes (16) are not a multiple of --kv-group-size 64, "
        "which quantization needs; no --kv-group-size offered (32, 64, 128) does: this "
        "model's KV cannot be quantized, leave out --kv-bits"
    )
    assert why in str(refusal)
    windowed = build_model(tmp_path / "windowed", ["--head-dim", "64", "--sliding-window", "8"])
    refusal = refused(windowed, kv_bits=4)
    assert refusal.exit_code == 2
    why = "--kv-bits 4: this model's caches include RotatingKVCache, not plain attention"
    assert why in str(refusal)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_batch_check_runs_rows_quantized(models_root, dtype, monkeypatch):
    """4-bit rows batch as they run alone: in bfloat16 keys a hair apart may
    round to neighbouring steps, which is no difference. Padding left
    unmasked is one."""
    # float32 is the builder's default: that build is model64's, made once a run.
    path = (build_once(models_root / "tiny-head64", ["--head-dim", "64"]) if dtype == "float32"
            else build_once(models_root / f"tiny-head64-{dtype}",
                            ["--head-dim", "64", "--dtype", dtype]))  # fmt: skip
    model = load(str(path))[0]
    stream = mx.new_stream(mx.default_device())
    # As the worker runs them: alone, a row's prompt runs causal, batched masked.
    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                        base.quantized_scaled_dot_product_attention)  # fmt: skip
    quantized_attention.install(None)

    def fresh() -> list[QuantizedKVCache]:
        return [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]

    assert batch_check.choose(model, stream, 8, 32, fresh).mode is batch_check.Mode.BATCHED

    # A quantized batch whose padding is left unmasked: the check must see it.
    def unpadded(self, N, return_array=False, **kwargs):
        return create_causal_mask(N, offset=self._idx, **kwargs)

    monkeypatch.setattr(BatchQuantizedKVCache, "make_mask", unpadded)
    assert batch_check.choose(model, stream, 8, 32, fresh).mode is not batch_check.Mode.BATCHED


def test_quantized_attention_runs_as_cudas_quantized_matmul_needs(model64, monkeypatch):
    """mlx's CUDA quantized matmul refuses views of a cache ("No implementation
    for problem shape"), such as mlx-lm's single-sequence QuantizedKVCache
    hands attention, and takes keys broadcast along a batch axis (as mlx-lm's
    attention gives grouped query heads theirs) for one matrix shared by the
    whole batch. Both refused here, and prompts' attention padded to few
    shapes as there: a worker with --kv-bits and speculation starts (batch
    check, probe, warm-up) and serves."""

    def refused(self, keys, values):
        raise RuntimeError("[quantized_matmul] No implementation for problem shape")

    matmul = mx.quantized_matmul

    def unbroadcast(x, w, *args, **kwargs):
        if w.ndim > 2 and x.shape[:-2] != w.shape[:-2]:
            raise RuntimeError("keys broadcast along a batch axis: CUDA would use the first's")
        return matmul(x, w, *args, **kwargs)

    monkeypatch.setattr(QuantizedKVCache, "update_and_fetch", refused)
    monkeypatch.setattr(quantized_kv, "WHOLE", True)
    monkeypatch.setattr(mx, "quantized_matmul", unbroadcast)
    # And prompts' attention padded to few shapes, as there (engine.batch.attention_shapes).
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    inbox = Inbox()
    sink, thread = start_core(model64, inbox, kv_bits=8, speculative="on")
    try:
        inbox.submit(Request(1, spec(prompt(300, 1), max_tokens=40)))
        tokens = [e.token for e in sink.events_of(1)]
        assert len(tokens) == 40 and len(set(tokens)) > 3
    finally:
        inbox.stop()
        thread.join(TIMEOUT)


def test_the_warm_up_runs_quantized_attention_at_every_few_query_count(model64, monkeypatch):
    """On CUDA mlx compiles a quantized-matmul kernel per tile size the query
    count picks, and for key counts ending part-way through a tile: about a
    minute each, the first time on a host, every stream stalled behind a pass
    that meets one (a 16-token follow-up over a cached context did). The
    warm-up runs every count a pass over quantized caches may have before the
    worker is ready; and the caches' buffers there hold a whole number of
    tiles, rows joining and leaving too, so no pass needs the other kernels
    (whose builds would double a first start)."""
    ran = []
    few = quantized_attention._few

    def spied(queries, q_keys, *args):
        ran.append((queries.shape[2], q_keys[0].shape[2] % 64 == 0))
        return few(queries, q_keys, *args)

    monkeypatch.setattr(quantized_attention, "_few", spied)
    monkeypatch.setattr(quantized_kv, "WHOLE", True)
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    inbox = Inbox()
    sink, thread = start_core(model64, inbox, kv_bits=8)
    try:
        counts = range(1, quantized_attention.FEW_QUERIES + 1)
        assert {n for n, _ in ran} >= set(counts)
        # Rows ending apart, joining a running batch, and a follow-up resent
        # (its prompt from the prefix cache, then a few new tokens over it).
        first = prompt(300, 1)
        for key, (ids, n) in enumerate([(first, 12), (prompt(40, 2), 30), (prompt(70, 3), 5)], 1):
            inbox.submit(Request(key, spec(ids, max_tokens=n)))
        assert [len(t) for t in sink.tokens_of([1, 2, 3]).values()] == [12, 30, 5]
        inbox.submit(Request(9, spec(first + prompt(9, 4), max_tokens=20)))
        assert len(sink.events_of(9)) == 20
        assert all(aligned for _, aligned in ran)
    finally:
        inbox.stop()
        thread.join(TIMEOUT)


def test_the_budget_counts_each_running_rows_16_bit_tail(model64, monkeypatch, caplog):
    """Where the fused kernel reads a quantized cache (CUDA: forced here), a
    row's newest positions wait at 16 bits in a tail: the probe says what it
    holds, and the budget counts it for every row, so fewer rows fit."""
    from dataclasses import replace

    from smg_mlx.config import EngineConfig
    from smg_mlx.engine.batch.kv_format import caches_for
    from smg_mlx.engine.memory import probe
    from smg_mlx.engine.memory.planner import MemoryPlanner, cost

    model = load(str(model64))[0]
    caches = caches_for(EngineConfig(model_path=model64, kv_bits=8), model)
    stream = mx.new_stream(mx.default_device())
    plain, _ = probe.measure(model, stream, 512, caches=caches)
    assert plain.row_bytes == 0  # (no tail on the CPU)
    monkeypatch.setattr(quantized_kv, "TAILS", True)
    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                        base.quantized_scaled_dot_product_attention)  # fmt: skip
    quantized_attention.install(None)  # (the worker's: it reads the tail)
    caplog.set_level(logging.INFO, "smg_mlx.engine.memory.probe")
    tailed, _ = probe.measure(model, stream, 512, caches=caches)
    layers = len(model.layers)
    heads, dim = model.args.num_key_value_heads, 64
    assert tailed.row_bytes == quantized_kv.TAIL * layers * heads * 2 * dim * 4  # float32
    assert tailed.kv_per_token == plain.kv_per_token
    assert "a running row (its 16-bit tail)" in caplog.text

    def rows_fitting(memory) -> int:
        planner = MemoryPlanner(memory, budget, max_chunk=512, prefill_rows=4)
        request = Request(0, spec(list(range(1, 9)), 8), "r")
        costs = []
        while planner.fits([*costs, cost(request)]):
            costs.append(cost(request))
        return len(costs)

    budget = int(plain.weights + 200 * 256 * plain.kv_per_token)
    counted = replace(plain, row_bytes=tailed.row_bytes)  # (the rest as measured once)
    # A row here holds 256 positions' KV (576 B each at 8 bits), and its tail 32 KiB.
    assert rows_fitting(counted) <= 0.85 * rows_fitting(plain)


def test_the_decode_steps_bench_times_a_step_for_each_kv_format(model64, tmp_path, monkeypatch):
    """`python -m bench.decode_steps`: the median decoding step of a batch over a
    context, the model's own KV and each of --kv-bits, and the host's time
    recording it (part of the step)."""
    from bench.decode_steps import main

    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention",
                        base.quantized_scaled_dot_product_attention)  # fmt: skip
    out = tmp_path / "steps.json"
    argv = ["--model", str(model64), "--rows", "2", "--contexts", "40,300", "--steps", "2",
            "--kv-bits", "8,4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["context"]) for r in results] == [(2, 40), (2, 300)]
    for r in results:
        assert set(r["ms"]) == {"16-bit", "8-bit", "4-bit"} and min(r["ms"].values()) > 0
        assert set(r["recording_ms"]) == set(r["ms"])
        assert all(0 < r["recording_ms"][k] <= r["ms"][k] for k in r["ms"])


def test_the_decode_steps_bench_skips_a_format_the_model_cannot_take_and_says_why(
    model_dir, tmp_path, capsys
):
    """Its defaults on a model of heads narrower than a group: the model's own KV
    measured, --kv-bits 8 skipped with the reason and what to give instead."""
    from bench.decode_steps import main

    out = tmp_path / "steps.json"
    argv = ["--model", str(model_dir), "--rows", "1", "--contexts", "40", "--steps", "2",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert set(result["ms"]) == {"16-bit"}
    assert "skipped: --kv-bits 8: this model's head sizes (16)" in capsys.readouterr().err


def test_the_attention_pass_bench_times_one_layer_for_each_shape(tmp_path, capsys):
    """`python -m bench.attention_pass`: one layer's decoding attention over
    16-bit and quantized keys, for each batch size and context; heads that
    cannot be quantized are refused with what to give."""
    from bench.attention_pass import main

    out = tmp_path / "pass.json"
    argv = ["--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--rows", "1,3",
            "--contexts", "50", "--kv-bits", "4", "--runs", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["context"]) for r in results] == [(1, 50), (3, 50)]
    for r in results:
        assert set(r["ms"]) == {"16-bit", "4-bit"} and min(r["ms"].values()) > 0
    with pytest.raises(SystemExit):
        main(["--head-dim", "80"])
    assert "--head-dim must be a multiple of --kv-group-size" in capsys.readouterr().err


def test_the_kv_quality_bench_skips_a_model_it_cannot_quantize_and_says_why(
    model_dir, tmp_path, capsys
):
    """`python -m bench.kv_quality --model` of heads narrower than a group: the
    worker's reason, no traceback; a group size mlx does not quantize to is
    refused as the worker refuses it."""
    from bench.kv_quality import main

    out = tmp_path / "quality.json"
    main(["--model", str(model_dir), "--prompt-tokens", "8", "--new-tokens", "2",
          "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == []
    assert "skipped: --kv-bits 8: this model's head sizes (16)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--kv-group-size", "48"])
    assert "invalid choice: 48" in capsys.readouterr().err


def test_the_values_product_split_along_the_keys_is_the_same(monkeypatch):
    """On CUDA the values' product runs in parts along the keys, side by side
    (one product waits on a serial loop over every key); it is the same product."""
    queries = mx.random.normal((2, 8, 3, 64), key=mx.random.key(1))
    keys, values = (mx.random.normal((2, 2, 4096, 64), key=mx.random.key(i)) for i in (2, 3))
    q_keys, q_values = (tuple(mx.quantize(x, group_size=64, bits=8)) for x in (keys, values))
    mask = mx.random.bernoulli(0.9, (2, 1, 3, 4096), key=mx.random.key(4))
    whole = quantized_attention._few(queries, q_keys, q_values, 0.125, mask, 64, 8)
    monkeypatch.setattr(quantized_attention, "SPLIT", True)
    assert quantized_attention._parts(4096, 2 * 2) > 1
    parts = quantized_attention._few(queries, q_keys, q_values, 0.125, mask, 64, 8)
    assert mx.allclose(parts, whole, atol=1e-5).item()


# ---- the entries themselves ----


def quantized(tokens: int, bits: int = 8) -> QuantizedKVCache:
    layer = QuantizedKVCache(group_size=64, bits=bits)
    x = mx.random.normal((1, 2, tokens, 64))
    layer.update_and_fetch(x, -x)
    return layer


def test_a_file_holds_the_quantized_arrays_as_they_are(tmp_path):
    layer = quantized(10)
    layer.trim(3)  # a buffer longer than what it holds: only the 7 positions go
    header, arrays = kv_files.export([layer], tokens=7, trimmable=True)
    mx.eval(arrays)
    assert [a["shape"][2] for a in header.arrays] == [7] * 6  # of the buffer's 256
    path = tmp_path / "entry.kv"
    kv_files.write(path, "m", header, list(range(7)), kv_files.buffers(arrays))
    read_header, _, data = kv_files.read(path, "m")
    rebuild = kv_files.Rebuild(read_header, data)
    while not rebuild.done:
        rebuild.advance(0)
    (back,) = rebuild.cache()
    assert type(back) is QuantizedKVCache
    assert (back.offset, back.bits, back.group_size) == (7, 8, 64)
    for was, now in zip(layer.keys_and_values(), back.keys_and_values(), strict=True):
        for a, b in zip(was, now, strict=True):  # packed, scales, biases: bit for bit
            assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def test_a_memory_hit_batches_exactly_the_tokens_it_shares():
    layer = quantized(20, bits=4)
    store = MemoryTier(1 << 30)
    tokens = list(range(100, 120))
    store.insert(tokens, [layer])
    (hit,), n, _ = store.lookup(tokens[:12] + [1, 2])
    assert n == 12 and hit.offset == 12 and layer.offset == 20  # the entry is left whole
    batch = BatchQuantizedKVCache.merge([hit])
    keys, _ = batch.keys_and_values()
    assert keys[0].shape[2] == 12
    for a, b in zip(keys, layer.keys_and_values()[0], strict=True):
        assert mx.array_equal(a, b[:, :, :12]).item()


def test_the_quality_bench_finds_4_bits_further_from_the_models_own_cache_than_8(model64):
    from bench.kv_quality import measure

    found = measure(model64, prompt_len=96, new_tokens=12, group=64, seed=1)
    eight, four = (found["settings"][f"{b}-bit, group 64"] for b in (8, 4))
    assert found["distinct_reference_tokens"] > 2  # a continuation that could tell
    assert 0 < eight["kl_mean_nats"] < four["kl_mean_nats"]
    assert 0 <= four["top1_agreement"] <= eight["top1_agreement"] <= 1


def test_a_16_bit_models_quantized_cache_costs_what_quantizing_costs(models_root):
    """A bfloat16 model decoding from 8-bit keys and values: its next-token
    distributions stay as close to its own cache's as the float32 models'
    (with the values' product in 16 bits: 50 times further at 512 tokens of
    context, 600 at 1,024)."""
    from bench.kv_quality import MODELS, measure

    flags = [*MODELS["small-head64"], "--dtype", "bfloat16"]
    found = measure(build_model(models_root / "small-bf16", flags), 512, 16, 64, 0, widths=(8,))
    assert found["distinct_reference_tokens"] > 2
    assert found["settings"]["8-bit, group 64"]["kl_mean_nats"] < 3e-4


def test_a_quantized_stream_grown_long_moves_lanes_and_goes_on_as_alone(model64, caplog):
    inbox = Inbox()
    sink, thread = start_core(model64, inbox, kv_bits=4, step_budget_seconds=1e-6)
    try:
        inbox.submit(Request(1, spec(prompt(8, 1), max_tokens=800)))
        alone = [e.token for e in sink.events_of(1)]
        inbox.submit(Request(2, spec(prompt(8, 1), max_tokens=800)))
        streamed = [e.token for e in sink.events_of(2, count=700)]  # long by now
        with caplog.at_level(logging.INFO):
            for key in (3, 4):  # chats: the stream leaves their lane, cache and all
                inbox.submit(Request(key, spec(prompt(20, key), max_tokens=20)))
            streamed += [e.token for e in sink.events_of(2) if e.token is not None]
        assert "move to the long prompts' lane" in caplog.text
        assert varied(streamed) == alone
    finally:
        inbox.stop()
        thread.join(TIMEOUT)


@pytest.mark.parametrize("bits", [8], indirect=True, scope="module")  # one width does
def test_a_draft_models_proposals_over_quantized_rows_leave_the_tokens_as_they_were(
    start_worker, model64, cold, bits, model_dir, caplog, refused
):
    # The model as its own draft, its cache quantized as the model's: a token of
    # context costs twice what it costs the model alone, as the log says too.
    with caplog.at_level(logging.INFO, logger="smg_mlx.engine.memory.probe"):
        w = start_worker(model64, kv_bits=bits, draft_model=model64, speculative="always")
    assert kv_bytes_per_token(w) == 2 * kv_bytes_per_token(cold)
    total = format_bytes(kv_bytes_per_token(w))
    assert f"({total} a token with the model's)" in caplog.text
    for p in PROMPTS[1:3]:
        assert (
            varied(generate(w.stub, p, max_tokens=24).tokens)
            == generate(cold.stub, p, max_tokens=24).tokens
        )
    stats = w.worker.engine.speculation
    assert stats.drafter == "draft_model" and stats.accepted > 0
    # A draft whose caches cannot be stored so is refused, naming it.
    refusal = refused(model64, draft_model=model_dir, kv_bits=bits, speculative="auto")
    assert refusal.exit_code == 2
    said = str(refusal)
    assert f"--draft-model {model_dir}: --kv-bits {bits}: the draft's head sizes (16)" in said
    assert said.endswith(
        "the draft's KV cannot be quantized, leave out --kv-bits (or name another draft)"
    )


def test_cudas_16_bit_tails_change_no_token_solo_in_batches_or_from_the_prefix_cache(
    model64, monkeypatch
):
    """On CUDA, decoding passes write into a 16-bit tail that the kernel reads
    as quantized (`quantized_kv.TAILS`): here, with CUDA's whole buffers and
    thorough warm-up too, requests solo, in batches that rows join and leave
    (tails quantized at every turn), and from the prefix cache (entries taken
    from rows whose tails held their last tokens) give what they give without."""
    monkeypatch.setattr(quantized_kv, "WHOLE", True)
    monkeypatch.setattr(Batch, "shape_builds", property(lambda self: True))
    into_tail = BatchQuantizedKVCache._into_tail
    passes = []

    def counted(self, keys, values):
        passes.append(keys.shape[0])
        return into_tail(self, keys, values)

    monkeypatch.setattr(BatchQuantizedKVCache, "_into_tail", counted)
    prompts = [prompt(n, i) for i, n in enumerate((5, 40, 130, 300, 70))]

    def run(tails: bool) -> list[tuple[list[int], int]]:
        monkeypatch.setattr(quantized_kv, "TAILS", tails)
        inbox = Inbox()
        sink, thread = start_core(model64, inbox, kv_bits=8, speculative="off")
        try:
            out = []
            inbox.submit(Request(1, spec(prompts[0], max_tokens=40)))
            out.append([e.token for e in sink.events_of(1)])
            # Each joining a running batch a few passes after the last; ending apart.
            tokens: dict[int, list[int]] = {}
            waiting = list(enumerate(prompts[1:], 2))
            ended = 0
            while ended < len(prompts) - 1:
                if waiting and len(tokens.get(waiting[0][0] - 1, ())) >= 3 or len(waiting) == 4:
                    key, ids = waiting.pop(0)
                    tokens[key] = []
                    inbox.submit(Request(key, spec(ids, max_tokens=10 * key)))
                for e in sink.next_report().events:
                    tokens[e.key].append(e.token)
                    ended += e.ends
            out += [tokens[key] for key in sorted(tokens)]
            # Asked again, a prompt and its answer further: from the prefix cache.
            for key, ids in ((10, prompts[2]), (11, [*prompts[3], *out[3][:20], 7])):
                inbox.submit(Request(key, spec(ids, max_tokens=30)))
                events = sink.events_of(key)
                out.append(([e.token for e in events], events[0].cached_tokens))
            return out
        finally:
            inbox.stop()
            thread.join(TIMEOUT)

    without = run(False)
    assert not passes
    assert run(True) == without
    assert len(passes) > 300 and max(passes) > 1  # batched decoding passes went to tails
    assert without[-1][1] > 300 and all(len(set(tokens)) > 3 for tokens in without[:5])


# One width does: 8 bits runs the same count, and 4 bits is where it failed before
# the fix (c4221ff).
@pytest.mark.parametrize("bits", [4], indirect=True, scope="module")
def test_a_prompt_as_long_as_a_quantized_worker_takes_stays_within_its_budget(
    start_worker, models_root, bits, monkeypatch, tmp_path
):
    """A long prompt's attention dequantizes the keys and values it reads: bytes
    held per key, whatever the chunk. Counted per chunk token (as the probe's
    measures came), the longest prompt a worker took ran past its budget."""
    from smg_mlx.engine.memory import probe as memory_probe

    model = build_model(models_root / "long-head64", [
        "--hidden-size", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--layers", "2", "--context-length", "65536",
    ])  # fmt: skip
    # The probe at its full chunk, however busy this host (its chunk shrinks
    # where the model is slow), measured afresh.
    monkeypatch.setattr(memory_probe, "_seconds_per_token", lambda *args: 1e-6)
    budget = 24 << 20
    others = memory_in_use()
    w = start_worker(model, kv_bits=bits, memory_budget_bytes=budget, prompt_cache_bytes=0,
                     prompt_cache_dir=tmp_path / "cache")  # fmt: skip
    longest = w.worker.engine.longest_sequence
    assert 2048 < longest < 65536  # the budget bounds it, past a layer at a time's keys
    mx.reset_peak_memory()  # (the peak of the tests before)
    out = generate(w.stub, prompt(longest - 20, 1), max_tokens=16, ignore_eos=True)
    assert out.complete.finish_reason == "length"
    assert w.worker.engine.memory.peak - others <= budget
