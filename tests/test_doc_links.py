"""Every link between the docs leads somewhere: the README sends a reader to the pages under
docs/, and the pages to each other's sections, so a file or a heading that moves must take
its links with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs import DEPLOY_README, DOCS, README, REPO

PAGES = [README, *sorted(DOCS.glob("*.md")), DEPLOY_README, REPO / "BENCHMARKS.md"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (not of comment lines in code blocks)."""
    text = _FENCE.sub("", path.read_text())
    return {anchor(heading) for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def test_there_are_pages_to_check():
    assert {"configuration.md", "serving.md", "operations.md", "scaling.md"} <= {
        page.name for page in PAGES
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, fragment = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        if not path.exists():
            broken.append((target, "no such file"))
        elif fragment and (path.is_dir() or fragment not in anchors(path)):
            broken.append((target, "no such heading"))
    assert broken == []
