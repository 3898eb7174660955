"""External tools the tests use (promtool, prometheus, helm, buf, grpcurl, openssl).

`make test` installs them (scripts/install_test_tools.sh), so under CI (CI set) a missing tool is a
failure, never a silent skip; on a developer's machine it skips with the way to install it. Tests
say what they need with `@pytest.mark.needs_tool(name)` (or `needs_tool(name, path)` for a tool
installed outside PATH); tests/conftest.py applies the rule before each such test runs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

INSTALL_HINT = "scripts/install_test_tools.sh installs it; make test runs that"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def find_tool(name: str, path: Path | None = None) -> str | None:
    if path is not None and path.exists():
        return str(path)
    return shutil.which(name)


def require_tool(name: str, path: Path | None = None) -> str:
    """The tool's executable; when it is missing, fail under CI and skip elsewhere."""
    exe = find_tool(name, path)
    if exe is None:
        where = f" (looked in PATH{f' and {path}' if path else ''})"
        if in_ci():
            pytest.fail(f"{name} is missing under CI{where}: {INSTALL_HINT}", pytrace=False)
        pytest.skip(f"{name} not installed{where}: {INSTALL_HINT}")
    return exe


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs_tool"):
        require_tool(*mark.args)
