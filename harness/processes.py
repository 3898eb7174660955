"""Processes as /proc shows them, for tests that watch a server's children and sessions.

Any process read here may exit between listing and reading: opening its entry then fails with
FileNotFoundError, and reading one it already opened with ProcessLookupError (ESRCH). Both mean
"gone", so every reader here takes an OSError as that.
"""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...), or None
    when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    """The direct children of a live process (none once it is gone)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def command_line(pid: int) -> bytes:
    """The process's NUL-separated command line (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def children_running(parent: int, marker: bytes) -> list[int]:
    """The live children of `parent` whose command line contains `marker`."""
    return [pid for pid in _pids()
            if (fields := _stat_fields(pid)) is not None and fields[0] != "Z" and int(fields[1]) == parent
            and marker in command_line(pid)]


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid`."""
    return [pid for pid in _pids()
            if (fields := _stat_fields(pid)) is not None and fields[0] != "Z" and int(fields[3]) == sid]
