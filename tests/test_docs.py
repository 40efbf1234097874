"""Every relative link in README.md and docs/*.md points at a file of the repository, and a `#section` of a Markdown
file at one of its headings (GitHub's anchors)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    with open(path, encoding="utf-8") as f:
        text = FENCE.sub("", f.read())
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def links(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return LINK.findall(FENCE.sub("", f.read()))


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(file):
            bad.append(f"{target}: no such file")
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            bad.append(f"{target}: no heading #{anchor}")
    assert not bad, f"{page}: " + "; ".join(bad)


def test_readme_stays_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 200
