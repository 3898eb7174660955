"""The isolation harness's own checks can fail, each on a real fault:

- a victim beside no attack passes, on the base model and on a resident adapter;
- it watches the whole attack: the victim streams, run after run, until after an attack that lasts
  several of its runs has ended;
- a real stall (the front end stopped with SIGSTOP for longer than the victim's whole solo run)
  fails on time, not on tokens;
- a real sustained 1.5x slowdown (the server's whole process group stopped for a third of the wall
  time) fails on time;
- a victim on an adapter sees an attack through the slots: with one slot, another tenant's long
  request on another adapter takes the slot from between the victim's runs;
- the check itself: a victim that stopped streaming before the attack ended, or paused between runs,
  fails;
- a victim slowed by other processes on the machine (real CPU burners outside this test's process
  tree) fails as MachineBusy, and any other timing failure as VictimSlow; pytest reruns both (the
  host's CPUs change speed under the guest: harness/host_speed.py) and nothing else (the faults above
  fail either way: both are AssertionErrors, and a real fault fails its reruns too).
"""

from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cpu_accounting import foreign_load
from harness.inference_server import ROOT, InferenceServer, start_inference_server
from harness.isolation import (
    FRESH_RUNS,
    MIN_RUNS,
    SLACK_S,
    SLOWDOWN_LIMIT,
    SUSTAINED_LIMIT,
    WARM_RUNS,
    Contention,
    MachineBusy,
    VictimResult,
    VictimSlow,
    _fail,
    check_victim,
    resident_adapter,
    slowdown_during,
    slowed,
    solo_run,
    victim_beside,
)
from harness.tools import skip_or_fail
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

VICTIM_TOKENS = 384
LONG_TOKENS = 1000  # nearly builtin:tiny's whole 1024-token context
ACHIEVED = 1.4  # the injected slowdown must reach the victim at least this much, above SUSTAINED_LIMIT
assert ACHIEVED > SUSTAINED_LIMIT


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("iso-harness-adapters")
    write_peft_adapter(root / "victim", rank=8, seed=71)
    write_peft_adapter(root / "other", rank=8, seed=72)
    return root


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory) -> Iterator[InferenceServer]:
    s = start_inference_server(["--max-new-tokens-limit", "1024", "--max-loras", "1",
                                "--adapter-source-allow", adapters.as_uri()],
                               log_dir=tmp_path_factory.mktemp("iso-harness"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def on_adapter(server, adapters) -> VictimResult:
    resident_adapter(server, "victim", (adapters / "victim").as_uri())
    return solo_run(server, adapter="victim", max_new_tokens=VICTIM_TOKENS)


def test_a_victim_beside_no_attack_passes(server):
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    with victim_beside(server, base):
        pass


def test_a_victim_on_a_resident_adapter_beside_no_attack_passes(server, on_adapter):
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    assert on_adapter.tokens != base.tokens  # the adapter is really applied
    with victim_beside(server, on_adapter):
        pass


def test_the_victim_streams_until_after_a_long_attack_ends(server):
    """Coverage only (no time limits here: a 10 s window on a shared machine is not what is tested)."""
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    length = 3 * base.median * MIN_RUNS  # far longer than one run and than MIN_RUNS runs
    with victim_beside(server, base, slowdown=math.inf, sustained=math.inf) as runs:
        start = time.monotonic()
        time.sleep(length)
        end = time.monotonic()
    assert runs[0]["start"] < start and runs[-1]["end"] > end
    assert len(runs) > MIN_RUNS


def test_a_victim_stalled_by_the_server_fails_on_its_time(server):
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    with pytest.raises(AssertionError, match="beside the attack"), victim_beside(server, base) as runs:
        # The whole budget, on top of the victim's own time: the budget counts from the slowest run
        # alone, including those just made (on a busy machine they can be slower than solo_run's).
        stall = SLOWDOWN_LIMIT * max([base.seconds] + [r["seconds"] for r in runs[WARM_RUNS:]]) + SLACK_S
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(stall)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)


def test_a_sustained_1_5x_slowdown_fails(server):
    """The server's processes stopped a third of the time: each victim run takes 1.5x as long, and
    the check fails on its average. On a saturated machine the victim client, not the server, can be
    what paces the victim (the server runs ahead, coalescing tokens), and the stops then reach it
    only in part: at load average 14 on 2 cores they made it 1.25x slower. The test needs the
    slowdown to have arrived (at least ACHIEVED x) and the runs alone before it to have been steadier
    than that (the check's noise bound): a failure under CI if not, a skip elsewhere."""
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    failure = None
    try:
        with victim_beside(server, base) as runs:
            start = time.monotonic()
            with slowed(server, 1 / 3) as stopped:
                time.sleep(1.5 * base.median * (MIN_RUNS + 1))  # every timed run under the slowdown
            end = time.monotonic()
    except AssertionError as e:
        failure = str(e)
    assert 0.30 < stopped[0] < 0.37, stopped  # the server was stopped for the third intended
    if failure is not None and "on average over" in failure:
        return
    mean, reference, _ = slowdown_during(base, runs, start, end)
    if mean < ACHIEVED * reference:
        skip_or_fail(f"the stops slowed the victim only {mean / reference:.2f}x (a saturated machine)")
    noise = max(r["seconds"] for r in runs[WARM_RUNS:WARM_RUNS + FRESH_RUNS])
    if noise >= mean:
        skip_or_fail(f"a run alone before the stops was {noise / reference:.2f}x the median (a busy machine)")
    raise AssertionError(f"a {mean / reference:.2f}x slowdown passed the check ({failure})")


def test_a_victim_on_an_adapter_sees_another_tenant_take_its_slot(server, adapters, on_adapter):
    """One slot: a long request on another adapter waits for the slot, then (aged past the
    victim's next run) takes it from between two victim runs. A victim on the base model would
    need no slot and not see it."""
    with InferenceClient(server.address) as c:
        c.load_adapter("other", (adapters / "other").as_uri(), timeout=60)  # registered, not in the slot
    errors: list[BaseException] = []

    def attack() -> None:
        try:
            with InferenceClient(server.address) as c:
                list(c.generate("another tenant", adapter="other", max_new_tokens=LONG_TOKENS, ignore_eos=True,
                                timeout=120))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with pytest.raises(AssertionError, match="beside the attack"), victim_beside(server, on_adapter):
        thread = threading.Thread(target=attack)
        thread.start()
        thread.join(120)
    assert not errors, errors


def test_a_victim_slowed_by_other_processes_is_a_busy_machine_not_a_verdict(server):
    """CPU burners, three per core, outside this test's process tree, while the victim makes its
    timed runs: the check's accounting sees them as other processes' CPU, so a timing failure there
    is a MachineBusy (rerun by pytest), not a verdict on the attack, which here is nothing at all.
    Whether the burners slow the victim past the bound varies (1.25x to 1.48x measured), so the
    classification is checked on the runs themselves, not through a failure that may not come."""
    base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
    with victim_beside(server, base, slowdown=math.inf, sustained=math.inf, check_clean=False) as runs:
        start = time.monotonic()
        with foreign_load(3 * (os.cpu_count() or 2)):
            time.sleep(2 * base.median * (MIN_RUNS + 1))
    first = next(i for i, r in enumerate(runs) if r["end"] > start)
    timed = sum(r["end"] > start for r in runs)
    contention = Contention.of(runs, start, min(timed, MIN_RUNS), timed_from=first)
    assert contention is not None and contention.machine_busy, contention
    with pytest.raises(MachineBusy, match="other processes used"):
        _fail("a slow victim", contention)


def test_timing_failures_and_only_those_are_rerun():
    """A slow victim with no other process on the machine is a VictimSlow; pytest's --only-rerun
    (pyproject.toml) matches it and MachineBusy, and not a failure of tokens, codes or leaks."""
    with pytest.raises(VictimSlow, match="a slow victim"):
        _fail("a slow victim", Contention(foreign_alone=0.0, foreign_timed=0.0, waiting_alone=0.3, waiting_timed=0.3))
    with open(ROOT / "pyproject.toml", "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"]
    pattern = re.search(r"--only-rerun (\S+)", addopts)
    assert pattern is not None, addopts
    for error, rerun in ((VictimSlow("slow"), True), (MachineBusy("busy"), True),
                         (AssertionError("the victim's tokens changed beside the attack"), False)):
        assert bool(re.search(pattern.group(1), f"{type(error).__name__}: {error}")) == rerun, error


def _run(start: float, seconds: float, tokens: list[int]) -> dict:
    return {"tokens": tokens, "seconds": seconds, "start": start, "end": start + seconds,
            "finish": "FINISH_REASON_LENGTH"}


def test_the_check_fails_a_victim_that_stopped_before_the_attack_ended():
    base = VictimResult([1, 2], 0.5, None, 2, "p", 0.4)
    runs = [_run(i * 0.4, 0.4, [1, 2]) for i in range(MIN_RUNS)]
    check_victim(base, runs, 0.1, runs[-1]["end"] - 0.01)  # covered: passes
    with pytest.raises(AssertionError, match="stopped streaming"):
        check_victim(base, runs, 0.1, runs[-1]["end"] + 0.01)
    paused = runs[:2] + [_run(runs[1]["end"] + 1.0, 0.4, [1, 2])]
    with pytest.raises(AssertionError, match="paused"):
        check_victim(base, paused, 0.1, 0.2, min_runs=3)
