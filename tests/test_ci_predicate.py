"""One CI predicate for the whole suite (harness/tools.py): what it counts as CI, what a missing
precondition does under it, and that no other test or harness module reads `CI` its own way (a
module checking `CI == "true"` skipped silently under `CI=1`, which the tools counted as CI)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.tools import in_ci, skip_or_fail

REPO = Path(__file__).resolve().parents[1]
# os.environ.get("CI"...), os.environ["CI"], os.getenv("CI"...), "CI" in os.environ
READS_CI = re.compile(r"""(environ(\.get)?\s*[(\[]\s*|getenv\s*\(\s*)["']CI["']"""
                      r"""|["']CI["']\s+(not\s+)?in\s+os\.environ""")


@pytest.mark.parametrize("value, ci", [
    (None, False), ("", False), ("0", False), ("false", False), ("False", False), ("no", False), (" ", False),
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
])
def test_what_counts_as_ci(monkeypatch: pytest.MonkeyPatch, value: str | None, ci: bool) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert in_ci() is ci


@pytest.mark.parametrize("value", ["true", "1", "yes"])
def test_a_missing_precondition_fails_under_ci(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="no mount namespaces here"):
        skip_or_fail("no mount namespaces here")


def test_a_missing_precondition_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no mount namespaces here"):
        skip_or_fail("no mount namespaces here")


def test_the_pattern_finds_every_spelling() -> None:
    for line in ('os.environ.get("CI") == "true"', "os.environ['CI']", 'os.getenv("CI", "")',
                 'environ.get( "CI" )', '"CI" in os.environ'):
        assert READS_CI.search(line), line
    assert not READS_CI.search('os.environ.get("CIRCLE")') and not READS_CI.search('environ.get("LORAPLEX_CI_X")')


def test_no_module_reads_ci_but_the_predicate() -> None:
    readers = sorted(str(p.relative_to(REPO)) for d in ("tests", "harness", "bench") for p in (REPO / d).rglob("*.py")
                     if p.name != "test_ci_predicate.py" and READS_CI.search(p.read_text(errors="replace")))
    assert readers == ["harness/tools.py"], f"read CI through harness.tools.in_ci / skip_or_fail instead: {readers}"
