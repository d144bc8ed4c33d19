"""The lookup replay: real edits decoded with the worker's proposer."""

from __future__ import annotations

import subprocess

from bench.lookup_replay import run


def test_an_edit_is_found_in_its_prompt_and_a_rewrite_in_other_streams(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "a@b.c")
    git("config", "user.name", "a")
    lines = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(60)]
    source = tmp_path / "code.py"
    for version in range(4):  # each commit changes one function
        lines[10 * version + 5] = f"def g{version}(y):\n    return y - {version}\n"
        source.write_text("".join(lines))
        git("add", "code.py")
        git("commit", "-q", "-m", f"change {version}")
    rows = {(r["workload"], r["shared"]): r for r in run(tmp_path, ".py", 10, 8, 300)}
    per_pass = {key: r["tokens"] / r["passes"] for key, r in rows.items()}
    assert rows["edit", False]["requests"] == 3  # the first commit added the file
    # Most of an edit is in its prompt: several tokens a pass.
    assert per_pass["edit", False] > 3
    # A rewrite's prompt holds only the message: its own tokens repeat a little, the
    # earlier versions in other streams' tokens (their last 512 each) more.
    assert per_pass["rewrite", True] > 1.15 * per_pass["rewrite", False]
    assert all(r["kept"] <= r["proposed"] for r in rows.values())
