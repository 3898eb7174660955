"""Waiting for an event in a test without making the host's speed a verdict.

    wait_until(lambda: server.value("loraplex_requests_running") == 0, "the request to finish")

A test waits for something the server must do (a health status to flip, a process to exit, a line
to be logged) and asserts that it happened, and in which order; how soon it happened depends on the
machine's load and is no verdict. The deadline here only stops a hang: HANG_S is far beyond any
event's time on a loaded 2-core host (seconds) and well inside pytest's per-test timeout, so a test
that waits for something that never comes fails with `what` instead of being killed without a
message. Where a deadline is part of the behaviour (a drain delay, a probe's failure budget), the test
says so and passes its own `timeout`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HANG_S = 60.0
POLL_S = 0.05


def wait_until(cond: Callable[[], object], what: str | Callable[[], str], timeout: float = HANG_S,
               poll_s: float = POLL_S) -> float:
    """Polls `cond` until it is true; returns the seconds waited. Fails naming `what` (a callable
    gives the state at the failure) after `timeout` seconds."""
    started = time.monotonic()
    deadline = started + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s: {what() if callable(what) else what}")
        time.sleep(poll_s)
    return time.monotonic() - started
