"""Docs, comments, docstrings and test names speak of the project, not of how its work was planned:
no tracker numbers ("issue 36", "#41"), no "stop 46", "deliverable 2" or "another engineer's jobs".
Such words mean nothing to a reader of the code. Every text file under the project's own directories is scanned."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("docs", "inference_service", "adapter_cache", "harness", "tests", "bench", "scripts", "helm")
TOP_LEVEL = ("README.md", "Makefile", "Dockerfile", "pyproject.toml")
SUFFIXES = {".py", ".md", ".c", ".h", ".sh", ".toml", ".yaml", ".yml", ".tpl", ".txt", ".proto", ".cfg", ".ini"}

ORGANISATIONAL = re.compile(
    r"\bissues? #?\d+"  # issue 36, issues 13-16, issue #41
    r"|\bstops? \d+"  # stop 46, stops 45-46
    r"|\bsessions? \d+"
    r"|\bdeliverables?\b"
    r"|\bengineers?(?:'s)?\b"  # who did the work ("another engineer's jobs")
    r"|(?:^|[\s(\[,])#\d{1,4}\b(?![0-9a-fA-F])",  # #41 (a tracker reference; not a colour such as #1f77b4)
    re.IGNORECASE,
)
# Another project's issue is named with its project ("llm-d-router #2605", "vllm-project/vllm #123").
UPSTREAM = re.compile(r"[\w.]+[-/][\w./-]*\s*$")


def _files() -> list[Path]:
    files = [ROOT / name for name in TOP_LEVEL if (ROOT / name).is_file()]
    for directory in SCANNED:
        files += sorted(p for p in (ROOT / directory).rglob("*")
                        if p.is_file() and p.suffix in SUFFIXES and "_pb2" not in p.name)
    return files


def organisational_words(text: str) -> list[str]:
    return [f"{n}: {m.group(0).strip()}" for n, line in enumerate(text.splitlines(), 1)
            for m in ORGANISATIONAL.finditer(line)
            if not (m.group(0).strip().startswith("#") and UPSTREAM.search(line[:m.start() + 1]))]


def test_no_tracker_numbers_or_planning_words_in_the_project():
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in _files() if path != Path(__file__)
             for hit in organisational_words(path.read_text(errors="replace"))]
    assert found == []


@pytest.mark.parametrize("text", ["see issue 36", "Issues 13-16", "since stop 46", "stops 45-46",
                                  "issue #41", "(#41)", "fixed in #7", "deliverable 2", "session 3",
                                  "another engineer's jobs"])
def test_the_scan_finds_planning_words(text):
    assert organisational_words(text)


@pytest.mark.parametrize("text", ["color: #1f77b4", "fill #ffcc00", "HTTP 404", "stop strings", "stop_token_ids",
                                  "stop at 16 tokens", "a tissue 3", "url#frag", "x[#]", "the sessions",
                                  "--rounds 5", "round-robin", "a list item 3",
                                  "llm-d-router #2605", "vllm-project/vllm #123"])
def test_the_scan_leaves_ordinary_words_alone(text):
    assert organisational_words(text) == []
