"""Every file that says what an exit code means says the same: the table in
docs/operations.md, the supervisors' table in deploy/README.md, the other docs, and the
comments of the recipes and the image. A
supervisor is designed from these claims, so two that disagree are a bug."""

from __future__ import annotations

import re

import pytest

from docs import DEPLOY_README, DOCS, OPERATIONS, README, REPO, section, table

# What ends the worker with which code, by a word each claim uses. The codes are the
# worker's own, as the tests that end it each way check: test_exit.py (signals, a taken
# port, bad flags), test_lifecycle.py (a model that cannot load, an engine failure, no model
# directory), test_model_source.py (a download), test_package.py (no MLX backend, 2).
CAUSES = {
    "SIGTERM": 0,
    "loaded": 1,
    "download": 1,
    "engine": 1,
    "port": 1,
    "backend": 2,
    "flags": 2,
    "--model": 2,
}
# The docs, the image, and every file under deploy/ (its README among them).
FILES = [
    README,
    *sorted(DOCS.glob("*.md")),
    REPO / "Dockerfile",
    *sorted((REPO / "deploy").rglob("*.*")),
]
# "exit 1 (why, why) ...", as the recipes' comments put it.
PARENTHESIZED = re.compile(r"\bexit (\d) \(([^)]*)\)", re.IGNORECASE)


def exit_tables() -> dict[str, dict[int, str]]:
    """The two tables of exit codes: code -> the cell that says when."""
    docs = section(OPERATIONS, "## Health, shutdown and exit codes")
    docs = docs[docs.index("| exit code |") :]
    deploy = section(DEPLOY_README, "## What the supervisor does with each exit")
    return {
        name: {int(row[0]): row[1] for row in table(text)}
        for name, text in (("docs/operations.md", docs), ("deploy/README.md", deploy))
    }


def claims() -> list[tuple[str, int, str]]:
    """(where, exit code, what it says causes it) for every claim in every file."""
    found = [
        (name, code, when) for name, rows in exit_tables().items() for code, when in rows.items()
    ]
    for path in FILES:
        # Comments span lines: read them as the prose they are.
        text = " ".join(
            re.sub(r"^\s*(#|<!--)\s?", "", line) for line in path.read_text().split("\n")
        )
        found += [(path.name, int(code), why) for code, why in PARENTHESIZED.findall(text)]
    return found


def test_the_tables_list_the_same_codes_and_every_cause():
    tables = exit_tables()
    assert {name: sorted(rows) for name, rows in tables.items()} == {
        name: [0, 1, 2] for name in tables
    }
    for name, rows in tables.items():
        said = " ".join(rows.values())
        assert [cause for cause in CAUSES if cause not in said] == [], name


@pytest.mark.parametrize("cause", CAUSES)
def test_every_claim_gives_a_cause_its_code(cause):
    wrong = [
        (where, code, why)
        for where, code, why in claims()
        if cause in why and code != CAUSES[cause]
    ]
    assert wrong == []


def test_the_recipes_comments_make_claims_to_check():
    # The pattern above must keep finding them: a test that reads nothing proves nothing.
    assert {where for where, _, _ in claims()} >= {
        "docs/operations.md", "deploy/README.md", "smg-mlx.service", "com.example.smg-mlx.plist",
    }  # fmt: skip


# How the contradicted claim read: an engine failure that leaves the worker up.
STAYS_UP = re.compile(r"does not exit|stays? up|waits? to be restarted|keeps? running")


def test_no_file_says_an_engine_failure_leaves_the_worker_up():
    """The worker exits 1 when its engine fails (test_lifecycle.py)."""
    for path in FILES:
        for clause in re.split(r"[.;:|]\s", " ".join(path.read_text().split())):
            if re.search(r"engine (has )?fail", clause):
                assert not STAYS_UP.search(clause), (path.name, clause)
