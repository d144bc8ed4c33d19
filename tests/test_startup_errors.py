"""A model or a flag the worker cannot use stops it before SERVING, with one line that
says why and the exit code a supervisor acts on: 2 for what only a person can fix (a
flag, the model directory), 1 for what a restart may cure."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from bench.workers import free_port
from smg_mlx import model_files
from smg_mlx.config import EngineConfig
from smg_mlx.server import check_chat_template, listen_failure, load_tokenizer

from conftest import build_once
from helpers import model_copy, serve


def one_error(lines: list[str]) -> str:
    """The one line that says why the worker stopped (and nothing like a traceback)."""
    errors = [line for line in lines if " ERROR " in line or line.startswith("E")]
    assert len(errors) == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    return errors[0]


def test_a_demo_model_with_no_folder_to_build_in_says_where_to_build_it(tmp_path):
    cache = tmp_path / "a-file"
    cache.write_text("")
    code, lines = serve("--demo", "--port", str(free_port()), env={"XDG_CACHE_HOME": str(cache)})
    assert code == 2
    assert one_error(lines).endswith(
        f"--demo: cannot build the demo model in {cache}/smg-mlx/demo-llama-"
        f"{version('smg-mlx')}: Not a directory ({cache}/smg-mlx): set XDG_CACHE_HOME to a "
        "directory this user can write"
    )


@pytest.fixture(scope="module")
def qwen2_dir(models_root: Path) -> Path:
    return build_once(models_root / "tiny-qwen2", ["--family", "qwen2"])


@pytest.mark.parametrize(
    ("family", "kept"), [("llama", ()), ("qwen2", ()), ("llama", ("tokenizer_config.json",))]
)
def test_a_model_directory_without_a_tokenizer_is_refused(
    family, kept, model_dir, qwen2_dir, tmp_path, refused
):
    # transformers fails for a llama, and builds an empty tokenizer for a qwen2; with
    # only the tokenizer's config, it asks for a library to convert files that are not there.
    source = model_dir if family == "llama" else qwen2_dir
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors", *kept):
        (weights_only / name).symlink_to(source / name)
    why = refused(weights_only)
    assert why.exit_code == 2
    assert f"{weights_only} has no tokenizer" in str(why)


def test_an_unknown_model_family_is_one_line(model_dir, tmp_path):
    unknown = model_copy(model_dir, tmp_path / "m", model_type="qwen_3", rope_scaling=None)
    code, lines = serve("--model", str(unknown), "--port", "0")
    assert code == 2  # a restart cannot cure it
    assert (
        f"{unknown}/config.json names model_type 'qwen_3', a model family mlx-lm "
        f"{version('mlx-lm')} does not have (the nearest: 'qwen3', 'qwen'"
    ) in one_error(lines)  # (a few, the nearest first: which others, mlx-lm's list says)


def test_model_families_mlx_lm_serves_under_another_name_are_taken(model_dir, tmp_path):
    # mlx-lm serves a mistral with its llama module (MODEL_REMAPPING).
    mistral = model_copy(model_dir, tmp_path / "m", model_type="mistral")
    model_files.check(mistral)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("no weights", "{model} has no weights (no model*.safetensors file)"),
        ("config not JSON", "{model}/config.json is not valid JSON (Expecting value"),
        ("no model_type", "{model}/config.json names no model_type"),
        ("model_type 5", "{model}/config.json gives model_type as 5, not a family's name"),
        ("settings missing", "cannot build the model {model}/config.json describes (TypeError"),
        (
            "generation list",
            "{model}/generation_config.json holds a JSON list, not an object: "
            "mlx-lm reads it as it loads the model (even with --generation-config none)",
        ),
        ("generation not UTF-8", "{model}/generation_config.json is not UTF-8 text"),
        ("generation folder", "{model}/generation_config.json is not a file"),
        ("tokenizer not JSON", "cannot load the tokenizer of {model}/tokenizer_config.json:"),
        (
            "config of other weights",
            "the weights in {model} do not fit the model its config.json describes (Expected shape",
        ),
        (
            "a shard missing",
            "{model} lacks 1 of the 2 weight files its "
            "model.safetensors.index.json lists (model-00002-of-00002.safetensors first)",
        ),
        # Not blamed on the weights: mlx-lm fails building the model, before reading them.
        (
            "rope type unknown",
            "cannot build the model {model}/config.json describes "
            "(Unsupported RoPE type yarn-2): the file names a setting mlx-lm does not support",
        ),
        # transformers reads config.json to find the tokenizer; mlx-lm would take it.
        ("config transformers refuses", "transformers cannot read {model}/config.json ("),
        # Said in the file's words, not transformers' ("rope_parameters") nor Python's.
        (
            "rope scaling a list",
            "{model}/config.json gives rope_scaling as [8.0], not an object "
            '(such as {{"rope_type": "linear", "factor": 2.0}}): fix it, or serve the config.json',
        ),
        (
            "quantization a text",
            '{model}/config.json gives quantization as "yes": it must be an '
            'object such as {{"group_size": 64, "bits": 4}}, as mlx_lm.convert writes it',
        ),
        (
            "quantization without bits",
            "{model}/config.json gives quantization's bits none: it "
            "must be a whole number, in an object such as",
        ),
        ("architectures a number", "config.json gives architectures as 5, not a list of names"),
        (
            "weights empty",
            "{model}/model.safetensors is empty, or all but empty: not a weights file",
        ),
        ("weights a folder", "{model}/model.safetensors is not a file"),
        (
            "tokenizer without fields",
            "cannot load the tokenizer of {model}: KeyError: "
            "'added_tokens'; a tokenizer file lacks or misstates a field",
        ),
        ("tokenizer length as text", "the tokenizer of {model} cannot encode a text (TypeError"),
    ],
)
def test_a_model_directory_mlx_lm_cannot_load_exits_two(
    model_dir, tmp_path, fault, message, refused
):
    model = model_copy(model_dir, tmp_path / "m", leave_out="model.safetensors")
    if fault == "weights empty":
        (model / "model.safetensors").write_bytes(b"")
    elif fault == "weights a folder":
        (model / "model.safetensors").mkdir()
    elif fault != "no weights":
        (model / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    config = json.loads((model / "config.json").read_text())
    generation = model / "generation_config.json"
    if fault == "config not JSON":
        (model / "config.json").write_text("not json")
    if fault == "no model_type":
        del config["model_type"]
        (model / "config.json").write_text(json.dumps(config))
    if fault == "model_type 5":
        (model / "config.json").write_text(json.dumps({**config, "model_type": 5}))
    if fault == "settings missing":
        (model / "config.json").write_text(json.dumps({"model_type": config["model_type"]}))
    if fault == "generation list":
        generation.write_text("[1, 2]")
    if fault == "generation not UTF-8":
        generation.write_bytes(b"\xff\xfe{")
    if fault == "generation folder":
        generation.mkdir()
    if fault == "rope type unknown":
        config["rope_scaling"] = {"rope_type": "yarn-2", "factor": 2.0}
        (model / "config.json").write_text(json.dumps(config))
    if fault == "rope scaling a list":
        config["rope_scaling"] = [8.0]
        (model / "config.json").write_text(json.dumps(config))
    if fault.startswith("quantization"):
        quantization = "yes" if fault == "quantization a text" else {"group_size": 64}
        (model / "config.json").write_text(json.dumps({**config, "quantization": quantization}))
    if fault == "config transformers refuses":  # a linear RoPE without its factor
        config["rope_scaling"] = {"rope_type": "linear"}
        (model / "config.json").write_text(json.dumps(config))
    if fault == "tokenizer without fields":
        (model / "tokenizer.json").unlink()
        (model / "tokenizer.json").write_text('{"model": {}}')
    if fault == "architectures a number":
        (model / "config.json").write_text(json.dumps({**config, "architectures": 5}))
    if fault == "tokenizer length as text":
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").unlink()
        (model / "tokenizer_config.json").write_text(
            json.dumps({**tokenizer_config, "model_max_length": "big"})
        )
    if fault == "config of other weights":
        config["intermediate_size"] += 8
        (model / "config.json").write_text(json.dumps(config))
    if fault == "tokenizer not JSON":
        (model / "tokenizer_config.json").unlink()
        (model / "tokenizer_config.json").write_text("{not json")
    if fault == "a shard missing":  # its index lists a second file, not copied
        shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
        (model / "model.safetensors").rename(model / shards[0])
        weights = {"lm_head.weight": shards[1], "model.norm.weight": shards[0]}
        index = {"metadata": {}, "weight_map": weights}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    # (--generation-config none for those of generation_config.json)
    why = refused(model, model_sampling_defaults=not fault.startswith("generation"))
    assert why.exit_code == 2
    assert message.format(model=model) in str(why)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("no weights", "--draft-model: {draft} has no weights (no model*.safetensors file)"),
        ("unknown family", "--draft-model: {draft}/config.json names model_type 'foobar'"),
        ("no tokenizer", "--draft-model: {draft} has no tokenizer"),
        ("other weights", "--draft-model: the weights in {draft} do not fit the model"),
    ],
)
def test_a_draft_model_mlx_lm_cannot_load_exits_two_and_names_the_flag(
    model_dir, tmp_path, fault, message, refused
):
    """A mistyped draft is the person's to fix, as a mistyped --model is: exit 2,
    not 1 (which supervisors restart into the same failure)."""
    draft = model_copy(model_dir, tmp_path / "draft", leave_out="model.safetensors")
    if fault != "no weights":
        (draft / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    if fault == "unknown family":
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**config, "model_type": "foobar"}))
    if fault == "other weights":
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 9}))
    if fault == "no tokenizer":
        for path in draft.glob("*token*"):
            path.unlink()
    why = refused(model_dir, draft_model=draft, speculative="auto")  # (--draft-model's)
    assert why.exit_code == 2
    assert message.format(draft=draft) in str(why)


def test_an_adapter_directory_without_its_weights_exits_two(model_dir, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    code, lines = serve("--model", str(model_dir), "--adapter-path", str(adapter))
    assert code == 2
    missing = f"'{adapter}' is not a LoRA adapter's directory (no adapters.safetensors in it)"
    assert missing in lines[-1]


def test_truncated_weights_are_one_line(model_dir, tmp_path, refused):
    truncated = model_copy(model_dir, tmp_path / "m", leave_out="model.safetensors")
    weights = (model_dir / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    why = refused(truncated)
    assert why.exit_code == 1
    assert "incomplete download or corrupt file" in str(why)
    assert "(a weights file that cannot be read: download the model again)" in str(why)
    # Not weights at all (mlx says only that its header is wrong): the same advice.
    (truncated / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    why = refused(truncated)
    assert why.exit_code == 1
    assert str(why).endswith("(a weights file that cannot be read: download the model again)")


def test_a_prompt_cache_dir_named_that_cannot_be_used_is_refused(model_dir, tmp_path):
    # (A mistyped volume path: served on, it would lose the disk tier and the
    # remembered start-up verdicts with only a warning.)
    (tmp_path / "afile").write_text("")
    code, lines = serve("--model", str(model_dir), "--port", "0",
                        "--prompt-cache-dir", str(tmp_path / "afile" / "cache"))  # fmt: skip
    assert code == 2
    assert f"--prompt-cache-dir {tmp_path}/afile/cache: cannot make it or write in it" in lines[-1]
    assert "give a directory this user can write" in lines[-1]
    code, lines = serve("--model", str(model_dir), "--port", "0",
                        "--prompt-cache-dir", str(tmp_path / "afile"))  # fmt: skip
    assert code == 2
    assert f"--prompt-cache-dir {tmp_path}/afile: it is a file, not a directory" in lines[-1]


# Each flag's own check is test_cli's; these exit before anything starts, with 2.
@pytest.mark.parametrize("args", [["--port", "70000"], ["--metrics-port", "50051"], ["--bogus"]])
def test_bad_flag_values_exit_two_before_anything_starts(model_dir, args):
    code, lines = serve("--model", str(model_dir), *args)
    assert code == 2
    assert "error: " in lines[-1] and "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "from 1 to 65535, got '70000'"),
        (["--timeout", "0"], "expected a number of seconds above 0, up to 86400 (a day), got '0'"),
        (["--timeout", "1e10"], "up to 86400 (a day), got '1e10'"),
    ],
)
def test_health_refuses_what_it_cannot_ask(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "smg_mlx", "health", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and message in done.stderr


def test_an_address_this_machine_does_not_have_exits_two(model_dir):
    code, lines = serve("--model", str(model_dir), "--host", "192.0.2.1")  # TEST-NET-1
    assert code == 2
    assert "192.0.2.1 is not an address of this machine: fix --host" in lines[-1]


def test_a_host_that_resolves_nowhere_exits_two(monkeypatch):
    def nowhere(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nowhere)
    failure = listen_failure("--port", "999.1.1.1", 50051)
    assert failure.exit_code == 2
    assert "999.1.1.1 is neither an address nor a name this machine resolves" in str(failure)
    failure = listen_failure("--port", "", 50051)  # (--host ''): said as empty
    assert ": '' is neither an address nor a name" in str(failure)


def test_a_path_is_never_taken_for_a_repo_id(model_dir, tmp_path):
    # Online, with a Hub that would answer: a mistyped path must not reach it.
    hub = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    hub["HF_HOME"] = str(tmp_path / "hf")
    code, lines = serve("--model", "./modles/demo-qwen2", "--port", "0", env=hub)
    assert code == 2
    error = one_error(lines)
    assert "--model: " in error
    assert "modles/demo-qwen2 is not a model directory (no such path)" in error
    assert "download" not in "\n".join(lines)


def test_a_rank_stopped_while_it_loads_ends_quietly_with_zero(model_dir, monkeypatch, caplog):
    from smg_mlx import follower
    from smg_mlx.engine.batch.batch import Batch

    def stopped(*args: object) -> None:
        raise SystemExit(0)  # what SIGTERM raises before serving (cli), as a launcher sends it

    monkeypatch.setattr(Batch, "__init__", stopped)
    assert follower.run(EngineConfig(model_path=model_dir), 1) == 0
    assert "model load failed" not in caplog.text
    assert not any(record.exc_info for record in caplog.records)


def test_a_chat_template_that_cannot_render_is_warned_of_at_start_up(model_dir, tmp_path, caplog):
    """The router renders the template itself: a worker whose template is broken
    reports SERVING while every chat through the router fails, so start-up says so."""
    broken = model_copy(model_dir, tmp_path / "broken", leave_out="tokenizer_config.json")
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"]  # (the test model's own renders: no warning)
    with caplog.at_level("WARNING", logger="smg_mlx.server"):
        check_chat_template(load_tokenizer(model_dir))
    assert not caplog.records
    # Valid Jinja that fails as it renders a chat: the router loads the template and
    # refuses chats; its completions of text still work.
    tokenizer_config["chat_template"] = "{{ raise_exception('only tool calls here') }}"
    (broken / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with caplog.at_level("WARNING", logger="smg_mlx.server"):
        check_chat_template(load_tokenizer(broken))
    [warning] = [r.getMessage() for r in caplog.records]
    assert "the chat template" in warning and "cannot render a one-message chat" in warning
    assert "the router's chat completions will fail (its completions of text still work)" in (
        warning
    )
    # Not Jinja at all: the router cannot load the tokenizer, and refuses every request.
    caplog.clear()
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m.content }{% endfor %}"
    (broken / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with caplog.at_level("WARNING", logger="smg_mlx.server"):
        check_chat_template(load_tokenizer(broken))
    [warning] = [r.getMessage() for r in caplog.records]
    assert "is not valid Jinja" in warning
    assert "every request through it fails (chats and text completions alike" in warning
    assert "its --chat-template" in warning
