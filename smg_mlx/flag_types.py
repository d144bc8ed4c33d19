"""What each command-line flag's text may be: sizes ("4GiB", "512MB"), a memory
budget (a size or a share), counts, ports, paths. Each parser raises
argparse.ArgumentTypeError, which argparse reports with the flag's name.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from collections.abc import Callable
from pathlib import Path

from smg_mlx import model_source
from smg_mlx.config import DISK_CACHE_LEAST, KV_BITS, MOST_DRAFT_TOKENS
from smg_mlx.model_config import BadModelConfig, read_json

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgtp])(i?))?b?", re.IGNORECASE | re.ASCII)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
# Smaller message limits would refuse ordinary requests and responses.
MIN_MESSAGE_BYTES = 64 << 10
MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC takes its message limits as a C int
MAX_PORT = 65535
MAX_SIZE = 1 << 60


def byte_size(text: str) -> int:
    """Bytes from "4GiB", "512MB", "2G" or "1073741824": KiB to PiB and bare
    K/M/G are powers of 1024, KB/MB/GB powers of 1000."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 4GiB, 512MB or a number of bytes, got {text!r}"
        )
    number, prefix, binary = match.groups()
    prefix = (prefix or "").lower()
    decimal = prefix and not binary and text.strip().lower().endswith("b")
    base = 1000 if decimal else 1024
    exact = float(number) * base ** _POWERS[prefix]
    if exact > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r} is more than any machine has")
    size = int(exact)
    if size == 0 and exact != 0:  # read as 0, it would turn a cache off
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    if size != exact and not prefix:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}")
    return size


def _expanded(text: str) -> Path:
    """`text` as a path, a leading ~ or ~user made that home directory."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # (~user of no such user, or ~ without HOME)
        user = text.split("/", 1)[0][1:]
        whose = f"no user {user!r} has a" if user else "HOME names no"
        raise argparse.ArgumentTypeError(f"{text!r}: {whose} home directory") from None


def directory(text: str) -> Path:
    if not text.strip():  # Path("") is the current directory
        raise argparse.ArgumentTypeError("expected a directory, got an empty path")
    return _expanded(text).absolute()  # logged as it is used


def memory_budget(text: str) -> tuple[int | None, float | None]:
    """(bytes, None) for a size ("24GiB"), (None, share) for a share of the
    device's memory ("80%")."""
    if text.strip().endswith("%"):
        try:
            share = float(text.strip()[:-1]) / 100
        except ValueError:
            share = math.nan
        if not 0 < share <= 1:  # (nan too)
            raise argparse.ArgumentTypeError(
                f"expected a percentage above 0 and up to 100%, got {text!r}"
            )
        return None, share
    return byte_size(text), None


def _number(kind: type, low: float, what: str) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            # Python's own numbers take "1_0" and digits of other scripts ("٣"):
            # a flag's value is written in ASCII digits, as its help says.
            if not text.isascii() or "_" in text:
                raise ValueError
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value >= low and math.isfinite(value)):  # also refuses nan
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _port(low: int) -> Callable[[str], int]:
    what = f"a port number from {low} to {MAX_PORT}"
    at_least = _number(int, low, what)

    def parse(text: str) -> int:
        port = at_least(text)
        if port > MAX_PORT:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return port

    return parse


# Bytes below which a budget given as a bare number holds no model: a share meant (80 for 80%).
LEAST_BARE_BUDGET = 1 << 20


def budget(text: str) -> tuple[int | None, float | None]:
    size, share = memory_budget(text)
    if size == 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0, or a percentage, got {text!r}")
    if size is not None and size < LEAST_BARE_BUDGET and text.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is {size} bytes, which hold no model: a share of the memory is written "
            f"with % ({text.strip()}%), a size with its unit (24GiB)"
        )
    return size, share


# A model's page on the Hugging Face hub, as a browser shows its address: the repo id in it.
_HUB_PAGE = re.compile(
    r"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/(?:models/)?"
    r"([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:[/?#].*)?"
)


def model_name(text: str) -> Path:
    if not text.strip():  # (Path("") is ".": the folder the worker runs in)
        raise argparse.ArgumentTypeError(
            f"expected an mlx-lm model directory or a Hugging Face repo id, got {text!r}"
        )
    if "://" in text:  # (as a path its // would read as /, a name no one gave)
        page = _HUB_PAGE.fullmatch(text.strip())
        said = f"its repo id, {page[1]}" if page else model_source.TO_PASS
        raise argparse.ArgumentTypeError(f"{text!r} is a web address: pass {said}")
    # Absolute, so that a path written as one ("./models/x") stays one and is
    # never taken for a Hugging Face repo id (model_source).
    return _expanded(text).absolute() if model_source.looks_like_a_path(text) else Path(text)


def adapter_dir(text: str) -> Path:
    # What mlx_lm.lora writes, and mlx-lm's loader reads.
    path = _expanded(text)
    if not path.is_dir():
        what = "a file" if path.exists() else "no such directory"
        raise argparse.ArgumentTypeError(f"{text!r} is not a LoRA adapter's directory ({what})")
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (path / name).is_file():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a LoRA adapter's directory (no {name} in it)"
            )
    try:
        read_json(path / "adapter_config.json")
    except BadModelConfig as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def disk_cache_size(text: str) -> int:
    """--prompt-cache-disk-bytes: 0 (no disk tier), or DISK_CACHE_LEAST at least."""
    size = byte_size(text)
    if 0 < size < DISK_CACHE_LEAST:
        raise argparse.ArgumentTypeError(
            f"expected 0 (no disk tier) or a size of at least {DISK_CACHE_LEAST >> 20}MiB, got "
            f"{text!r}: a model's KV cache takes tens of KiB or more a token, so a smaller disk "
            "tier would hold next to no prompt"
        )
    return size


def message_size(text: str) -> int:
    size = byte_size(text)
    if size < MIN_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected a size of at least {MIN_MESSAGE_BYTES >> 10}KiB, got {text!r}"
        )
    if size > MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected a size below 2GiB (the largest message gRPC takes), got {text!r}"
        )
    return size


positive = _number(int, 1, "a whole number of at least 1")


def kv_bits(text: str) -> int:
    """--kv-bits: one of KV_BITS. There is no value for off (16, 0): leaving
    the flag out is, and the refusal says so."""
    if text.strip() in {str(bits) for bits in KV_BITS}:
        return int(text)
    raise argparse.ArgumentTypeError(
        f"expected {' or '.join(map(str, KV_BITS))}, got {text!r}; "
        "to keep KV as the model computes it (16 bits for a bf16 model), leave --kv-bits out"
    )


def draft_tokens(text: str) -> int:
    """--num-draft-tokens: 1 to MOST_DRAFT_TOKENS."""
    try:
        value = positive(text)
    except argparse.ArgumentTypeError:
        value = 0  # refused below, with the range
    if not 1 <= value <= MOST_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(
            f"expected a whole number from 1 to {MOST_DRAFT_TOKENS}, got {text!r} (the "
            "proposed tokens a stream may have checked in one pass; past that many, a pass "
            "would attend as a prompt's does, not as a decoding step's)"
        )
    return value


count = _number(int, 0, "a whole number, 0 or more")
any_port = _port(0)  # 0: the system picks one
fixed_port = _port(1)
non_negative = _number(float, 0, "a number, 0 or more")
positive_float = _number(float, 1, "a number, 1 or more")


MOST_BURST_WINDOW_MS = 60_000


def burst_window(text: str) -> float:
    """--burst-window-ms: 0 up to a minute, which each request on an idle worker
    may wait before it starts (longer, no request would seem to start at all)."""
    what = f"a number of milliseconds from 0 to {MOST_BURST_WINDOW_MS}"
    window = _number(float, 0, what)(text)
    if window > MOST_BURST_WINDOW_MS:
        raise argparse.ArgumentTypeError(
            f"expected {what} (a request on an idle worker may wait this long before it "
            f"starts), got {text!r}"
        )
    return window


def host(text: str) -> str:
    """--host: a name or an address; an IPv6 address may come in brackets, as in a URL."""
    name = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not name.strip():
        raise argparse.ArgumentTypeError(
            f"expected a host name or address (such as 127.0.0.1), got {text!r}"
        )
    if ":" in name and not _ipv6(name):  # (a port, as in 127.0.0.1:50051)
        raise argparse.ArgumentTypeError(
            f"expected a host name or address without a port (give the port with --port), "
            f"got {text!r}"
        )
    return name


def _ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


MOST_TIMEOUT = 86_400


def timeout(text: str) -> float:
    """Seconds to wait, above 0 (a wait of none can never be met) and up to a day
    (gRPC's deadlines overflow not far past a few billion seconds)."""
    what = f"a number of seconds above 0, up to {MOST_TIMEOUT} (a day)"
    seconds = _number(float, 0, what)(text)
    if not 0 < seconds <= MOST_TIMEOUT:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return seconds


def served_name(text: str) -> str:
    """A name for the router (empty: the model's own, as when not given)."""
    if text and not text.strip():
        raise argparse.ArgumentTypeError(f"expected a name, got only spaces: {text!r}")
    if text != text.strip():  # (quoting gone wrong: clients would have to send them too)
        raise argparse.ArgumentTypeError(
            f"{text!r} has spaces at its ends, which clients would have to send too: "
            f"give {text.strip()!r}"
        )
    return text
