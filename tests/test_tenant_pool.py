"""Tenants' shares of the adapter pool on a real engine (builtin:tiny, real staging and slot copies).

A noisy tenant churns many adapters of its own through the pool while a quiet tenant keeps a few
resident and uses them between the churn's loads: with shares the quiet tenant's adapters are
never evicted (each loaded exactly once) and its tokens are exactly those of a run without the
churn. The same run without shares evicts them (the control: the test sees what it guards).
"""

from __future__ import annotations

import time

import pytest
import torch

from harness.adapters import write_tiny_adapter
from harness.engine_helpers import generate, load_adapters, make_core, run_to_completion
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams, WaitReason
from inference_service.lora.mem_pool import bytes_per_page
from inference_service.models.loader import builtin_tiny_config

POOL_PAGES = 6  # rank-8 adapters in pages of rank 8: one page each
QUIET, NOISY = 3, 12
QUIET_EVERY = 4  # the quiet tenant's requests come every few of the noisy tenant's loads: its adapters idle between
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("tenant-pool")
    return {
        "quiet": {f"q{i}": str(write_tiny_adapter(root / f"q{i}", seed=100 + i, rank=8)) for i in range(QUIET)},
        "noisy": {f"n{i}": str(write_tiny_adapter(root / f"n{i}", seed=200 + i, rank=8)) for i in range(NOISY)},
    }


def _engine(shares: bool) -> EngineCore:
    page = bytes_per_page(builtin_tiny_config().lora_shapes(), 8, torch.float32)
    return make_core(max_loras="auto", lora_page_rank=8, lora_memory_bytes=(POOL_PAGES + 1) * page,
                     adapter_pool_shares={"quiet": QUIET * page, "noisy": 2 * page} if shares else {})


def _quiet_prompts(round_: int) -> dict[str, tuple[list[int], str]]:
    return {f"quiet-{round_}-{name}": ([5 + i, 17, 33, 9 + round_ % 3], name) for i, name in enumerate(
        f"q{i}" for i in range(QUIET))}


def _churn(core: EngineCore, adapters: dict[str, dict[str, str]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Quiet requests between and beside the noisy tenant's loads; (quiet tokens, quiet adapters' loads)."""
    load_adapters(core, {name: path for name, path in adapters["quiet"].items()}, owner="quiet", preload=True)
    load_adapters(core, {name: path for name, path in adapters["noisy"].items()}, owner="noisy")
    tokens: dict[str, list[int]] = {}
    for round_, noisy in enumerate(adapters["noisy"]):
        quiet = round_ % QUIET_EVERY == 0
        if quiet:
            tokens |= generate(core, _quiet_prompts(round_), PARAMS)  # alone
        core.add_request(Request(f"noisy-{round_}", [3, 4, 5], PARAMS), noisy)
        more = f"n{(round_ + 1) % NOISY}"  # two noisy adapters at once: the churn needs room beyond its share
        core.add_request(Request(f"noisy-{round_}b", [6, 7], PARAMS), more)
        if quiet:  # beside the noisy tenant's requests (whose tokens `generate` returns too)
            beside = {f"beside-{k}": v for k, v in _quiet_prompts(round_).items()}
            tokens |= {k: v for k, v in generate(core, beside, PARAMS).items() if k in beside}
        run_to_completion(core)
    loads = {info.name: info.loads for info in core.list_adapters() if info.owner == "quiet"}
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    return tokens, loads


def _alone(adapters: dict[str, dict[str, str]]) -> dict[str, list[int]]:
    """The quiet tenant's tokens with nobody else on the engine."""
    core = _engine(shares=False)
    try:
        load_adapters(core, adapters["quiet"], owner="quiet", preload=True)
        tokens: dict[str, list[int]] = {}
        for round_ in range(0, NOISY, QUIET_EVERY):
            tokens |= generate(core, _quiet_prompts(round_), PARAMS)
            tokens |= generate(core, {f"beside-{k}": v for k, v in _quiet_prompts(round_).items()}, PARAMS)
        return tokens
    finally:
        core.shutdown()


def test_a_noisy_tenants_churn_never_evicts_a_quiet_tenants_adapters(adapters):
    core = _engine(shares=True)
    try:
        tokens, loads = _churn(core, adapters)
        assert loads == dict.fromkeys(adapters["quiet"], 1), "a quiet tenant's adapter was evicted and loaded again"
        assert core.lora.evictions_total >= NOISY - 3, "the noisy tenant did not churn through the pool"
        held = dict(core.lora.stats().pool_bytes_by_owner)
        page = core.lora._pool.page_nbytes
        assert held["quiet"] == QUIET * page
    finally:
        core.shutdown()
    assert tokens == _alone(adapters) and len(tokens) == 2 * QUIET * NOISY // QUIET_EVERY


def test_without_shares_the_same_churn_evicts_the_quiet_tenants_adapters(adapters):
    """The control: one least-recently-used pool for everyone reloads the quiet tenant's adapters."""
    core = _engine(shares=False)
    try:
        _, loads = _churn(core, adapters)
        assert sum(loads.values()) > QUIET
    finally:
        core.shutdown()


def test_shares_that_leave_no_room_outside_them_are_refused_at_start():
    page = bytes_per_page(builtin_tiny_config().lora_shapes(), 8, torch.float32)
    with pytest.raises(ValueError, match="must leave room for an adapter of the largest rank"):
        make_core(max_loras="auto", lora_page_rank=8, lora_memory_bytes=(POOL_PAGES + 1) * page,
                  adapter_pool_shares={"quiet": 3 * page, "noisy": 3 * page})


def test_a_tenants_request_that_cannot_get_room_never_holds_back_a_tenant_within_its_share(adapters):
    """The aging barrier: the noisy tenant's request waits (its own adapters are all in use, the
    quiet tenant's are within its share) past `aging_steps`, and the quiet tenant's later request on
    its resident adapter still runs at once; only the noisy tenant's own later requests wait behind it."""
    page = bytes_per_page(builtin_tiny_config().lora_shapes(), 8, torch.float32)
    core = make_core(max_loras="auto", lora_page_rank=8, lora_memory_bytes=(POOL_PAGES + 1) * page, aging_steps=2,
                     adapter_pool_shares={"quiet": QUIET * page, "noisy": 2 * page})
    try:
        load_adapters(core, adapters["quiet"], owner="quiet", preload=True)
        load_adapters(core, {f"n{i}": adapters["noisy"][f"n{i}"] for i in range(5)}, owner="noisy")
        long = SamplingParams(max_new_tokens=60, ignore_eos=True)
        for i in range(3):  # the free pages: the pool is shared while it has room
            core.add_request(Request(f"noisy-{i}", [3, 4, 5], long), f"n{i}")
        for _ in range(100):
            core.step()
            if all(core.scheduler.requests[f"noisy-{i}"].output_token_ids for i in range(3)):
                break
        core.add_request(Request("stuck", [3, 4, 5], PARAMS), "n3")
        stuck = core.scheduler.requests["stuck"]
        deadline = time.monotonic() + 60  # its staging runs on a host thread
        while not (stuck.wait_reason is WaitReason.SLOTS_FULL and stuck.skipped_steps >= 3):
            assert time.monotonic() < deadline, f"{stuck.wait_reason} after {stuck.skipped_steps} steps"
            core.step()
            time.sleep(0.001)
        assert not stuck.output_token_ids
        core.add_request(Request("quiet", [5, 17, 33], PARAMS), "q0")
        core.add_request(Request("noisy-later", [3, 4, 5], PARAMS), "n4")
        core.step()
        core.step()
        assert core.scheduler.requests["quiet"].output_token_ids, "the quiet tenant waited behind the noisy one"
        assert core.scheduler.requests["noisy-later"].wait_reason is WaitReason.AGING
        run_to_completion(core)
        assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    finally:
        core.shutdown()
