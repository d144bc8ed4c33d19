"""The command line: its flags, their defaults (one home: config.py) and the flag table of
docs/configuration.md."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from smg_mlx import __version__
from smg_mlx.cli import build_parser, check_serve_args
from smg_mlx.config import EngineConfig, RequestLimits, ServerConfig, default_prompt_cache_dir
from smg_mlx.flag_types import byte_size

from docs import CONFIGURATION


def serve_flags() -> dict[str, argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    return {
        option: action
        for action in serve._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def flag_table() -> dict[str, str]:
    """Flag -> default cell, from the flag table of docs/configuration.md."""
    text = CONFIGURATION.read_text()
    table = text[text.index("## Flags") :].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        flags_cell, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for flag in re.findall(r"`(--[a-z-]+)", flags_cell):
            rows[flag] = default.strip("`")
    return rows


def test_every_flag_in_help_is_in_the_flag_table():
    rows = flag_table()
    missing = sorted(set(serve_flags()) - set(rows) - {"--model-path"})
    assert not missing, f"the flag table of docs/configuration.md lacks {missing}"
    assert "--model-path" in CONFIGURATION.read_text()


def test_the_flag_tables_defaults_match_the_code():
    flags, checked = serve_flags(), 0
    for flag, cell in flag_table().items():
        action = flags.get(flag)
        if action is None or action.default in (None, False, argparse.SUPPRESS):
            continue
        if flag.endswith("-bytes"):
            value = byte_size(cell)
        elif isinstance(action.default, (int, float)):
            value = float(cell)
        else:
            value = cell
        assert value == action.default, (flag, cell, action.default)
        checked += 1
    assert checked >= 10


def test_defaults_come_from_the_config():
    args = build_parser().parse_args(["serve", "--demo"])
    engine = EngineConfig(model_path=Path("."))
    assert args.completion_batch_size == engine.completion_batch_size
    assert args.prefill_step_size == engine.prefill_step_size
    assert args.prompt_cache_bytes == engine.prompt_cache_bytes
    assert args.burst_window_ms == engine.burst_window_seconds * 1000
    assert args.max_pending == ServerConfig.max_pending
    assert args.stream_interval == ServerConfig.stream_interval
    limits = RequestLimits()
    assert (args.max_request_bytes, args.max_response_bytes) == (
        limits.max_request_bytes,
        limits.max_response_bytes,
    )
    assert (args.max_stop_token_ids, args.max_logit_bias) == (
        limits.max_stop_token_ids,
        limits.max_logit_bias,
    )


def test_help_says_each_default_once(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text
    assert not re.search(r"\(default[^)]*\)\s*\(default", text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GiB", 4 << 30), ("512MB", 512_000_000), ("2G", 2 << 30), ("1073741824", 1 << 30),
     ("0", 0), ("1.5GiB", 3 << 29), ("64 MiB", 64 << 20), ("999PiB", 999 << 50)],
)  # fmt: skip
def test_sizes_take_units(text, expected):
    assert byte_size(text) == expected
    args = build_parser().parse_args(["serve", "--demo", "--prompt-cache-bytes", text])
    assert args.prompt_cache_bytes == expected


def test_the_disk_tier_takes_0_or_a_size_it_can_use():
    # (smaller sizes are refused: test_bad_values_say_what_is_expected)
    for text, expected in (("0", 0), ("1MiB", 1 << 20), ("1048576", 1 << 20)):
        args = build_parser().parse_args(["serve", "--demo", "--prompt-cache-disk-bytes", text])
        assert args.prompt_cache_disk_bytes == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-cache-bytes", "lots"], "expected a size such as 4GiB"),
        (["--prompt-cache-bytes", "4i"], "expected a size such as 4GiB"),
        (["--prompt-cache-bytes", "0.5"], "'0.5' is less than one byte"),  # not off
        (["--prompt-cache-bytes", "1.5"], "expected a whole number of bytes, got '1.5'"),
        (["--memory-budget", "99999999999999999999999GiB"], "more than any machine has"),
        (["--prompt-cache-disk-bytes", "9" * 400], "more than any machine has"),
        (["--prompt-cache-disk-bytes", "1"], "expected 0 (no disk tier) or a size of at least "
         "1MiB, got '1': a model's KV cache takes tens of KiB or more a token"),
        (["--prompt-cache-disk-bytes", "1023KiB"], "at least 1MiB, got '1023KiB'"),
        (["--prompt-cache-dir", ""], "expected a directory, got an empty path"),
        (["--max-response-bytes", "1KiB"], "expected a size of at least 64KiB, got '1KiB'"),
        (["--max-request-bytes", "2GiB"], "expected a size below 2GiB (the largest message"),
        (["--max-pending", "-1"], "expected a whole number, 0 or more, got '-1'"),
        (["--completion-batch-size", "x"], "expected a whole number of at least 1, got 'x'"),
        (["--num-draft-tokens", "40"], "expected a whole number from 1 to 15, got '40'"),
        (["--num-draft-tokens", "0"], "expected a whole number from 1 to 15, got '0'"),
        (["--num-draft-tokens", "x"], "expected a whole number from 1 to 15, got 'x'"),
        # (an empty path is the folder the worker runs in: not what was meant)
        (["--model", ""], "--model/--model-path: expected an mlx-lm model directory or a "
         "Hugging Face repo id, got ''"),
        (["--draft-model", " "], "--draft-model: expected an mlx-lm model directory or a "
         "Hugging Face repo id, got ' '"),
        (["--speculative", "on"], "invalid choice: 'on'"),
        (["--memory-budget", "0"], "expected a size above 0"),
        (["--model", "https://huggingface.co/mlx-community/Qwen3-0.6B-4bit/tree/main"],
         "'https://huggingface.co/mlx-community/Qwen3-0.6B-4bit/tree/main' is a web address: "
         "pass its repo id, mlx-community/Qwen3-0.6B-4bit"),
        (["--draft-model", "http://example.com/m"], "'http://example.com/m' is a web address: "
         "pass an mlx-lm model directory or a Hugging Face repo id such as "
         "mlx-community/Qwen3-0.6B-4bit"),
        (["--memory-budget", "80"], "'80' is 80 bytes, which hold no model: a share of the "
                                    "memory is written with % (80%), a size with its unit"),
        (["--memory-budget=-5%"], "expected a percentage above 0 and up to 100%, got '-5%'"),
        # A value after a space that starts with '-' and a digit is the flag's, as after '='.
        (["--memory-budget", "-5%"], "expected a percentage above 0 and up to 100%, got '-5%'"),
        (["--memory-budget", "-5GiB"], "expected a size such as 4GiB, 512MB or a number of "
         "bytes, got '-5GiB'"),
        (["--prompt-cache-bytes", "-.5GiB"], "expected a size such as 4GiB, 512MB or a number "
         "of bytes, got '-.5GiB'"),
        (["--memory-budget", "x%"], "expected a percentage above 0 and up to 100%, got 'x%'"),
        (["--served-model-name", "   "], "expected a name, got only spaces: '   '"),
        (["--served-model-name", " a b "], "' a b ' has spaces at its ends, which clients would "
         "have to send too: give 'a b'"),
        (["--port", "70000"], "expected a port number from 0 to 65535, got '70000'"),
        (["--port", "-1"], "expected a port number from 0 to 65535, got '-1'"),
        (["--metrics-port", "0"], "expected a port number from 1 to 65535, got '0'"),
    ],
)
def test_bad_values_say_what_is_expected(args, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--demo", *args])
    err = capsys.readouterr().err
    assert message in err and "_" not in err.split("error:")[1].replace("--", "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-draft-tokens", "1_0"], "expected a whole number from 1 to 15, got '1_0'"),
        (["--num-draft-tokens", "\u0663"], "expected a whole number from 1 to 15"),
        (["--max-pending", "1_000"], "expected a whole number, 0 or more, got '1_000'"),
        (["--port", "\u0665\u0660"], "expected a port number from 0 to 65535"),
        (["--prompt-cache-bytes", "\u0664GiB"], "expected a size such as 4GiB"),
    ],
)
def test_numbers_are_written_in_plain_digits(args, message, capsys):
    # Python reads "1_0" as 10 and Arabic-Indic digits as numbers too: a
    # typo or a pasted value would start a worker the user did not ask for.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--demo", *args])
    assert message in capsys.readouterr().err


def test_log_level_in_any_case_and_model_path_alias():
    args = build_parser().parse_args(["serve", "--model-path", "m", "--log-level", "INFO"])
    assert (args.model, args.log_level) == (Path("m"), "info")


@pytest.mark.parametrize("args", [["--version"], ["serve", "--version"]])
def test_version(args, capsys):
    # `serve --version` too: the flag table lists it among serve's flags.
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"smg-mlx {__version__}"


def serve_args(*argv: str):
    args = build_parser().parse_args(["serve", *argv])
    check_serve_args(args.serve_parser, args)
    return args


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_prompt_cache_dir_named_is_not_refused(tmp_path, monkeypatch, error):
    """Full, of bytes or of inodes (the worker's own entries may use them up):
    not a mistyped path, so no exit 2, which a supervisor would not restart."""

    def full(*args, **kwargs):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(tempfile, "TemporaryFile", full)
    assert serve_args("--demo", "--prompt-cache-dir", str(tmp_path)).prompt_cache_dir == tmp_path


def test_the_model_may_be_named_as_vllm_does():
    assert serve_args("mlx-community/Qwen3-0.6B-4bit").model == Path(
        "mlx-community/Qwen3-0.6B-4bit"
    )
    assert serve_args("--model", "org/name").model == Path("org/name")


def test_an_adapter_path_names_an_adapter(capsys):
    with pytest.raises(SystemExit):
        serve_args("--demo", "--adapter-path", "/no/adapter")
    assert "'/no/adapter' is not a LoRA adapter's directory (no such directory)" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "~no-such-user-here/m"],
        ["--demo", "--adapter-path", "~no-such-user-here/a"],
        ["--demo", "--prompt-cache-dir", "~no-such-user-here/c"],
        ["--demo", "--draft-model", "~no-such-user-here/d"],
    ],
)
def test_a_path_in_the_home_of_no_user_is_refused_with_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_args(*argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[-2]}" in err
    assert "no user 'no-such-user-here' has a home directory" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "name one model to serve: MODEL or --model"),
        (["org/a", "--model", "org/b"], "or --demo (org/a and org/b were given)"),
        (["org/a", "--demo"], "or --demo (org/a and --demo were given)"),
        (["--demo", "--revision", "v1"], "--revision names a version of a Hugging Face repo id"),
        (["--demo", "--metrics-port", "50051"], "--metrics-port 50051 is --port's too"),
        (["--demo", "--kv-bits", "6"], "--kv-bits: expected 8 or 4, got '6'"),
        (["--demo", "--kv-bits", "16"],  # (no value means off: leaving the flag out does)
         "to keep KV as the model computes it (16 bits for a bf16 model), leave --kv-bits out"),
        (["--demo", "--kv-bits", "8"], "heads 64 wide, `python -m smg_mlx.demo_model DIR --head"),
        # (advice that works with the group asked for)
        (["--demo", "--kv-bits", "8", "--kv-group-size", "128"],
         "heads 128 wide, `python -m smg_mlx.demo_model DIR --head-dim 128`"),
        (["org/m", "--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size: invalid choice"),
        (["--demo", "--kv-group-size", "32"], "--kv-group-size: the KV caches are not quantized"),
        (["--demo", "--num-draft-tokens", "8"], "--num-draft-tokens: speculative decoding is off"),
        (["--demo", "--num-draft-tokens", "8", "--speculative", "off"],
         "--num-draft-tokens: speculative decoding is off"),
        (["org/m", "--kv-bits", "8", "--quantized-kv-start", "5000"],
         "--quantized-kv-start 5000: a batch holds all its rows' KV caches in one format"),
        (["org/m", "--kv-bits", "8", "--quantized-kv-start", "-1"],
         "--quantized-kv-start -1: a batch holds all its rows' KV caches in one format"),
        (["--demo", "--quantized-kv-start", "5000"],
         "--quantized-kv-start 5000: the KV caches are not quantized without --kv-bits"),
        (["--demo", "--prompt-cache-bytes", "0", "--prompt-cache-disk-bytes", "10GiB"],
         "--prompt-cache-bytes 0 turns the prompt cache off, its disk tier included"),
        (["--demo", "--quantized-kv-start", "0"],  # as --kv-group-size alone: it does nothing
         "--quantized-kv-start 0: the KV caches are not quantized without --kv-bits"),
    ],
)
def test_what_flags_say_together_is_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_args(*argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_mlx_lms_quantized_kv_start_is_taken_at_0_the_only_start_a_batch_has():
    assert serve_args("org/m", "--kv-bits", "8", "--quantized-kv-start", "0").kv_bits == 8


def test_pipeline_without_a_launcher_is_refused(monkeypatch, capsys):
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_:
        serve_args("--demo", "--pipeline")
    assert exit_.value.code == 2
    assert "--pipeline splits a model over the ranks a launcher starts" in capsys.readouterr().err
    monkeypatch.setenv("MLX_RANK", "0")
    assert serve_args("--demo", "--pipeline").pipeline


def test_a_path_written_as_one_stays_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert serve_args("--model", "./models/x").model == tmp_path / "models" / "x"
    assert serve_args("../x").model == tmp_path / ".." / "x"
    assert serve_args("--model", "~/x").model == Path.home() / "x"
    assert serve_args("models/x").model == Path("models/x")  # may be a repo id
    for given, used in (("cache", tmp_path / "cache"), ("~/c", Path.home() / "c")):
        assert serve_args("--demo", "--prompt-cache-dir", given).prompt_cache_dir == used


def test_a_relative_xdg_cache_home_is_ignored_with_one_warning(monkeypatch, caplog):
    # The XDG base directory spec: a relative path is to be ignored (it would
    # name a folder under whichever directory the worker happens to start in).
    monkeypatch.setenv("HOME", "/HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    with caplog.at_level(logging.WARNING, logger="smg_mlx.config"):
        for _ in range(2):
            assert default_prompt_cache_dir() == Path("/HOME/.cache/smg-mlx/prompt-cache")
    assert caplog.messages == [
        "XDG_CACHE_HOME=relative-cache is a relative path, which the XDG base directory spec "
        "says to ignore: using /HOME/.cache; set it to an absolute path to use another"
    ]
    monkeypatch.setenv("XDG_CACHE_HOME", "/cache")
    assert default_prompt_cache_dir() == Path("/cache/smg-mlx/prompt-cache")


def test_demo_model_help_shows_every_default():
    text = subprocess.run(
        [sys.executable, "-m", "smg_mlx.demo_model", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Each option that takes a value, with the help that follows it.
    options = re.findall(r"\n  (--[a-z-]+ [A-Z_]+)(.*?)(?=\n  -|\Z)", text, re.DOTALL)
    assert len(options) >= 10
    for option, help_text in options:
        assert "(default: " in " ".join(help_text.split()), option


@pytest.mark.parametrize(
    ("argv", "unknown", "nearest"),
    [
        (["serve", "--demo", "--modle", "x"], "--modle", "--model"),
        (["serve", "--mod", "x"], "--mod", "--model"),  # no prefix of a flag is taken
        (["serve", "--demo", "--metrics", "9402"], "--metrics", "--metrics-port"),
        (["serve", "--demo", "--served=foo"], "--served", "--served-model-name"),
        (["health", "--prot", "50051"], "--prot", "--port"),
    ],
)
def test_an_unknown_flag_gets_its_command_and_the_nearest_flag(argv, unknown, nearest, capsys):
    """One line: the error, and where the command's flags are listed (not
    after a screenful of usage, where a log tail would miss it)."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    [err] = capsys.readouterr().err.splitlines()
    assert err.startswith(f"smg-mlx {argv[0]}: error: ")
    assert f"unrecognized argument {unknown} (did you mean {nearest}?)" in err
    assert err.endswith(f" (see smg-mlx {argv[0]} --help)")


def test_demo_model_writes_no_model_over_a_directory_that_holds_files(tmp_path):
    def demo_model(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "smg_mlx.demo_model", *args]
        return subprocess.run(command, capture_output=True, text=True)

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("important")
    done = demo_model(str(mine))
    assert done.returncode == 2 and "is not empty: name a new or empty directory" in done.stderr
    assert (mine / "config.json").read_text() == "important"
    wrong = [
        (["--heads", "3"], "--heads 3 is not a multiple of --kv-heads 2"),
        (["--layers", "0"], "--layers: expected at least 1, got 0"),
        # (the worker would refuse the model it wrote)
        (["--context-length", "1"], "--context-length: expected at least 2"),
        (["--family", "qwen2", "--sliding-window", "64"], "mlx-lm's qwen2 has no sliding windows"),
        (["--family", "qwen2", "--head-dim", "64"], "mlx-lm's qwen2 makes its heads --hidden-size"),
        # (the worker would refuse the model it wrote: RoPE turns pairs of values)
        (["--head-dim", "7"], "heads 7 wide: RoPE needs an even head size"),
    ]
    for shape, said in wrong:
        done = demo_model(str(tmp_path / "new"), *shape)
        assert done.returncode == 2 and said in done.stderr
    done = demo_model(str(mine), "--force")
    assert done.returncode == 0
    assert done.stdout == (f"wrote a random-weight llama model (float32) to {mine}: "
                           f"serve it with `smg-mlx serve --model {mine}`\n")  # fmt: skip
    assert (mine / "config.json").read_text() != "important"
    (tmp_path / "a-file").write_text("")
    for out, said in ((tmp_path / "a-file", "is a file: name a new or empty directory"),
                      (tmp_path / "a-file" / "m", "cannot make the directory")):  # fmt: skip
        done = demo_model(str(out))
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("shape", "said"),
    [
        # (MLX crashed on these, a segmentation fault, after writing the tokenizer)
        (["--hidden-size", "10000000"], "the weights would take 6,548.4 TiB (float32): more "
         "than this machine's memory, "),
        (["--layers", "10000000000", "--dtype", "bfloat16"], "the weights would take 670.6 TiB "
         "(bfloat16; 2,011.7 TiB while they are made, in float32 first): more than this "
         "machine's memory, "),
        (["--vocab-size", "3000000000"], "weights 3000000000 wide: MLX's arrays are at most "
         "2147483647 wide; give smaller --hidden-size, --intermediate-size, --vocab-size"),
    ],
)
def test_demo_model_refuses_weights_no_machine_could_build(tmp_path, shape, said):
    out = tmp_path / "new"
    command = [sys.executable, "-m", "smg_mlx.demo_model", str(out), *shape]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert not out.exists()


def test_a_model_build_stopped_by_a_signal_leaves_nothing_after_the_next(tmp_path):
    """A --demo worker stopped while it builds its model leaves its build folder
    (a SIGTERM ends it at once); the next build clears what no running process owns."""
    from smg_mlx.demo_model import built_aside

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = tmp_path / f".m.tmp{ended.stdout.strip()}"
        building = tmp_path / f".m.tmp{running.pid}"  # another worker's build under way
        for folder in (stale, building):
            folder.mkdir()
        built_aside(tmp_path / "m", lambda tmp: tmp.mkdir())
        assert (tmp_path / "m").is_dir() and building.is_dir() and not stale.exists()
    finally:
        running.kill()
        running.wait()


def test_demo_model_windows_layers_of_any_count(tmp_path):
    """Every layer gets a type (transformers refuses a model whose list is
    shorter, so the worker would not start), and one layer alone, which
    mlx-lm's llama cannot window without a full-attention layer, is refused."""
    def demo_model(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "smg_mlx.demo_model", *args]
        return subprocess.run(command, capture_output=True, text=True)

    done = demo_model(str(tmp_path / "one"), "--sliding-window", "8", "--layers", "1")
    assert done.returncode == 2 and "give --layers 2 or more" in done.stderr
    assert "Traceback" not in done.stderr
    odd = tmp_path / "odd"
    assert demo_model(str(odd), "--sliding-window", "8", "--layers", "3").returncode == 0
    loaded = subprocess.run(
        [sys.executable, "-c", f"import mlx_lm; mlx_lm.load({str(odd)!r})"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-2000:]
