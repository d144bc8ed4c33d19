"""The command line: its flags, their defaults (one home: config.py) and the README's table."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from smg_mlx import __version__
from smg_mlx.cli import build_parser, byte_size
from smg_mlx.config import EngineConfig, RequestLimits, ServerConfig

README = Path(__file__).resolve().parent.parent / "README.md"


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


def readme_table() -> dict[str, str]:
    """Flag -> default cell, from the README's flag table."""
    text = README.read_text()
    table = text[text.index("### Flags") :].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        flags_cell, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for flag in re.findall(r"`(--[a-z-]+)", flags_cell):
            rows[flag] = default.strip("`")
    return rows


def test_every_flag_in_help_is_in_the_readme_table():
    rows = readme_table()
    missing = sorted(set(serve_flags()) - set(rows) - {"--model-path"})
    assert not missing, f"README's flag table lacks {missing}"
    assert "--model-path" in README.read_text()


def test_readme_defaults_match_the_code():
    flags, checked = serve_flags(), 0
    for flag, cell in readme_table().items():
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
     ("0", 0), ("1.5GiB", 3 << 29), ("64 MiB", 64 << 20)],
)  # fmt: skip
def test_sizes_take_units(text, expected):
    assert byte_size(text) == expected
    args = build_parser().parse_args(["serve", "--demo", "--prompt-cache-bytes", text])
    assert args.prompt_cache_bytes == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt-cache-bytes", "lots"], "expected a size such as 4GiB"),
        (["--prompt-cache-bytes", "4i"], "expected a size such as 4GiB"),
        (["--max-response-bytes", "1KiB"], "expected a size of at least 64KiB, got '1KiB'"),
        (["--max-pending", "-1"], "expected a whole number, 0 or more, got '-1'"),
        (["--completion-batch-size", "x"], "expected a whole number of at least 1, got 'x'"),
    ],
)
def test_bad_values_say_what_is_expected(args, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--demo", *args])
    err = capsys.readouterr().err
    assert message in err and "_" not in err.split("error:")[1].replace("--", "")


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
