"""A scheduler step's cost does not grow with registered-but-idle adapters (O(active), never
O(registered)): counted, not timed, so a linear scan shows however fast the machine is.

Two engines serve the same requests; one has 10 idle adapters registered, the other 10,000. A loop
turn (`step`, the stats snapshot, the adapter-names check the process bridge makes) must run exactly
the same Python lines in both, and walk none of the registry's per-adapter maps: a scan in Python
would add lines, a scan in C (`frozenset(current)`, `sorted(versions)`) would add walks.
"""

from __future__ import annotations

import functools
import gc
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, make_core
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.lora.staging_pool import StagingPool

FEW, MANY = 10, 10_000
PARAMS = SamplingParams(max_new_tokens=64, ignore_eos=True)


class _WalkCounted:
    """Mixin for a dict-like registry map: counts every walk over it (iteration, keys/values/items,
    copies: C code that walks a dict subclass goes through these)."""

    walks: Counter[str]

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.walks["iter"] += 1
        return super().__iter__()  # type: ignore[misc]

    def keys(self):  # type: ignore[no-untyped-def]
        self.walks["keys"] += 1
        return super().keys()  # type: ignore[misc]

    def values(self):  # type: ignore[no-untyped-def]
        self.walks["values"] += 1
        return super().values()  # type: ignore[misc]

    def items(self):  # type: ignore[no-untyped-def]
        self.walks["items"] += 1
        return super().items()  # type: ignore[misc]

    def copy(self):  # type: ignore[no-untyped-def]
        self.walks["copy"] += 1
        return super().copy()  # type: ignore[misc]


class _WalkCountedDict(_WalkCounted, dict):
    pass


class _WalkCountedCounter(_WalkCounted, Counter):
    pass


def _count_walks(core: EngineCore) -> Counter[str]:
    """Swap the registry's per-adapter maps for counting copies of themselves."""
    registry = core.lora._registry
    walks: Counter[str] = Counter()
    for attr, kind in (("versions", _WalkCountedDict), ("current", _WalkCountedDict),
                       ("names", _WalkCountedCounter), ("_next_version", _WalkCountedDict)):
        counted = kind(getattr(registry, attr))
        counted.walks = walks
        setattr(registry, attr, counted)
    return walks


def _traced_lines(fn: Any) -> int:
    """Python lines executed by `fn()` on this thread (generator and comprehension bodies included).
    The garbage collector is run first and held off meanwhile: a collection inside `fn` runs other
    objects' finalizers on this thread (a Thread's removal from threading's WeakSet of threads, a few
    lines each), which would be counted as `fn`'s (seen once: 59 lines for a 50-line submit)."""
    lines = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    gc.collect()
    gc.disable()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
        gc.enable()
    return lines


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return write_tiny_adapter(root / "idle", seed=1, rank=2), write_tiny_adapter(root / "hot", seed=2, rank=8)


def _turn(core: EngineCore) -> None:
    """One scheduler loop turn, as CoreThread and the process bridge's outbox make it."""
    core.step()
    core.stats()
    core.adapter_names_changes()


def _measure(adapter_dirs: tuple[Path, Path], idle: int) -> tuple[list[int], Counter[str]]:
    idle_dir, hot_dir = adapter_dirs
    core = make_core(max_loras=2, max_registered_adapters=idle + 1)
    try:
        load_adapters(core, {f"idle-{i:05d}": idle_dir for i in range(idle)}, timeout=600)
        load_adapters(core, {"hot": hot_dir}, preload=True)  # in its slot
        assert core.lora.stats().references == 0 and not core.lora.has_pending_work()
        for i, adapter in enumerate(["hot", None, "hot"]):
            core.add_request(Request(f"r{i}", [256, 70 + i, 71, 72], PARAMS), adapter)
        for _ in range(2):  # prefill: the turns measured are all decode
            _turn(core)
        assert len(core.scheduler.running) == 3 and not core.scheduler.waiting
        walks = _count_walks(core)
        lines = [_traced_lines(lambda: _turn(core)) for _ in range(4)]
        return lines, walks
    finally:
        core.shutdown()


def test_a_step_does_the_same_work_with_10_or_10000_idle_adapters_registered(adapter_dirs):
    few_lines, few_walks = _measure(adapter_dirs, FEW)
    many_lines, many_walks = _measure(adapter_dirs, MANY)
    assert few_walks == many_walks == Counter(), f"a step walked the registry: {few_walks} / {many_walks}"
    assert min(few_lines) > 100, "the trace saw no step"
    assert many_lines == few_lines, f"lines per turn: {FEW} idle {few_lines}, {MANY} idle {many_lines}"


def _queued_pool(queued: int) -> tuple[StagingPool, threading.Event]:
    """A pool with all its places held (two workers from one source, two more from sources of their
    own) and `queued` more stagings from the first source waiting: a traced submit starts nothing."""
    release = threading.Event()
    pool = StagingPool(workers=2, timeout_s=600)
    for key in ["file://"] * (2 + queued) + ["s3://a", "s3://b"]:
        pool.submit(release.wait, key=key)
    return pool, release


def test_a_burst_of_queued_stagings_costs_no_more_per_submit_or_step():
    """The scheduler thread submits every staging (LoadAdapter) and calls `expire` every step: both
    once walked the whole queue, so registering 10,000 adapters at once took ~30 s of the
    scheduler thread (quadratic) and every step meanwhile walked what was queued."""
    costs = []
    for queued in (FEW, MANY):
        pool, release = _queued_pool(queued)
        try:
            costs.append(tuple(_traced_lines(functools.partial(pool.submit, release.wait, key=key))
                               for key in ("file://", "s3://c")) + (_traced_lines(pool.expire),))
        finally:
            release.set()
            pool.shutdown()
            for thread in threading.enumerate():  # the pool's threads end (their objects are freed) here
                if thread.name == "lora-host":
                    thread.join(10)
    assert costs[0] == costs[1], f"lines for submit, submit (another source), expire: {costs}"


def test_queued_stagings_start_in_arrival_order_within_and_across_sources():
    release, started = threading.Event(), []
    lock = threading.Lock()

    def task(name: str) -> None:
        with lock:
            started.append(name)
        release.wait(10)

    pool = StagingPool(workers=1, timeout_s=600)
    futures = [pool.submit(task, name, key=name[0]) for name in ("a1", "a2", "b1", "a3", "b2", "c1")]
    # a1 holds the one worker; b1 may start beyond it (its source has nothing running), up to 2.
    assert [f.running() for f in futures] == [True, False, True, False, False, False]
    release.set()
    for f in futures:
        f.result(timeout=10)
    pool.shutdown()
    assert started.index("a1") < started.index("a2") < started.index("a3")
    assert started.index("b1") < started.index("b2")
