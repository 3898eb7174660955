"""A request's n samples in the engine: the scheduler's group hold, the seeds.

The samples are n engine requests of one group (`Request.group`). With the prefix cache on, the
first one added leads: the others wait (WaitReason.SAMPLES) until its prompt blocks are cached, then
hit every full block of the prompt and compute only its tail. A leader that ends first (cancelled,
failed) releases them at once; with the prefix cache off nothing is held. Seeds: sample i's stream is
derived from (seed, i); sample 0 keeps the request's seed.
"""

from __future__ import annotations

import pytest

from adapter_cache.errors import ResourceExhaustedError
from harness.engine_helpers import make_core, run_to_completion
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.in_process import Engine
from inference_service.engine.request import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    WaitReason,
    sample_request_id,
    sample_seed,
)

BLOCK = 16
PROMPT = [(7 * i) % 200 + 30 for i in range(45)]  # 45 tokens: 2 full blocks before the last token
SHARED = (len(PROMPT) - 1) // BLOCK * BLOCK
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def _add_group(core: EngineCore, n: int, params: SamplingParams = GREEDY, group: str = "g") -> list[Request]:
    requests = []
    for i in range(n):
        request = Request(f"{group}.{i}", PROMPT, params)
        request.group = group
        core.add_request(request, None)
        requests.append(request)
    return requests


def _no_leak(core: EngineCore) -> None:
    core.runner.kv.pool.check()
    assert core.runner.kv.num_used == 0 and not core.has_work()
    assert not core.scheduler.leaders, "a group's hold outlived its leader"


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("chunk", [512, 16])  # whole prefill, and a prompt prefilled over 3 steps
def test_samples_wait_for_the_leaders_blocks_then_hit_them(async_scheduling, chunk):
    core = make_core(async_scheduling=async_scheduling, max_num_batched_tokens=chunk)
    try:
        leader, *siblings = _add_group(core, 3)
        outputs: dict[str, list] = {}
        steps = 0
        while core.has_work():
            steps += 1
            assert steps < 200
            for out in core.step():
                outputs.setdefault(out.request_id, []).append(out)
            for sibling in siblings:
                if sibling.status is not RequestStatus.WAITING or sibling.finished:
                    continue
                if not leader.output_token_ids and not leader.finished:
                    assert sibling.wait_reason is WaitReason.SAMPLES, sibling.wait_reason
            for sibling in siblings:  # admitted only once the leader's prompt blocks were cached
                if sibling.num_cached_tokens >= 0:
                    assert sibling.num_cached_tokens == SHARED, "a sample prefilled the shared prompt again"
        finals = {rid: outs[-1] for rid, outs in outputs.items()}
        assert finals["g.0"].cached_tokens == 0
        assert finals["g.1"].cached_tokens == finals["g.2"].cached_tokens == SHARED
        tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
        assert tokens["g.0"] == tokens["g.1"] == tokens["g.2"], "greedy samples are the same sequence"
        _no_leak(core)
    finally:
        core.shutdown()


def test_prefix_cache_off_prefills_each_sample_at_once():
    core = make_core(prefix_cache=False)
    try:
        requests = _add_group(core, 3)
        core.step()
        assert all(r.status is RequestStatus.RUNNING for r in requests), "nothing to share: nothing held"
        finals = {rid: outs[-1] for rid, outs in run_to_completion(core).items()}
        assert all(out.cached_tokens == 0 for out in finals.values())
        _no_leak(core)
    finally:
        core.shutdown()


def test_a_short_prompt_has_nothing_to_share_and_holds_nothing():
    core = make_core()
    try:
        requests = []
        for i in range(2):
            request = Request(f"s.{i}", PROMPT[:BLOCK], GREEDY)  # no full block before the last token
            request.group = "s"
            core.add_request(request, None)
            requests.append(request)
        core.step()
        assert all(r.status is RequestStatus.RUNNING for r in requests)
        run_to_completion(core)
        _no_leak(core)
    finally:
        core.shutdown()


@pytest.mark.parametrize("when", ["before its first step", "mid-prefill"])
def test_a_cancelled_leader_releases_its_samples(when):
    """A leader cancelled (or failed) before its blocks were cached does not strand the others: they
    leave the hold at the next step and run to their end; every reference is released once."""
    core = make_core(max_num_batched_tokens=16)  # the leader's prompt takes 3 steps
    try:
        leader, *siblings = _add_group(core, 3)
        if when == "mid-prefill":
            core.step()
            assert leader.status is RequestStatus.RUNNING and not leader.output_token_ids
            assert all(s.wait_reason is WaitReason.SAMPLES for s in siblings)
        core.abort(leader.request_id)
        core.abort(leader.request_id)  # idempotent
        finals = {rid: outs[-1] for rid, outs in run_to_completion(core).items()}
        assert finals["g.0"].finish_reason is FinishReason.CANCELLED
        assert finals["g.1"].finish_reason is finals["g.2"].finish_reason is FinishReason.LENGTH
        assert finals["g.1"].generated_tokens == finals["g.2"].generated_tokens == GREEDY.max_new_tokens
        _no_leak(core)
    finally:
        core.shutdown()


def test_cancelling_every_sample_mid_generation_releases_each_once():
    core = make_core()
    try:
        requests = _add_group(core, 4, SamplingParams(max_new_tokens=50, ignore_eos=True, temperature=1.0))
        for _ in range(4):
            core.step()
        assert any(r.status is RequestStatus.RUNNING for r in requests)
        for r in requests:
            core.abort(r.request_id)
            core.abort(r.request_id)
        assert not core.has_work(), "an abort ends a sample at once"
        ended = [out for out in core.step() if out.finished]  # the step hands each its final output
        assert sorted(out.request_id for out in ended) == [r.request_id for r in requests]
        assert {out.finish_reason for out in ended} == {FinishReason.CANCELLED}
        _no_leak(core)
        assert core.lora.stats().references == 0
    finally:
        core.shutdown()


def test_sample_seeds_are_derived_and_distinct():
    assert sample_seed(None, 3) is None
    assert sample_seed(7, 0) == 7
    seeds = [sample_seed(7, i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**64 for s in seeds)
    assert seeds == [sample_seed(7, i) for i in range(16)]
    assert sample_request_id("r", 0, 1) == "r" and sample_request_id("r", 2, 3) == "r.2"


def _samples(engine: Engine, n: int, **params: object) -> list[list[int]]:
    streams = engine.add_samples(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True, **params), n)
    return [[t for out in stream for t in out.new_token_ids] for stream in streams]


def test_add_samples_seeded_reproducible_and_distinct():
    """Through the engine client: a seeded request's n samples are the same on every run, differ from
    each other at temperature 1, and sample 0 is what n = 1 with that seed gives."""
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", max_loras=2, max_lora_rank=8,
                                 kv_cache_bytes=4 << 20))
    engine.start()
    try:
        first = _samples(engine, 3, temperature=1.0, seed=11)
        assert first == _samples(engine, 3, temperature=1.0, seed=11)
        assert len({tuple(s) for s in first}) == 3, first
        assert _samples(engine, 1, temperature=1.0, seed=11) == first[:1]
        unseeded = _samples(engine, 3, temperature=1.0)
        assert len({tuple(s) for s in unseeded}) == 3, "unseeded samples are independent"
        assert len({tuple(s) for s in _samples(engine, 3)}) == 1, "greedy samples are identical"
    finally:
        engine.shutdown()


def test_samples_count_against_the_queue_all_or_none():
    """Each sample takes a place in the request queue (--max-queue + --max-num-seqs streams): n that
    do not all fit are refused whole, leaving no stream open."""
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", max_loras=2, max_lora_rank=8,
                                 kv_cache_bytes=4 << 20, max_queue=2, max_num_seqs=1))
    engine.start()
    try:
        with pytest.raises(ResourceExhaustedError):
            engine.add_samples(PROMPT, GREEDY, 4)
        assert len(engine.streams) == 0, "a refused request left streams open"
        streams = engine.add_samples(PROMPT, GREEDY, 3)
        assert [len([t for out in s for t in out.new_token_ids]) for s in streams] == [GREEDY.max_new_tokens] * 3
    finally:
        engine.shutdown()
