"""Continuous batching: preemption by recompute, abort at every stage, no head-of-line blocking."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from harness.adapters import write_tiny_adapter
from harness.devices import DEVICES
from harness.engine_helpers import generate, load_adapters, run_to_completion
from harness.waiting import wait_until
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import FinishReason, Request, SamplingParams, TenantTag, WaitReason
from inference_service.kernels.copy import CopyJob
from inference_service.models.loader import builtin_tiny_config

GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {f"a{i}": write_tiny_adapter(root / f"a{i}", rank=4 + 2 * (i % 3), seed=i) for i in range(6)}


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[256] + [rng.randrange(32, 127) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def _core(device: str = "cpu", **kwargs) -> EngineCore:
    """CPU unless a test is device-generic (then it takes the DEVICES parameter)."""
    config = dict(max_loras=4, max_lora_rank=8, kv_cache_bytes=4 << 20)
    config.update(kwargs)
    return EngineCore(EngineConfig(device=device, **config))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_gives_identical_outputs(tiny_adapters, device, async_scheduling):
    names = list(tiny_adapters)
    prompts = {f"r{i}": (p, names[i % 4] if i % 5 else None) for i, p in enumerate(_prompts(10))}
    reference_core = _core(device)
    load_adapters(reference_core, {n: tiny_adapters[n] for n in names[:4]})
    reference = generate(reference_core, prompts, GREEDY)
    assert reference_core.scheduler.num_preemptions == 0

    block_bytes = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    tight = _core(device, kv_cache_bytes=12 * block_bytes,  # 192 tokens for 10 requests of up to 70
                  async_scheduling=async_scheduling)
    load_adapters(tight, {n: tiny_adapters[n] for n in names[:4]})
    constrained = generate(tight, prompts, GREEDY)
    assert tight.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    assert constrained == reference
    assert tight.runner.kv.num_used == 0 and tight.lora.stats().references == 0


def test_no_head_of_line_blocking_on_cold_adapter(tiny_adapters):
    """A request whose adapter is loading is skipped; the rest of the queue runs meanwhile."""
    core = _core(max_loras=2)
    load_adapters(core, {"a0": tiny_adapters["a0"], "a1": tiny_adapters["a1"]})  # registered, not in slots
    gate = threading.Event()
    core.lora._loader.engine.submit(CopyJob(gate.wait))  # hold the real copy thread: a0's slot copy stays in flight
    core.add_request(Request("cold", [256, 65, 66], GREEDY), "a0")
    core.add_request(Request("base", [256, 67, 68], SamplingParams(max_new_tokens=3, ignore_eos=True)), None)
    finished = set()
    for _ in range(50):
        finished |= {o.request_id for o in core.step() if o.finished}
        if "base" in finished:
            break
    assert "base" in finished and "cold" not in finished
    gate.set()
    run_to_completion(core)
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_abort_storm_leaves_nothing_behind(tiny_adapters, seed, device, async_scheduling):
    """Aborts land at every stage: queued, adapter loading, mid chunked prefill, decoding,
    after finishing, twice, and for unknown ids. Nothing leaks."""
    rng = random.Random(seed)
    core = _core(device, max_loras=3, max_num_batched_tokens=24, aging_steps=8, async_scheduling=async_scheduling)
    load_adapters(core, tiny_adapters)
    live: list[str] = []
    done: list[str] = []
    for i, prompt in enumerate(_prompts(40, seed)):
        adapter = rng.choice([*tiny_adapters, None])
        params = SamplingParams(max_new_tokens=rng.randrange(1, 24), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.9]), seed=i)
        core.add_request(Request(f"q{i}", prompt, params), adapter)
        live.append(f"q{i}")
        for _ in range(rng.randrange(0, 3)):
            done += [o.request_id for o in core.step() if o.finished]
        if rng.random() < 0.5:
            victim = rng.choice(live + done + ["never-existed"])
            core.abort(victim)
            core.abort(victim)
    while core.has_work():
        if rng.random() < 0.3 and core.scheduler.requests:
            core.abort(rng.choice(list(core.scheduler.requests)), FinishReason.DEADLINE)
        core.step()
    for _ in range(200):  # let in-flight loads land, then drain them
        core.lora.drain()
        if not core.lora.has_pending_work():
            break
        time.sleep(0.005)
    stats = core.stats()
    assert core.runner.kv.num_used == 0
    assert core.lora.stats().references == 0
    assert stats.pending_load_events == 0 and stats.slots_referenced == 0
    assert not core.scheduler.requests and not core.scheduler.running and not core.scheduler.waiting


SHORT = SamplingParams(max_new_tokens=3, ignore_eos=True)


def _starvation_setup(tiny_adapters, aging_steps: int) -> EngineCore:
    """Two slots held by a0/a1 (running requests), then a request for a2, which is only registered."""
    core = _core(max_loras=2, aging_steps=aging_steps)
    load_adapters(core, {n: tiny_adapters[n] for n in ("a0", "a1")}, preload=True)
    load_adapters(core, {"a2": tiny_adapters["a2"]})
    for i in range(4):
        core.add_request(Request(f"warm{i}", [256, 40 + i], SHORT), f"a{i % 2}")
    core.step()
    core.add_request(Request("starved", [256, 99], SHORT), "a2")
    return core


def _busy_step(core: EngineCore, step: int) -> bool:
    """One more a0/a1 request, one scheduler step; True once the a2 request has finished."""
    core.add_request(Request(f"busy{step}", [256, 50 + step % 40], SHORT), f"a{step % 2}")
    starved_done = any(o.request_id == "starved" and o.finished for o in core.step())
    time.sleep(0.002)  # let a2's staging (host threads) progress as wall time would
    return starved_done


def test_aging_serves_an_adapter_that_busier_ones_would_starve(tiny_adapters):
    """Two slots kept busy by a steady stream of a0/a1 requests; an a2 request still gets a slot."""
    core = _starvation_setup(tiny_adapters, aging_steps=5)
    assert any(_busy_step(core, step) for step in range(300)), "the a2 request starved behind a0/a1 traffic"
    run_to_completion(core)
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0


def test_without_aging_the_same_traffic_starves_it(tiny_adapters):
    """The control for the test above: the starvation it prevents is real."""
    core = _starvation_setup(tiny_adapters, aging_steps=10**9)
    for step in range(100):
        assert not _busy_step(core, step)
    for request_id in list(core.scheduler.requests):
        core.abort(request_id)
    core.step()


def test_a_step_fills_with_resident_adapters_while_others_wait(tiny_adapters):
    """Adapters outnumber the pool: waiting requests are taken by residency,
    not in arrival order, so a step is never small for want of slots while resident work waits.
    Both slots are held by running a0/a1 requests; of the queue a2, a0, a3, a1, ... every a0/a1
    request joins the next step and only a2/a3 wait."""
    core = _core(max_loras=2)
    load_adapters(core, {n: tiny_adapters[n] for n in ("a0", "a1")}, preload=True)
    load_adapters(core, {n: tiny_adapters[n] for n in ("a2", "a3")})
    long = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for i in range(2):
        core.add_request(Request(f"hold{i}", [256, 40 + i], long), f"a{i}")
    core.step()
    queue = [f"a{k}" for k in (2, 0, 3, 1)] * 3
    for i, adapter in enumerate(queue):
        core.add_request(Request(f"q{i}-{adapter}", [256, 60 + i], long), adapter)
    core.step()
    running = {r.request_id for r in core.scheduler.running}
    waiting = list(core.scheduler.waiting)
    assert running == {"hold0", "hold1"} | {f"q{i}-{a}" for i, a in enumerate(queue) if a in ("a0", "a1")}
    assert sorted(r.request_id for r in waiting) == sorted(f"q{i}-{a}" for i, a in enumerate(queue)
                                                         if a in ("a2", "a3"))
    # The first step a cold adapter is seen, it is staged to host memory meanwhile (adapter_loading);
    # neither gets pages while a0/a1 hold both.
    assert {r.wait_reason for r in waiting} <= {WaitReason.ADAPTER_LOADING, WaitReason.SLOTS_FULL}
    assert all(core.lora.slot_of(core.lora.uid_of(n)) is None for n in ("a2", "a3"))
    # Once staged (on host threads: how soon is the host's business), they wait for slots, and the
    # a0/a1 requests keep running.
    cold = [core.lora._registry.versions[core.lora.uid_of(n)] for n in ("a2", "a3")]
    wait_until(lambda: all(e.host is not None or (e.staging is not None and e.staging.done()) for e in cold),
               "a2/a3 staged", poll_s=0.002)
    core.step()
    assert {r.wait_reason for r in core.scheduler.waiting} == {WaitReason.SLOTS_FULL}
    assert {"hold0", "hold1"} <= {r.request_id for r in core.scheduler.running}
    for request_id in list(core.scheduler.requests):
        core.abort(request_id)
    core.step()
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0


def test_waiting_queue_follows_priority_then_arrival():
    """vLLM's semantics: lower priority values are admitted first, equal ones first come first served
    (all 0 by default: plain FCFS). One running request at a time makes admission order visible."""
    core = _core(max_num_seqs=1)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    first = Request("first", [256, 65, 66], params)
    core.add_request(first, None)
    core.step()
    for rid, priority in (("low", 5), ("mid", 0), ("urgent", -3), ("mid2", 0), ("low2", 5)):
        request = Request(rid, [256, 65, 66], params)
        request.priority = priority
        core.add_request(request, None)
    started: list[str] = ["first"]

    def step() -> None:
        for out in core.step():
            if out.request_id not in started:
                started.append(out.request_id)

    while core.has_work():
        step()
    assert started == ["first", "urgent", "mid", "mid2", "low", "low2"]
    assert core.runner.kv.num_used == 0


def test_tenant_max_running_holds_its_requests_and_no_one_elses():
    """A tenant at its max_running waits (WaitReason.TENANT_LIMIT) while other tenants' requests are
    admitted past it: the limit is work-conserving for everyone else."""
    core = _core(max_num_seqs=8)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    limited, other = TenantTag("a", max_running=1), TenantTag("b")
    for rid, tenant in (("a1", limited), ("a2", limited), ("b1", other), ("b2", other)):
        request = Request(rid, [256, 65, 66], params)
        request.tenant = tenant
        core.add_request(request, None)
    core.step()
    assert sorted(r.request_id for r in core.scheduler.running) == ["a1", "b1", "b2"]
    (waiting,) = core.scheduler.waiting
    assert waiting.request_id == "a2" and waiting.wait_reason is WaitReason.TENANT_LIMIT
    outputs = run_to_completion(core)
    assert all(outs[-1].finished for outs in outputs.values()) and len(outputs) == 4
    assert core.runner.kv.num_used == 0


def _tiny_kv_core(blocks: int) -> EngineCore:
    block_bytes = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    core = _core(kv_cache_bytes=blocks * block_bytes)
    assert (core.runner.kv.num_blocks, core.runner.kv.block_size) == (blocks, 16)
    return core


@pytest.mark.parametrize(("max_new_tokens", "preempted"), [(28, False), (29, True)])
def test_kv_growth_takes_the_last_free_block_and_preempts_only_past_it(max_new_tokens, preempted):
    """Two requests in a 4-block KV cache (16 tokens a block), each 5 prompt tokens: with 28 new tokens
    each computes 32 tokens of KV (its last sampled token is never computed), 2 blocks each, exactly
    all 4, and nothing is preempted; one token more each needs a fifth block, and someone is."""
    core = _tiny_kv_core(4)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for i in range(2):
        core.add_request(Request(f"r{i}", [256] + [65 + i] * 4, params), None)
    outputs = run_to_completion(core)
    assert all(len([t for o in outs for t in o.new_token_ids]) == max_new_tokens for outs in outputs.values())
    assert (core.scheduler.num_preemptions > 0) is preempted, core.scheduler.num_preemptions
    assert core.runner.kv.num_used == 0


def test_kv_growth_preempts_the_lowest_priority_before_the_newest(caplog):
    """Running in admission order A (priority 0), B (priority 5), C (priority 0), each growing to 3
    blocks in a 6-block cache: when A, the oldest, needs a block and none is free, the victim is B,
    the lowest priority, not C, the newest, nor A itself; A and C then fit and are never preempted."""
    core = _tiny_kv_core(6)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for rid, priority in (("A", 0), ("B", 5), ("C", 0)):
        request = Request(rid, [256] + [ord(rid)] * 4, params)
        request.priority = priority
        core.add_request(request, None)
        core.step()  # admitted before the next arrives: running is in this order
    with caplog.at_level("INFO", logger="inference_service.engine.scheduler"):
        outputs = run_to_completion(core)
    preempted = [r.args[0] for r in caplog.records if r.getMessage().startswith("preempted ")]
    assert preempted and set(preempted) == {"B"}, preempted
    assert set(outputs) == {"A", "B", "C"} and core.runner.kv.num_used == 0
