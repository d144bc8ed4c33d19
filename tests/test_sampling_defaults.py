"""The model's own sampling values (its generation_config.json) for what a request
leaves unset, as vLLM applies them; `--generation-config none` turns them off."""

from __future__ import annotations

import json
import logging

import pytest

from smg_mlx.api.sampling_defaults import SamplingDefaults, read
from smg_mlx.api.translation import logits_settings, sampling_settings
from smg_mlx.grpc_stubs import mlx_engine_pb2 as pb
from smg_mlx.model_config import generation_config

from helpers import collect, model_copy, prompt

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": 2}


def test_the_models_values_fill_in_what_a_request_leaves_unset():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)
    unset = sampling_settings(pb.SamplingParams(), 1000, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.6, 0.95, 20, 0.0)
    # What the router sends for an OpenAI request that names no top_p or penalty.
    routed = pb.SamplingParams(top_p=1.0, repetition_penalty=1.0)
    assert sampling_settings(routed, 1000, defaults).top_p == 0.95
    assert logits_settings(routed, 1000, defaults).repetition_penalty == 1.05
    # What a request says wins.
    asked = pb.SamplingParams(temperature=1.0, top_p=0.5, top_k=3, min_p=0.25)
    settings = sampling_settings(asked, 1000, defaults)
    assert (settings.temperature, settings.top_p, settings.top_k, settings.min_p) == (
        1.0, 0.5, 3, 0.25
    )  # fmt: skip
    assert sampling_settings(pb.SamplingParams(temperature=0.0), 1000, defaults).greedy
    # Without defaults: temperature 1 and no filter.
    plain = sampling_settings(pb.SamplingParams(), 1000)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_only_values_a_request_could_send_are_read(tmp_path, caplog):
    config = {**QWEN3, "top_p": 1.5, "repetition_penalty": "high", "min_p": 0.05}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        defaults = read(generation_config(tmp_path), tmp_path / "generation_config.json")
    assert defaults == SamplingDefaults(temperature=0.6, top_k=20, min_p=0.05)
    assert "top_p of 1.5" in caplog.text and "repetition_penalty of 'high'" in caplog.text
    assert read(generation_config(tmp_path / "nowhere"), tmp_path) == SamplingDefaults()


def unset_sampling(ids: list[int]) -> pb.GenerateRequest:
    """A request that sets no sampling value (the helpers' request() asks for greedy)."""
    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=16, ignore_eos=True))
    req.tokenized.input_ids.extend(ids)
    return req


def test_a_worker_applies_them_and_says_so_unless_told_not_to(
    start_worker, model_dir, tmp_path, caplog
):
    model = model_copy(model_dir, tmp_path / "top-k-1")
    (model / "generation_config.json").write_text(json.dumps({"top_k": 1}))
    with caplog.at_level(logging.INFO, logger="smg_mlx.server"):
        tuned = start_worker(model)
    assert "the model's sampling values" in caplog.text and ": top_k 1" in caplog.text
    plain = start_worker(model, model_sampling_defaults=False)
    prompts = [prompt(6, i) for i in range(4)]
    greedy = [collect(tuned.stub.Generate(unset_sampling(p), timeout=60)).tokens for p in prompts]
    # top_k 1 at temperature 1 is greedy decoding: what asking for greedy gives.
    for ids, tokens in zip(prompts, greedy, strict=True):
        asked = unset_sampling(ids)
        asked.sampling_params.temperature = 0.0
        assert collect(plain.stub.Generate(asked, timeout=60)).tokens == tokens
    sampled = [collect(plain.stub.Generate(unset_sampling(p), timeout=60)).tokens for p in prompts]
    assert sampled != greedy


@pytest.mark.parametrize("setting", ["auto", "none"])
def test_a_generation_config_that_is_not_json_is_named_and_served_without(
    start_worker, model_dir, tmp_path, caplog, setting
):
    model = model_copy(model_dir, tmp_path / "bad-generation-config")
    (model / "generation_config.json").write_text("{bad")
    with caplog.at_level(logging.WARNING):
        w = start_worker(model, model_sampling_defaults=setting == "auto")
    assert len(collect(w.stub.Generate(unset_sampling(prompt(4)), timeout=60)).tokens) == 16
    named = [r.getMessage() for r in caplog.records if "generation_config.json" in r.getMessage()]
    if setting == "none":  # not read at all
        assert named == []
    else:
        assert named == [
            f"{model}/generation_config.json is not valid JSON (Expecting property name "
            "enclosed in double quotes: line 1 column 2 (char 1)); serving without the model's "
            "sampling values and end-of-sequence ids in it: fix the file, or pass "
            "--generation-config none"
        ]


@pytest.mark.parametrize("eos", ["abc", 3.5, [2, "x"]])
def test_an_end_id_of_the_generation_config_that_is_no_id_is_named_and_left_out(
    start_worker, model_dir, tmp_path, caplog, eos
):
    model = model_copy(model_dir, tmp_path / "bad-eos")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "top_k": 1}))
    with caplog.at_level(logging.INFO):
        w = start_worker(model)
    assert len(collect(w.stub.Generate(unset_sampling(prompt(4)), timeout=60)).tokens) == 16
    assert f"{model}/generation_config.json gives eos_token_id as {eos!r}, not a token id" in (
        caplog.text
    )
    assert "top_k 1" in caplog.text  # the rest of the file is served
