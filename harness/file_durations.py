"""Where the suite's time goes, and a budget per slow file (tests/budget.toml).

A pytest plugin: it sums each test file's setup, call and teardown durations, prints the slowest
SLOWEST files with their seconds at the end of the run, and names every file listed in
tests/budget.toml that took longer than its budget. Under CI (harness/tools.py's predicate, as for
missing tools) that fails the run, so a file's growth is seen in the change that caused it;
elsewhere (a developer's machine shared with other work) it is reported only. A session-scoped
fixture's setup counts for the file that first uses it. A file run in part (`-k`, `-x`) only takes
less, so its budget still holds.
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from harness.tools import in_ci

SLOWEST = 15
BUDGETS = Path(__file__).resolve().parent.parent / "tests" / "budget.toml"

_seconds: defaultdict[str, float] = defaultdict(float)


def budgets(path: Path = BUDGETS) -> dict[str, float]:
    """Each budgeted file's seconds, by its path from the repository root."""
    with path.open("rb") as f:
        return {name: float(seconds) for name, seconds in tomllib.load(f)["files"].items()}


def over_budget(seconds: dict[str, float], allowed: dict[str, float]) -> list[str]:
    """One line per file that took longer than its budget."""
    return [f"{name}: {seconds[name]:.1f} s, budget {allowed[name]:g} s"
            for name in sorted(allowed) if seconds.get(name, 0.0) > allowed[name]]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if not _seconds:
        return
    terminalreporter.section(f"the {SLOWEST} slowest test files (seconds, setup to teardown)")
    for name, seconds in sorted(_seconds.items(), key=lambda item: -item[1])[:SLOWEST]:
        terminalreporter.write_line(f"{seconds:8.1f}  {name}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f}  all {len(_seconds)} files")
    verdict = "fails the run under CI" if in_ci() else "reported only: CI is not set"
    for line in over_budget(_seconds, budgets()):
        terminalreporter.write_line(f"over its budget (tests/budget.toml; {verdict}): {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.OK and in_ci() and over_budget(_seconds, budgets()):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
