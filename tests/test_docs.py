"""The README and the documents it points to stay connected: every relative link names a file
that exists, and every link into a page names one of its headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "schedules" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(page: Path):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#its-part) [gone](missing.md) [wrong](other.md#nowhere) "
        "[here](#page) [web](https://example.com)\n\n```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(page) == ["missing.md: no such file", "other.md#nowhere: no such heading"]
