"""External tools the tests use (promtool, prometheus, helm, buf, grpcurl, openssl), and the one
CI predicate of the suite.

`in_ci()` is the only place that reads the `CI` variable: every test and harness module that must
not skip under CI asks it (or calls `skip_or_fail`), so `CI=1`, `CI=yes` and `CI=true` mean the
same everywhere (tests/test_ci_predicate.py holds that no other module reads `CI`).

`make test` installs the tools (scripts/install_test_tools.sh), so under CI a missing tool is a
failure, never a silent skip; on a developer's machine it skips with the way to install it. Tests
say what they need with `@pytest.mark.needs_tool(name)` (or `needs_tool(name, path)` for a tool
installed outside PATH); tests/conftest.py applies the rule before each such test runs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest

INSTALL_HINT = "scripts/install_test_tools.sh installs it; make test runs that"


def in_ci() -> bool:
    """CI set to anything but empty, 0, false or no (CI services set "true"; others "1" or "yes")."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """A precondition this machine lacks: a failure under CI (where everything must run), a skip
    saying why elsewhere."""
    if in_ci():
        pytest.fail(f"{reason} (under CI this must run, not skip)", pytrace=False)
    pytest.skip(reason)


def find_tool(name: str, path: Path | None = None) -> str | None:
    if path is not None and path.exists():
        return str(path)
    return shutil.which(name)


def require_tool(name: str, path: Path | None = None) -> str:
    """The tool's executable; when it is missing, fail under CI and skip elsewhere."""
    exe = find_tool(name, path)
    if exe is None:
        where = f" (looked in PATH{f' and {path}' if path else ''})"
        skip_or_fail(f"{name} not installed{where}: {INSTALL_HINT}")
    return exe


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_tool"):
        require_tool(*mark.args)
