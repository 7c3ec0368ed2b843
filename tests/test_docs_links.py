"""Every relative link of README.md and docs/*.md reaches a file of the repository, and its
``#anchor`` a heading of that page (GitHub's rule for heading anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```$", flags=re.DOTALL | re.MULTILINE)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            slug = anchor(line.lstrip("#"))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def test_anchor_follows_githubs_rule() -> None:
    assert anchor(" `ShellConfig` (your own loop, Lightning, the HF Trainer)") == (
        "shellconfig-your-own-loop-lightning-the-hf-trainer"
    )
    assert anchor(" Warm restarts with `--compile`") == "warm-restarts-with---compile"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (
            fragment and file.suffix == ".md" and fragment not in anchors(file)
        ):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: {broken}"
