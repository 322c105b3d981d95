"""Every relative link in the README and docs/ points at a file that exists (anchors are not checked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"
