"""CPU burners outside the test's process tree: the machine's other tenants, made for real."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def foreign_load(processes: int) -> Iterator[list[int]]:
    """`processes` CPU-bound processes outside this process's tree (started by a shell that exits at
    once, so they are reparented away from us). Yields their pids; they are killed on exit."""
    spin = f"{shlex.quote(sys.executable)} -c 'while True: pass'"
    launcher = " ".join(f"{spin} > /dev/null 2>&1 & echo $!;" for _ in range(processes))
    out = subprocess.run(["sh", "-c", launcher], capture_output=True, text=True, check=True, timeout=30).stdout
    pids = [int(line) for line in out.split()]
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
