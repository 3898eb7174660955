"""Fair share across tenants (the Virtual Token Counter) and preemption by priority, in the engine.

Each test drives an EngineCore step by step, so what the scheduler decides is visible exactly.
The server-level figures (a light tenant's TTFT beside a heavy one, token shares, throughput
against FCFS) are bench/fairness.py's.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from harness.engine_helpers import make_core, run_to_completion
from inference_service.engine.core import EngineCore
from inference_service.engine.fair_share import FairShare
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import Request, SamplingParams, TenantTag, WaitReason
from inference_service.models.loader import builtin_tiny_config

LONG = SamplingParams(max_new_tokens=48, ignore_eos=True)


def _prompt(seed: int, length: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(32, 127) for _ in range(length - 1)]


def _add(core: EngineCore, rid: str, tenant: TenantTag | None, params: SamplingParams = LONG,
         priority: int = 0, seed: int | None = None, length: int = 12) -> Request:
    request = Request(rid, _prompt(sum(map(ord, rid)) if seed is None else seed, length), params)
    request.tenant, request.priority = tenant, priority
    core.add_request(request, None)
    return request


def _running_by_tenant(core: EngineCore) -> Counter[str]:
    return Counter(r.tenant.name if r.tenant else "" for r in core.scheduler.running)


def _no_leak(core: EngineCore) -> None:
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    assert not core.scheduler.fair.live and not core.scheduler.fair.counters


def _tokens_by_tenant(core: EngineCore, steps: int) -> Counter[str]:
    """Tokens each tenant's requests got over the next `steps` steps."""
    tenants = {rid: (r.tenant.name if r.tenant else "") for rid, r in core.scheduler.requests.items()}
    served: Counter[str] = Counter()
    for _ in range(steps):
        for out in core.step():
            served[tenants[out.request_id]] += len(out.new_token_ids)
    return served


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_light_tenant_gets_a_seat_at_once_beside_a_tenant_filling_the_batch(fair_share):
    """Tenant A fills every seat and has more waiting; B's one request is admitted in the very next
    step by preempting A's newest (fair share), and waits for A's requests to end under FCFS."""
    core = make_core(max_num_seqs=4, fair_share=fair_share)
    heavy, light = TenantTag("heavy"), TenantTag("light")
    for i in range(8):
        _add(core, f"h{i}", heavy)
    core.step()
    core.step()
    assert _running_by_tenant(core) == {"heavy": 4}
    _add(core, "l0", light, SamplingParams(max_new_tokens=4, ignore_eos=True))
    core.step()
    if fair_share:
        assert _running_by_tenant(core) == {"heavy": 3, "light": 1}
        assert core.scheduler.preemptions == {"fair_share": 1}
        (preempted,) = [r for r in core.scheduler.waiting if r.num_pending_tokens or r.output_token_ids]
        assert preempted.request_id == "h3"  # the newest of the tenant over its share
    else:
        assert _running_by_tenant(core) == {"heavy": 4}
        assert core.scheduler.requests["l0"].wait_reason is WaitReason.BATCH_FULL
        assert not core.scheduler.preemptions
    outputs = run_to_completion(core)
    assert all(outs[-1].finished for outs in outputs.values())
    _no_leak(core)


def test_preempted_requests_make_the_same_tokens():
    """Fair-share preemption recomputes: every request's greedy tokens equal a run without it.
    Three seats; three light tenants arrive while the heavy one holds them all."""
    reference = make_core(max_num_seqs=16)
    for i in range(6):
        _add(reference, f"h{i}", None, seed=i)
    for i in range(3):
        _add(reference, f"l{i}", None, seed=100 + i)
    expected = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in run_to_completion(reference).items()}

    core = make_core(max_num_seqs=3)
    heavy = TenantTag("heavy")
    for i in range(6):
        _add(core, f"h{i}", heavy, seed=i)
    outputs: dict[str, list[int]] = {}
    for step in range(40):
        if step in (3, 9, 15):
            _add(core, f"l{step // 6}", TenantTag(f"light{step}"), seed=100 + step // 6)
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for rid, outs in run_to_completion(core).items():
        outputs.setdefault(rid, []).extend(t for o in outs for t in o.new_token_ids)
    # Two preemptions: the third light tenant finds every tenant at one seat, its equal share.
    assert core.scheduler.preemptions == {"fair_share": 2}
    assert outputs == expected
    _no_leak(core)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (3.0, 1.0)])
def test_backlogged_tenants_share_seats_and_tokens_by_weight(weights):
    """Two backlogged tenants: seats settle at their weights' ratio and stay there (no ping-pong),
    and their tokens over a window are within 10% of that ratio. A arrives first and holds
    every seat until B comes: B takes its seats within a few steps."""
    core = make_core(max_num_seqs=4)
    a, b = TenantTag("a", weight=weights[0]), TenantTag("b", weight=weights[1])
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    for i in range(8):
        _add(core, f"a{i}", a, params)
    core.step()
    for i in range(8):
        _add(core, f"b{i}", b, params)
    seats = {"a": 2, "b": 2} if weights == (1.0, 1.0) else {"a": 3, "b": 1}
    for _ in range(10):  # B's first seat at once; each further one once A's counter has caught up
        core.step()
        if _running_by_tenant(core) == seats:
            break
    assert _running_by_tenant(core) == seats
    preemptions = core.scheduler.num_preemptions
    served = _tokens_by_tenant(core, 60)
    assert _running_by_tenant(core) == seats
    assert core.scheduler.num_preemptions == preemptions, "seats moved between tenants at equal shares"
    ratio = (served["a"] / weights[0]) / (served["b"] / weights[1])
    assert 0.9 <= ratio <= 1.1, (served, weights)
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    core.step()
    _no_leak(core)


def test_fcfs_serves_the_first_tenant_only():
    """The same traffic with fair share off: A, first, holds every seat (what the fair tests beat)."""
    core = make_core(max_num_seqs=4, fair_share=False)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    for i in range(8):
        _add(core, f"a{i}", TenantTag("a"), params)
    core.step()
    for i in range(8):
        _add(core, f"b{i}", TenantTag("b"), params)
    served = _tokens_by_tenant(core, 30)
    assert served["b"] == 0 and served["a"] > 0
    for rid in list(core.scheduler.requests):
        core.abort(rid)
    core.step()
    _no_leak(core)


def test_a_lone_tenant_is_served_at_full_speed():
    """Work-conserving: with the other tenant idle, one tenant gets every seat, and a tenant that
    joins later starts at the lowest live counter (no credit banked while it was idle)."""
    core = make_core(max_num_seqs=4)
    for i in range(6):
        _add(core, f"a{i}", TenantTag("a"))
    core.step()
    assert _running_by_tenant(core) == {"a": 4}
    for _ in range(5):
        core.step()
    counters = core.scheduler.fair.counters
    assert counters["a"] > 0
    _add(core, "b0", TenantTag("b"))
    assert counters["b"] == counters["a"]
    run_to_completion(core)
    _no_leak(core)


def test_a_joining_tenant_starts_at_the_lowest_of_several_live_counters():
    """Three tenants: a has been served alone, b joined later with more weight, so their counters
    differ when c joins; c starts at the lower one (starting at the higher one, or at either in
    particular, would fail here)."""
    core = make_core(max_num_seqs=4)
    for i in range(4):
        _add(core, f"a{i}", TenantTag("a"))
    for _ in range(4):
        core.step()
    for i in range(4):
        _add(core, f"b{i}", TenantTag("b", weight=4.0))
    for _ in range(8):
        core.step()
    counters = core.scheduler.fair.counters
    assert set(counters) == {"a", "b"} and counters["a"] != counters["b"], counters
    lowest = min(counters.values())
    _add(core, "c0", TenantTag("c"))
    assert counters["c"] == lowest < max(counters["a"], counters["b"]), counters
    run_to_completion(core)
    _no_leak(core)


def test_prefix_cache_hits_and_recompute_are_not_charged():
    fair = FairShare(decode_weight=2.0)
    core = make_core(max_num_seqs=4)
    scheduler = core.scheduler
    scheduler.fair = fair
    tenant = TenantTag("a", weight=2.0)
    prompt = _prompt(1, 40)  # two full blocks of 16, then 8 more
    first = Request("first", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    first.tenant = tenant
    core.add_request(first, None)
    core.step()  # prefill 40 (one step), its one token: finished
    assert not fair.live and fair._last_left == pytest.approx(40 / 2.0)
    second = Request("second", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    second.tenant = tenant
    core.add_request(second, None)
    core.step()  # 32 tokens hit, 8 computed
    assert second.num_cached_tokens == 32
    assert fair.counter("a") == pytest.approx(40 / 2.0 + 8 / 2.0)
    core.step()  # one decode position
    assert fair.counter("a") == pytest.approx(40 / 2.0 + 8 / 2.0 + 2.0 / 2.0)
    charged = second.charged_tokens
    scheduler._preempt(second, "kv_cache")
    core.step()  # recomputes its 41 positions (free), and computes one new one
    assert second.charged_tokens == charged + 1 and fair.counter("a") == pytest.approx(25.0 + 2.0 / 2.0)
    run_to_completion(core)
    _no_leak(core)


def test_a_high_priority_request_preempts_a_lower_one_for_a_seat():
    """vLLM's semantics (lower value first): a waiting priority -1 request takes the seat of the
    lowest-priority running request, the newest among equals, even of its own tenant; equal or
    higher priorities are never preempted for it."""
    core = make_core(max_num_seqs=3)
    tenant = TenantTag("t")
    _add(core, "p0", tenant, priority=0)
    _add(core, "p5a", tenant, priority=5)
    _add(core, "p5b", tenant, priority=5)
    core.step()
    _add(core, "urgent", tenant, priority=-1)
    core.step()
    running = {r.request_id for r in core.scheduler.running}
    assert running == {"p0", "p5a", "urgent"}
    assert core.scheduler.preemptions == {"priority": 1}
    _add(core, "p0b", tenant, priority=0)  # beats p5a (5) for a seat
    core.step()
    assert {r.request_id for r in core.scheduler.running} == {"p0", "urgent", "p0b"}
    _add(core, "p0c", tenant, priority=0)  # no lower-priority request left: it waits
    core.step()
    assert core.scheduler.requests["p0c"].wait_reason is WaitReason.BATCH_FULL
    assert core.scheduler.preemptions == {"priority": 2}
    outputs = run_to_completion(core)
    assert all(outs[-1].finished for outs in outputs.values())
    _no_leak(core)


def test_priority_preemption_frees_kv_memory_and_outputs_are_unchanged():
    """With the KV cache full of low-priority requests, an urgent one preempts for memory; every
    request's tokens equal a run without pressure."""
    block = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    reference = make_core(max_num_seqs=8)
    for i in range(2):
        _add(reference, f"low{i}", None, params, seed=i, length=40)
    _add(reference, "urgent", None, params, seed=9, length=40)
    expected = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in run_to_completion(reference).items()}

    core = make_core(max_num_seqs=8, kv_cache_bytes=7 * block, prefix_cache=False)  # 112 tokens
    for i in range(2):
        _add(core, f"low{i}", None, params, priority=3, seed=i, length=40)  # 3 blocks each after 9 tokens
    outputs: dict[str, list[int]] = {}
    for _ in range(3):
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert core.runner.kv.num_used == 6
    _add(core, "urgent", None, params, priority=0, seed=9, length=40)  # needs 3 blocks: 1 is free
    for out in core.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert "urgent" in {r.request_id for r in core.scheduler.running}
    assert core.scheduler.preemptions["priority"] >= 1
    for rid, outs in run_to_completion(core).items():
        outputs.setdefault(rid, []).extend(t for o in outs for t in o.new_token_ids)
    assert outputs == expected
    _no_leak(core)


def test_a_seat_preemption_pauses_and_resumes_without_recompute():
    """Preempted for a seat, a request keeps its KV blocks; when it gets a seat back it goes on from
    where it stopped: no prefix-cache lookup, no recompute (one token that step)."""
    core = make_core(max_num_seqs=2)
    heavy = TenantTag("heavy")
    for i in range(2):
        _add(core, f"h{i}", heavy)
    for _ in range(3):
        core.step()
    paused = core.scheduler.requests["h1"]
    computed, table = paused.num_computed_tokens, list(paused.block_table)
    _add(core, "l0", TenantTag("light"), SamplingParams(max_new_tokens=2, ignore_eos=True))
    core.step()
    queries = core.scheduler.prefix_queries  # with l0's admission
    assert core.scheduler.preemptions == {"fair_share": 1}
    assert paused in core.scheduler.waiting and paused.block_table == table
    assert paused.num_computed_tokens == computed
    steps: list[list[tuple[str, int]]] = []
    plan = core.runner.plan

    def recording_plan(batch):  # type: ignore[no-untyped-def]
        steps.append([(r.request_id, n) for r, n in batch.items])
        return plan(batch)

    core.runner.plan = recording_plan  # type: ignore[method-assign]  # ModelRunner.run plans through it
    while paused not in core.scheduler.running:
        core.step()
    assert ("h1", 1) in steps[-1], steps[-1]  # one decode token: nothing recomputed
    assert core.scheduler.prefix_queries == queries  # no lookup: h1 was not admitted anew
    run_to_completion(core)
    _no_leak(core)


def test_paused_blocks_are_dropped_before_a_running_request_is_preempted():
    """Memory short while a request is paused: its blocks go first (it will recompute), no running
    request is preempted for memory, and every output equals a run without pressure."""
    block = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    reference = make_core(max_num_seqs=8)
    for rid, seed in (("h0", 0), ("h1", 1), ("l0", 2)):
        _add(reference, rid, None, params, seed=seed, length=40)
    expected = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in run_to_completion(reference).items()}

    core = make_core(max_num_seqs=2, kv_cache_bytes=7 * block, prefix_cache=False)
    heavy = TenantTag("heavy")
    outputs: dict[str, list[int]] = {}
    for rid, seed in (("h0", 0), ("h1", 1)):
        _add(core, rid, heavy, params, seed=seed, length=40)  # 3 blocks each: 6 of 7
    for out in core.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    _add(core, "l0", TenantTag("light"), params, seed=2, length=40)  # a seat from h1, and 3 blocks
    for out in core.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert {r.request_id for r in core.scheduler.running} == {"h0", "l0"}
    assert core.scheduler.requests["h1"].block_table == []  # paused, then its blocks dropped for l0's
    assert core.scheduler.preemptions == {"fair_share": 1}
    for rid, outs in run_to_completion(core).items():
        outputs.setdefault(rid, []).extend(t for o in outs for t in o.new_token_ids)
    assert outputs == expected
    _no_leak(core)
