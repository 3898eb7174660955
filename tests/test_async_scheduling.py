"""Async scheduling (`--async-scheduling on`): each step runs on the device worker while the
scheduler plans the next one (inference_service/engine/core.py).

- It serves exactly what the synchronous engine serves: greedy and seeded sampling, adapters
  swapping through fewer slots, stop tokens, stop strings, penalties and min_tokens (which read
  the token history a step behind), logprobs, chunked prefill and preemption.
- The overlap is real: `step()` returns while the step it launched is still running.
- A request cancelled while its step runs gets no token after the cancel, and its KV blocks and
  adapter reference are released exactly once; a request whose previous step sampled no token
  (non-finite logits) ends alone even though its next step was already launched.
- A forward pass that fails for one request on the device worker ends only that request.
- The next step is planned late in the running one, so a request that arrives meanwhile joins it.

The faults are patches of the model runner's `execute` (a kernel bug cannot be caused for real);
the real-input fault (an overflowing adapter) is tests/test_isolation_engine.py's, and
tests/test_scheduler.py runs its preemption and abort-storm tests in both modes.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
import torch

from adapter_cache.errors import LoraplexError
from harness.adapters import write_tiny_adapter
from harness.engine_helpers import generate, load_adapters, run_to_completion
from inference_service.engine import core as engine_core
from inference_service.engine import model_runner
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.in_process import Engine
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.engine.sampling import NON_FINITE
from inference_service.models.loader import builtin_tiny_config

STEP_S = 0.08  # the patched device step of the late-planning test
LATE = engine_core.PLAN_AT_FRACTION  # before any test sets it to 0


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {f"a{i}": write_tiny_adapter(root / f"a{i}", rank=4 + 2 * i, seed=40 + i) for i in range(3)}


def _core(mode: str, adapters: dict[str, Path], **kwargs: object) -> EngineCore:
    config = dict(model="builtin:tiny", max_loras=2, max_lora_rank=8, kv_cache_bytes=4 << 20)
    config.update(kwargs)
    core = EngineCore(EngineConfig(device="cpu", async_scheduling=mode, **config))  # type: ignore[arg-type]
    load_adapters(core, adapters)
    return core


def _serve(core: EngineCore, requests: dict[str, tuple[list[int], str | None, SamplingParams]]) -> dict:
    for rid, (prompt, adapter, params) in requests.items():
        core.add_request(Request(rid, prompt, params), adapter)
    outputs = run_to_completion(core)
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0 and not core.step_in_flight
    return {rid: ([t for o in outs for t in o.new_token_ids], "".join(o.text or "" for o in outs),
                  outs[-1].finish_reason, [lp for o in outs for lp in (o.logprobs or [])])
            for rid, outs in outputs.items()}


def _prompt(i: int, length: int = 12) -> list[int]:
    return [256] + [(i * 37 + j * 11) % 90 + 33 for j in range(length)]


def _requests(reference_tokens: dict[str, list[int]], stop_text: str) -> dict:
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    return {
        "base": (_prompt(0), None, greedy),
        "a0": (_prompt(1), "a0", greedy),
        "a1": (_prompt(2), "a1", SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=3)),
        "a2-seeded": (_prompt(3), "a2", SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.9,
                                                       top_p=0.9, seed=7)),
        "stop-token": (_prompt(4), "a0", SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                        stop_token_ids=(reference_tokens["stop-token"][6],))),
        "stop-string": (_prompt(5), None, SamplingParams(max_new_tokens=24, ignore_eos=True, stop=(stop_text,))),
        "penalties": (_prompt(6), "a1", SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                                                       frequency_penalty=0.6, presence_penalty=0.4, min_tokens=5,
                                                       stop_token_ids=(reference_tokens["penalties"][2],))),
        "long-prompt": (_prompt(7, 70), "a2", greedy),
        "eos": (_prompt(8), None, SamplingParams(max_new_tokens=24)),
    }


@pytest.mark.parametrize("tight_kv", [False, True], ids=["roomy-kv", "preempting-kv"])
def test_async_scheduling_serves_exactly_what_the_synchronous_engine_serves(adapters, tight_kv):
    kwargs: dict[str, object] = {"max_num_batched_tokens": 32}  # the long prompt prefills in chunks
    if tight_kv:
        kwargs["kv_cache_bytes"] = 8 * kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    plain = SamplingParams(max_new_tokens=24, ignore_eos=True)
    probe = _serve(_core("off", adapters), {"stop-token": (_prompt(4), "a0", plain),
                                            "penalties": (_prompt(6), "a1", plain),
                                            "stop-string": (_prompt(5), None, plain)})
    stop_text = probe["stop-string"][1][5:7]
    reference_tokens = {rid: r[0] for rid, r in probe.items()}
    results, preemptions = {}, {}
    for mode in ("off", "on"):
        core = _core(mode, adapters, **kwargs)
        results[mode] = _serve(core, _requests(reference_tokens, stop_text))
        preemptions[mode] = core.scheduler.num_preemptions
        core.shutdown()
    # Logprob values to float tolerance: a batch may differ by a row (a request that finished in the
    # step before still has its launched row), which moves the matmuls' last bits; tokens are exact.
    for rid, (tokens, text, reason, logprobs) in results["off"].items():
        assert results["on"][rid][:3] == (tokens, text, reason), rid
        got = results["on"][rid][3]
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got] == \
            [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4)
    off = results["off"]
    assert off["stop-token"][2] is FinishReason.STOP and len(off["stop-token"][0]) == 7
    assert off["stop-string"][2] is FinishReason.STOP and stop_text not in off["stop-string"][1]
    assert off["penalties"][0] != reference_tokens["penalties"]  # the history-reading processing mattered
    assert len(off["a1"][3]) == 20 and off["base"][0] != off["a0"][0]
    assert (min(preemptions.values()) > 0) == tight_kv, preemptions


def test_step_returns_while_the_step_it_launched_runs(adapters, monkeypatch):
    core = _core("on", {})
    real_execute = core.runner.execute
    release = threading.Event()
    running = threading.Event()

    def execute(rows, previous):  # patch: a device step that runs until the test lets it finish
        running.set()
        assert release.wait(30)
        return real_execute(rows, previous)

    monkeypatch.setattr(core.runner, "execute", execute)
    core.add_request(Request("r", _prompt(0), SamplingParams(max_new_tokens=3, ignore_eos=True)), None)
    assert core.step() == []  # launched, not waited for
    assert running.wait(30) and core.step_in_flight
    release.set()
    outputs = run_to_completion(core)
    assert [len(o.new_token_ids) for o in outputs["r"]] == [1, 1, 1]
    core.shutdown()


def test_a_request_cancelled_while_its_step_runs_gets_nothing_more_and_releases_once(adapters):
    core = _core("on", adapters)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for i, adapter in enumerate(("a0", "a1", None)):
        core.add_request(Request(f"r{i}", _prompt(i), params), adapter)
    seen: dict[str, list] = {"r0": [], "r1": []}
    for _ in range(2000):  # until r0 streams (its adapter's slot copy lands first)
        for out in core.step():
            seen.setdefault(out.request_id, []).append(out)
        if len(seen["r0"]) >= 2:
            break
    assert core.step_in_flight  # r0's next token is being computed now
    tokens_before = sum(len(o.new_token_ids) for o in seen["r0"])
    core.abort("r0")
    assert core.lora.stats().references == 1  # r1's only: r0's was released at the cancel
    rest = run_to_completion(core)
    assert [o.new_token_ids for o in rest["r0"]] == [[]] and rest["r0"][0].finish_reason is FinishReason.CANCELLED
    assert tokens_before < 30
    assert sum(len(o.new_token_ids) for o in seen["r1"] + rest["r1"]) == 30
    core.abort("r0")  # idempotent: nothing released twice
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    core.shutdown()


def test_a_failed_sample_ends_the_request_even_with_its_next_step_launched(adapters, monkeypatch):
    core = _core("on", {})
    real_execute = core.runner.execute
    calls = {"n": 0}

    def execute(rows, previous):  # patch: request "bad" gets non-finite logits at its 4th step
        calls["n"] += 1
        results = real_execute(rows, previous)
        if calls["n"] == 4 and "bad" in results:
            results["bad"] = (NON_FINITE, None, None)
        return results

    monkeypatch.setattr(core.runner, "execute", execute)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    core.add_request(Request("bad", _prompt(0), params), None)
    core.add_request(Request("good", _prompt(1), params), None)
    outputs = run_to_completion(core)
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR
    assert sum(len(o.new_token_ids) for o in outputs["bad"]) == 3
    assert sum(len(o.new_token_ids) for o in outputs["good"]) == 10
    assert core.runner.kv.num_used == 0
    core.shutdown()


def test_a_forward_pass_failing_on_the_device_worker_ends_only_that_request(adapters, monkeypatch):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = {"a": _prompt(0), "b": _prompt(1), "c": _prompt(2)}
    reference = _core("on", {})
    expected = generate(reference, {rid: (prompt, None) for rid, prompt in prompts.items()}, params)
    reference.shutdown()

    core = _core("on", {})
    real_execute = core.runner.execute
    calls = {"n": 0}

    def execute(rows, previous):  # patch: a kernel bug that only request "b"'s rows trigger
        calls["n"] += 1
        if any(r.request_id == "b" for r in rows) and calls["n"] > 3:
            raise RuntimeError("simulated kernel failure")
        return real_execute(rows, previous)

    monkeypatch.setattr(core.runner, "execute", execute)
    for rid, prompt in prompts.items():
        core.add_request(Request(rid, prompt, params), None)
    outputs = run_to_completion(core)
    assert outputs["b"][-1].finish_reason is FinishReason.ERROR and outputs["b"][-1].error.code == "INTERNAL"
    for rid in ("a", "c"):
        assert [t for o in outputs[rid] for t in o.new_token_ids] == expected[rid]
        assert outputs[rid][-1].finish_reason is FinishReason.LENGTH
    assert core.runner.kv.num_used == 0 and not core.has_work()
    core.shutdown()


def test_a_failed_step_with_one_in_flight_ends_the_running_requests_and_leaves_nothing(adapters, monkeypatch):
    """A bug in planning (a patch: it cannot be caused for real) while a step runs on the device
    worker: the scheduler thread's recovery (`fail_running`, as CoreThread calls it) waits for the
    launched step, ends every running request and every one owed a token, releases everything, and
    the engine serves the next request."""
    core = _core("on", {})
    # In their slots before the requests come: a slot load overlaps decoding, so on a loaded machine
    # the base request had finished its 20 tokens before the adapters' requests started, the three
    # never streamed together, and the planning bug below was never reached.
    load_adapters(core, adapters, preload=True)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for i, adapter in enumerate(("a0", None, "a1")):
        core.add_request(Request(f"r{i}", _prompt(i), params), adapter)
    for _ in range(2000):  # until every request streams
        core.step()
        if len(core.scheduler.running) == 3 and core.step_in_flight:
            break
    assert len(core.scheduler.running) == 3 and core.step_in_flight, "the three requests never streamed together"
    real_plan, real_execute = core.runner.plan, core.runner.execute
    release, ran = threading.Event(), threading.Event()
    held: set[int] = set()  # the rows of the step that runs until the test releases it

    def execute(rows, previous):  # patch: that step waits for `release`
        if id(rows) in held:
            assert release.wait(30)
        results = real_execute(rows, previous)
        if id(rows) in held:
            ran.set()
        return results

    def plan_held(batch):  # patch: the next step is held on the worker...
        rows = real_plan(batch)
        held.add(id(rows))
        core.runner.plan = plan_failing
        return rows

    def plan_failing(batch):  # ...and planning the one after it raises, once
        core.runner.plan = real_plan
        raise RuntimeError("simulated planning bug")

    monkeypatch.setattr(core.runner, "execute", execute)
    monkeypatch.setattr(core.runner, "plan", plan_held)
    core.step()  # launches the held step, completes the one before it
    with pytest.raises(RuntimeError, match="simulated planning bug"):
        core.step()
    assert core.step_in_flight and not ran.is_set()
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    outputs = core.fail_running(LoraplexError("internal error in the scheduler step"))
    assert ran.is_set() and time.monotonic() - started >= 0.25  # it waited for the step in flight
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    assert all(o.finished and o.finish_reason is FinishReason.ERROR for o in outputs)
    assert not core.has_work() and core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    core.add_request(Request("after", _prompt(5), SamplingParams(max_new_tokens=5, ignore_eos=True)), "a0")
    assert sum(len(o.new_token_ids) for o in run_to_completion(core)["after"]) == 5
    core.shutdown()


def test_a_batch_that_fails_once_and_runs_again_row_by_row_serves_the_same_tokens(adapters, monkeypatch):
    """A forward pass that fails for the whole batch once (a patch: a transient kernel failure) runs
    again one row at a time; rows whose last input was pending (filled in from the step before) and
    whose penalties read the history must be filled in once, not once per attempt."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=2.0,
                            presence_penalty=1.0)
    prompts = {rid: (_prompt(i), None) for i, rid in enumerate("abc")}
    reference = _core("on", {})
    expected = generate(reference, prompts, params)
    reference.shutdown()
    core = _core("on", {})
    real_tensors = core.runner._tensors
    calls = {"n": 0}

    def tensors(rows):  # patch: every 4th multi-row pass fails once, inside execute; its rows then run alone
        if len(rows) > 1:
            calls["n"] += 1
            if calls["n"] % 4 == 0:
                raise RuntimeError("simulated transient kernel failure")
        return real_tensors(rows)

    histories: list[tuple[int, int]] = []  # (history length, outputs before the sampled token)

    def process_logits(logits, rows, eos_token_ids):  # a spy: what the penalties read
        histories.extend((len(r.output_token_ids), r.start + len(r.input_ids) - len(r.prompt_token_ids))
                         for r in rows)
        return real_process_logits(logits, rows, eos_token_ids)

    real_process_logits = model_runner.process_logits
    monkeypatch.setattr(core.runner, "_tensors", tensors)
    monkeypatch.setattr(model_runner, "process_logits", process_logits)
    assert generate(core, prompts, params) == expected
    core.shutdown()
    assert calls["n"] >= 8
    # Every row's penalties saw exactly the outputs before its token: never one twice.
    assert histories and all(seen == before for seen, before in histories), histories


@pytest.mark.parametrize("late_planning", [True, False], ids=["planned-late", "planned-at-once"])
def test_a_request_arriving_while_a_step_runs_joins_the_next_step(monkeypatch, late_planning):
    """The scheduler thread plans the next step only once PLAN_AT_FRACTION of the running one has
    passed (taking commands meanwhile), so a request that arrives early in step i joins step i+1,
    not i+2 (planned at once, i+1 was planned before it came). The device never waits for it.
    Asserted against the plans' own times: a request always joins the first step planned after it
    arrived; late, step i+1 is planned that far into step i, and at once, as step i starts. The
    request is sent right after a step's hand-off; where the host held the test's thread past the
    planning point (seen once beside another test's model threads), it cannot join i+1, and only
    the rest is asserted."""
    if not late_planning:
        monkeypatch.setattr(engine_core, "PLAN_AT_FRACTION", 0.0)
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", async_scheduling="on", kv_cache_bytes=4 << 20))
    real_execute, real_plan = engine.core.runner.execute, engine.core.runner.plan
    steps: list[tuple[float, float, list[str]]] = []  # device start, end, request ids of its rows
    plans: list[float] = []  # when each step was planned (steps run in the order they were planned)

    def execute(rows, previous):  # patch: a device step of a fixed STEP_S, as an accelerator's
        start = time.monotonic()
        results = real_execute(rows, previous)
        time.sleep(max(0.0, start + STEP_S - time.monotonic()))
        steps.append((start, time.monotonic(), [row.request_id for row in rows]))
        return results

    def plan(batch):
        plans.append(time.monotonic())
        return real_plan(batch)

    monkeypatch.setattr(engine.core.runner, "execute", execute)
    monkeypatch.setattr(engine.core.runner, "plan", plan)
    engine.start()
    try:
        first = engine.add_request(_prompt(0), SamplingParams(max_new_tokens=10, ignore_eos=True), request_id="a")
        outputs = iter(first)
        for _ in range(4):  # a few steps measured, then right after a step's hand-off:
            next(outputs)
        added = time.monotonic()
        second = engine.add_request(_prompt(1), SamplingParams(max_new_tokens=2, ignore_eos=True), request_id="b")
        assert sum(len(o.new_token_ids) for o in second) == 2
        assert sum(len(o.new_token_ids) for o in outputs) == 6
    finally:
        engine.shutdown()
    assert len(plans) == len(steps)
    running = max(i for i, (start, _, _) in enumerate(steps) if start <= added)
    joined = next(i for i, (_, _, ids) in enumerate(steps) if "b" in ids)
    assert joined == next(i for i, planned in enumerate(plans) if planned > added), (added, plans, steps)
    next_planned_into = plans[running + 1] - steps[running][0]  # how far into step i it planned i+1
    if late_planning:
        assert next_planned_into >= LATE * STEP_S * 0.9, (next_planned_into, plans, steps)
        if added < plans[running + 1]:
            assert joined == running + 1, (running, joined, steps)
    else:  # planned as soon as step i was launched
        assert next_planned_into < LATE * STEP_S / 2, (next_planned_into, plans, steps)
        if added > plans[running + 1]:
            assert joined == running + 2, (running, joined, steps)
    gaps = [later[0] - earlier[1] for earlier, later in itertools.pairwise(steps)]
    assert max(gaps) < STEP_S / 2, gaps  # each step was launched before the one before it ended
