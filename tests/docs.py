"""The docs' commands and tables, read as a reader sees them, for tests that run the
commands as written and check the tables against each other."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

from helpers import wait_until

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# The reference pages the README links to, by what a reader looks for there.
DOCS = REPO / "docs"
CONFIGURATION = DOCS / "configuration.md"
OPERATIONS = DOCS / "operations.md"
SCALING = DOCS / "scaling.md"
DEPLOY_README = REPO / "deploy" / "README.md"
# A shell as a reader's is before they activate anything: the virtual environment is not
# on PATH, so a command that needs it must name it.
BARE_PATH = "/usr/bin:/bin"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def section(path: Path, heading: str) -> str:
    """The text under the markdown heading `heading` ("## Quick start"), up to the next
    heading of the same or a higher level."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n") + 1
    level = heading.split()[0]
    following = re.compile(rf"^#{{1,{len(level)}}} ", re.MULTILINE)
    end = following.search(text, start + len(heading))
    return text[start : end.start() if end else len(text)]


def code_blocks(text: str, language: str = "sh") -> list[str]:
    """The fenced code blocks of `text` in `language`, in order."""
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def commands(block: str) -> list[str]:
    """The shell commands of a code block, one string each: a command goes on over
    lines that end in a backslash or sit inside an open quote; comment lines are dropped."""
    found, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open
            continue
        found.append(pending.strip())
        pending = ""
    assert not pending, f"an unfinished command: {pending!r}"
    return found


def table(text: str) -> list[list[str]]:
    """The rows (cells stripped) of the first markdown table in `text`, header row dropped."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def shell(command: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `command` with bash in the repository's root, as a reader would type it."""
    return subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def background(command: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `command` with bash in the repository's root, in a process group of its own
    (so that `stop` reaches what it starts: make's worker, mlx.launch's ranks). Its stdin
    is a pipe nothing is written to, as a terminal nobody types in: at end of file instead,
    mlx.launch spins forwarding it, and Ctrl-C can stop it holding a lock its threads wait
    for, so that it never exits."""
    return subprocess.Popen(
        ["bash", "-c", command], cwd=REPO, env=env, stdin=subprocess.PIPE,
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> bool:
    """Signal a `background` command's whole group, as Ctrl-C in its terminal would, and
    kill what is left of it after 30 s. Returns whether the whole group had ended."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(30)
    ended = process.poll() is not None and wait_until(lambda: _gone(process.pid), 5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    process.stdin.close()
    return ended


def _gone(group: int) -> bool:
    """No process of the group is left (its first one reaped already)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False
