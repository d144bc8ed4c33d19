"""Model families are served exactly (batched where that changes no output), or
refused before SERVING: tiny random models of each (float32, built offline by
`family_models`), their concurrent greedy output against each prompt served
alone, with the prefix cache and aborts in the mode the worker chose."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.server import load_tokenizer

from conftest import build_once
from helpers import collect, generate, model_copy, prompt, request

# Prompts of lengths 7 to 150, as the check had them, and 24 tokens each.
LENGTHS = (7, 19, 33, 50, 72, 97, 123, 150)
TOKENS = 24
EQUAL_LENGTHS = "equal-lengths"


def alone(worker, prompts: list[list[int]]) -> list:
    """Each prompt's greedy tokens, served one after the other."""
    return [generate(worker.stub, p, max_tokens=TOKENS, ignore_eos=True).tokens for p in prompts]


def solo_and_together(worker, prompts: list[list[int]]) -> tuple[list, list]:
    """Each prompt's greedy tokens served alone, then all of them at once."""
    solo = alone(worker, prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(
                lambda p: generate(worker.stub, p, max_tokens=TOKENS, ignore_eos=True).tokens,
                prompts,
            )  # fmt: skip
        )
    return solo, together


def assert_batching_changes_nothing(worker, prompts: list[list[int]]) -> None:
    """The model's greedy output varies (else equality proves nothing), and the prompts
    served at once give each one's tokens alone."""
    solo, together = solo_and_together(worker, prompts)
    assert all(len(set(tokens)) > 3 for tokens in solo)
    assert together == solo


@pytest.mark.parametrize(
    "family", ["nemotron_h", "jamba", "mamba", "olmo_hybrid", "rwkv7", "recurrent_gemma"]
)
def test_recurrent_families_prefill_at_equal_lengths_and_batched_output_is_exact(
    start_worker, family_model, family
):
    w = start_worker(family_model(family))
    assert w.worker.engine.mode == EQUAL_LENGTHS
    # Prompts of different lengths, and some of one length (prefilled together).
    prompts = [prompt(n, i) for i, n in enumerate(LENGTHS)] + [prompt(40, 20 + i) for i in range(4)]
    assert_batching_changes_nothing(w, prompts)


def test_the_serving_mode_is_reported(start_worker, family_model, worker):
    w = start_worker(family_model("mamba"))
    for running, mode in ((w, EQUAL_LENGTHS), (worker, "batched")):
        _, call = running.stub.GetServerInfo.with_call(pb.GetServerInfoRequest())
        assert dict(call.initial_metadata())["serving-mode"] == mode


def test_the_prefix_cache_and_aborts_work_prefilling_at_equal_lengths(start_worker, family_model):
    model = family_model("nemotron_h")
    w = start_worker(model)
    cold = start_worker(model, prompt_cache_bytes=0)
    ids = prompt(60, 3)
    first = generate(w.stub, ids, max_tokens=8)
    # Recurrent state cannot be cut back: only a prompt extending the whole entry reuses it.
    extended = ids + first.tokens + prompt(20, 4)
    got = generate(w.stub, extended, max_tokens=8)
    assert got.complete.cached_tokens == len(ids) + len(first.tokens)
    assert got.tokens == generate(cold.stub, extended, max_tokens=8).tokens
    # An aborted stream frees its place; the next requests are as if it never ran.
    call = w.stub.Generate(request(prompt(90, 5), max_tokens=500, ignore_eos=True), timeout=60)
    next(call)
    call.cancel()
    with pytest.raises(grpc.RpcError):
        collect(call)
    prompts = [prompt(n, 6 + i) for i, n in enumerate((9, 41, 77))]
    solo, together = solo_and_together(w, prompts)
    assert together == solo == alone(cold, prompts)


def test_gemma2_is_served_one_request_at_a_time(start_worker, family_model):
    # mlx-lm's gemma2 cannot mask a padded batch (its 4-D mask against 5-D
    # scores): found before SERVING, so no batch of it ever runs.
    w = start_worker(family_model("gemma2"))
    assert w.worker.engine.mode == "one-at-a-time"
    prompts = [prompt(n, 7 + i) for i, n in enumerate((8, 30, 64, 120))]
    solo, together = solo_and_together(w, prompts)
    assert together == solo
    assert w.worker.engine.memory.failed_steps == 0


def test_a_family_mlx_lm_cannot_run_is_refused_before_serving(refused, family_model):
    refusal = refused(family_model("llama4"))
    assert refusal.exit_code == 2  # permanent: a supervisor does not restart it
    assert "cannot generate with this model even one prompt at a time" in str(refusal)
    assert "ChunkedKVCache" in str(refusal)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "falcon_h1", "mamba2"])
def test_families_batched_exactly_stay_batched_and_their_output_is_exact(
    start_worker, family_model, family
):
    # gemma3's sliding windows wrap on the longer prompts; falcon_h1 and mamba2
    # carry recurrent state, which mlx-lm masks for these two.
    w = start_worker(family_model(family))
    assert w.worker.engine.mode == "batched"
    assert_batching_changes_nothing(w, [prompt(n, 40 + i) for i, n in enumerate(LENGTHS)])


def test_a_stopped_worker_of_such_a_family_still_exits_zero(spawn, family_model):
    p = spawn("--model", str(family_model("rwkv7")))
    p.wait_serving()
    assert p.stop(signal.SIGTERM) == 0


def test_a_text_that_begins_with_the_bos_gets_no_second_one(start_worker, model_dir, tmp_path):
    """A tokenizer that adds a BOS (as llama's do) to a text a chat template
    rendered with the BOS already in it: the model must see one BOS, not two."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    model = model_copy(model_dir, tmp_path / "m", leave_out="tokenizer.json")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = json.loads((model_dir / "tokenizer_config.json").read_text())["bos_token"]
    tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    tokenizer.save(str(model / "tokenizer.json"))
    w = start_worker(model)
    plain = generate(w.stub, text="Hello there", max_tokens=1).complete.prompt_tokens
    assert plain == len(tokenizer.encode("Hello there").ids)  # the BOS added
    began = generate(w.stub, text=f"{bos}Hello there", max_tokens=1).complete.prompt_tokens
    assert began == plain


def test_batching_can_be_asked_to_be_safer_than_the_check_finds(start_worker, model_dir):
    w = start_worker(model_dir, batching="one-at-a-time")
    assert w.worker.engine.mode == "one-at-a-time"
    prompts = [prompt(n, 30 + i) for i, n in enumerate((12, 50))]
    solo, together = solo_and_together(w, prompts)
    assert together == solo


def test_a_qwen2_demo_models_tokenizer_knows_exactly_the_models_ids(start_worker, models_root):
    """transformers loads a qwen2 model's tokenizer as Qwen2Tokenizer, which adds
    <|endoftext|> where the vocabulary lacks it: a demo model whose vocabulary
    lacked it refused its own tokenizer's id for that text."""
    model = build_once(models_root / "tiny-qwen2", ["--family", "qwen2"])
    w = start_worker(model)
    done = generate(w.stub, text="hi <|endoftext|>", max_tokens=3, ignore_eos=True).complete
    assert (done.prompt_tokens, done.completion_tokens) == (4, 3)
    assert (
        len(load_tokenizer(model).get_vocab())
        == json.loads((model / "config.json").read_text())["vocab_size"]
    )
