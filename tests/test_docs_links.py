"""The docs' cross-references resolve: every relative markdown link names a file that exists, and
every `page.md, "Section"` reference, in the docs or in the code, names a heading of that page (a
heading starting with the quoted words), so moving a section without its references fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Code that points a reader at a section of the docs is held to the same rule.
CODE = sorted(p for d in ("inference_service", "adapter_cache", "harness", "tests", "bench", "scripts")
              for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
SECTION = re.compile(r"(?:docs/)?([a-z_]+\.md),\s+\"([^\"]+)\"", re.DOTALL)


def _page(name: str, linking: Path) -> Path:
    for base in (linking.parent, ROOT / "docs", ROOT):
        if (base / name).is_file():
            return base / name
    return linking.parent / name


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]


def test_relative_links_name_files_that_exist():
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in PAGES
              for target in LINK.findall(page.read_text()) if "://" not in target
              and not _page(target, page).is_file()]
    assert broken == []


def test_section_references_name_headings_of_their_page():
    broken = []
    for page in [*PAGES, *(p for p in CODE if p != Path(__file__))]:
        for name, section in SECTION.findall(page.read_text()):
            target = _page(name, page)
            words = " ".join(section.replace("#", " ").split())  # a reference may wrap over comment lines
            if not target.is_file() or not any(h.startswith(words) for h in _headings(target)):
                broken.append(f"{page.relative_to(ROOT)} -> {name}, \"{words}\"")
    assert broken == []
