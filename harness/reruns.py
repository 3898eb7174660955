"""Which attempt of a test this is: pyproject's --reruns reruns a failed victim timing check
(harness.isolation.VictimSlow, MachineBusy) against the module's fixtures as the failed attempt left
them (its names registered, its origins' counters advanced, its schemas cached), so a test whose
attack would otherwise be answered from that state makes its inputs new on a rerun."""

from __future__ import annotations

from collections import Counter

import pytest

_RUNS: Counter[str] = Counter()


@pytest.fixture
def attempt(request: pytest.FixtureRequest) -> int:
    """0 on a test's first run, n on its n-th rerun in this session."""
    _RUNS[request.node.nodeid] += 1
    return _RUNS[request.node.nodeid] - 1
