"""Automatic prefix caching in the engine: outputs unchanged, keys that cannot lie, honest gauges.

Greedy outputs with the cache on equal those with it off (multi-turn conversations over mixed
adapters and the base model, chunked prefill, preemption, async scheduling); a hit ends exactly
at a block boundary; a prompt cached entirely still computes its last token; a version swap or
a same-name reload of other weights misses; after every request ends (finished or cancelled) no
block is held, and cached blocks are counted apart.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, run_to_completion
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import Request, SamplingParams
from inference_service.models.loader import builtin_tiny_config

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {f"a{i}": write_tiny_adapter(root / f"a{i}", rank=4 + 2 * i, seed=i) for i in range(3)}


def _core(prefix_cache: bool, adapters: dict[str, Path] | None = None, **kwargs) -> EngineCore:
    config = dict(max_loras=4, max_lora_rank=8, kv_cache_bytes=4 << 20, prefix_cache=prefix_cache)
    config.update(kwargs)
    core = EngineCore(EngineConfig(device="cpu", **config))
    if adapters:
        load_adapters(core, adapters)
    return core


def _run(core: EngineCore, prompts: dict[str, tuple[list[int], str | None]], params=GREEDY
         ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Tokens per request, and the prompt tokens each found cached (the final output's count)."""
    for rid, (tokens, adapter) in prompts.items():
        core.add_request(Request(rid, tokens, params), adapter)
    outputs = run_to_completion(core)
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    cached = {rid: core_cached for rid, outs in outputs.items() for core_cached in [outs[-1].cached_tokens]}
    return tokens, cached


def _conversations(core: EngineCore, turns: int, adapters: list[str | None], seed: int = 0
                   ) -> tuple[list[dict[str, list[int]]], list[dict[str, int]]]:
    """Concurrent conversations sharing a system prompt; each turn resends the whole history."""
    rng = random.Random(seed)
    system = [256] + [rng.randrange(32, 127) for _ in range(40)]
    history = {f"c{i}": system + [rng.randrange(32, 127) for _ in range(rng.randrange(3, 20))]
               for i in range(len(adapters))}
    outputs, cached = [], []
    for turn in range(turns):
        prompts = {f"{c}t{turn}": (history[c], adapters[i]) for i, c in enumerate(history)}
        tokens, hits = _run(core, prompts)
        outputs.append(tokens)
        cached.append(hits)
        for c in history:
            history[c] = history[c] + tokens[f"{c}t{turn}"] + [rng.randrange(32, 127)
                                                                  for _ in range(rng.randrange(1, 12))]
    return outputs, cached


def _no_leak(core: EngineCore) -> None:
    core.runner.kv.pool.check()
    assert core.runner.kv.num_used == 0, "a block is still held after every request ended"
    assert core.lora.stats().references == 0 and not core.has_work()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("budget", [512, 7])  # 7: chunked prefill, from the first uncached token
def test_multi_turn_outputs_unchanged(adapters, async_scheduling, budget):
    names: list[str | None] = ["a0", "a1", None, "a2", "a0", None]
    off = _core(False, adapters, async_scheduling=async_scheduling, max_num_batched_tokens=budget)
    expected, cached_off = _conversations(off, 4, names)
    assert all(n == 0 for turn in cached_off for n in turn.values())
    on = _core(True, adapters, async_scheduling=async_scheduling, max_num_batched_tokens=budget)
    got, cached_on = _conversations(on, 4, names)
    assert got == expected
    # Turn 0's requests are admitted together, before any of them wrote a block: no hits. Later
    # turns hit their history, including the blocks the previous turn decoded.
    for turn in range(1, 4):
        for rid, n in cached_on[turn].items():
            prompt_before = 41 + 12 * turn  # at least: the system prompt and each turn's output
            assert n >= (prompt_before // BLOCK - 1) * BLOCK, (rid, n)
    assert on.scheduler.prefix_hits > 0 and on.scheduler.prefix_hits <= on.scheduler.prefix_queries
    _no_leak(on)
    assert on.runner.kv.num_cached > 0
    _no_leak(off)
    assert off.runner.kv.num_cached == 0
    on.shutdown()
    off.shutdown()


def test_block_boundary_hit_and_entirely_cached_prompt(adapters):
    rng = random.Random(3)
    two_blocks = [256] + [rng.randrange(32, 127) for _ in range(2 * BLOCK - 1)]  # exactly 32 tokens
    longer = two_blocks + [rng.randrange(32, 127) for _ in range(5)]
    plus_one = two_blocks + [77]  # 33 tokens: two full blocks and one token
    cases = [
        # (first prompt, second prompt, tokens the second must find cached)
        (two_blocks, longer, 2 * BLOCK),  # the hit ends exactly at the block boundary
        (plus_one, plus_one, 2 * BLOCK),  # entirely cached but the last token, which is computed
        (two_blocks, two_blocks, BLOCK),  # block-aligned and cached: its last block is recomputed
    ]
    for adapter in (None, "a1"):
        for i, (first, second, hit) in enumerate(cases):
            off = _core(False, adapters)
            on = _core(True, adapters)
            expected, _ = _run(off, {"first": (first, adapter)})
            expected.update(_run(off, {"second": (second, adapter)})[0])
            got, _ = _run(on, {"first": (first, adapter)})
            second_tokens, cached = _run(on, {"second": (second, adapter)})
            got.update(second_tokens)
            assert cached["second"] == hit, (adapter, i, cached)
            assert got == expected, (adapter, i)
            _no_leak(on)
            on.shutdown()
            off.shutdown()


def test_weights_key_the_cache(adapters, tmp_path):
    """The same tokens under the base model, another adapter, a new version of the same name, or a
    reload of other bytes under the same name and URI never hit each other's KV."""
    rng = random.Random(5)
    prompt = [256] + [rng.randrange(32, 127) for _ in range(50)]
    path = tmp_path / "swap"
    shutil.copytree(adapters["a0"], path)
    core = _core(True, {"x": path, "y": adapters["a1"]})
    _, cached = _run(core, {"base": (prompt, None)})
    assert cached["base"] == 0
    _, cached = _run(core, {"base2": (prompt, None), "x": (prompt, "x")})
    assert cached == {"base2": 48, "x": 0}
    _, cached = _run(core, {"y": (prompt, "y"), "x2": (prompt, "x")})
    assert cached == {"y": 0, "x2": 48}

    # A version swap: other weights under the same name must miss, and compute with the new weights.
    load_adapters(core, {"x": adapters["a2"]})
    swapped, cached = _run(core, {"x3": (prompt, "x")})
    assert cached["x3"] == 0
    # A same-name reload of other bytes at the same URI (unload, files replaced, load).
    core.lora.unload_adapter("x").result(timeout=30)
    run_to_completion(core)
    shutil.rmtree(path)
    shutil.copytree(adapters["a1"], path)
    load_adapters(core, {"x": path})
    reloaded, cached = _run(core, {"x4": (prompt, "x")})
    assert cached["x4"] == 0
    _no_leak(core)
    core.shutdown()

    fresh = _core(False, {"a2": adapters["a2"], "a1": adapters["a1"]})
    expected, _ = _run(fresh, {"x3": (prompt, "a2"), "x4": (prompt, "a1")})
    assert swapped["x3"] == expected["x3"] and reloaded["x4"] == expected["x4"]
    fresh.shutdown()


def test_digestless_adapter_restaged_is_a_new_key(adapters, tmp_path):
    """Without a digest, an adapter evicted from its slot and staged again may have read other bytes
    at its URI: its KV from before is not reused."""
    path = tmp_path / "nodigest"
    shutil.copytree(adapters["a0"], path)
    core = _core(True, {"z": path, "a1": adapters["a1"]}, max_loras=1)
    prompt = [256] + list(range(40, 90))
    _, cached = _run(core, {"z1": (prompt, "z")})
    _run(core, {"other": ([256, 50, 51], "a1")})  # takes the only slot: z is evicted
    _, cached = _run(core, {"z2": (prompt, "z")})
    assert cached["z2"] == 0
    _no_leak(core)
    core.shutdown()


def test_salts_key_the_cache(adapters):
    """Requests of other salts (listeners, identities: set by the front end) never hit each other's
    KV, under the base model or an adapter; the same salt hits."""
    core = _core(True, adapters)
    prompt = [256] + list(range(40, 90))
    tenants = [None, (("listener", "grpc"),), (("listener", "grpc"), ("identity", "a")),
               (("listener", "grpc"), ("identity", "b"))]
    for adapter in (None, "a0"):
        for round_ in range(2):
            for i, salt in enumerate(tenants):
                request = Request(f"{adapter}-{round_}-{i}", prompt, GREEDY)
                request.cache_salt = salt
                core.add_request(request, adapter)
                outs = run_to_completion(core)
                assert outs[request.request_id][-1].cached_tokens == (48 if round_ else 0), (adapter, salt)
    _no_leak(core)
    core.shutdown()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_preemption_and_eviction_under_pressure(adapters, async_scheduling):
    """A KV cache too small for the load: requests are preempted (their blocks cached, then hit when
    they return) and cached blocks are evicted for new ones; outputs unchanged."""
    block_bytes = kv_bytes_per_block(builtin_tiny_config(), BLOCK, torch.float32)
    rng = random.Random(9)
    system = [256] + [rng.randrange(32, 127) for _ in range(20)]
    prompts = {f"r{i}": (system + [rng.randrange(32, 127) for _ in range(rng.randrange(2, 30))],
                         [None, "a0", "a1"][i % 3]) for i in range(10)}
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    off = _core(False, adapters)
    expected, _ = _run(off, prompts, params)
    tight = _core(True, adapters, kv_cache_bytes=12 * block_bytes, async_scheduling=async_scheduling)
    got, _ = _run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    assert got == expected
    assert tight.runner.kv.pool.evictions > 0
    _no_leak(tight)
    tight.shutdown()
    off.shutdown()


def test_cancel_storm_drops_each_reference_once(adapters):
    """Requests sharing cached prefixes, cancelled at random steps (before admission, mid-prefill,
    while decoding): afterwards nothing is held and every block is free or cached."""
    core = _core(True, adapters, max_num_batched_tokens=24)
    rng = random.Random(11)
    system = [256] + [rng.randrange(32, 127) for _ in range(47)]
    for wave in range(4):
        ids = []
        for i in range(12):
            rid = f"w{wave}r{i}"
            core.add_request(Request(rid, system + [rng.randrange(32, 127) for _ in range(rng.randrange(1, 40))],
                                     GREEDY), [None, "a0", "a2"][i % 3])
            ids.append(rid)
        for _ in range(rng.randrange(1, 6)):
            core.step()
            for rid in rng.sample(ids, 3):
                core.abort(rid)
        run_to_completion(core)
        _no_leak(core)
    assert core.scheduler.prefix_hits > 0
    core.shutdown()


def _offers(core: EngineCore) -> list[int]:
    """The blocks the scheduler offers the pool to key from now on, in order (a spy on `cache`)."""
    pool, offered = core.runner.kv.pool, []
    keep = pool.cache

    def cache(block: int, block_hash: bytes) -> None:
        offered.append(block)
        keep(block, block_hash)

    pool.cache = cache
    return offered


def test_each_full_block_is_offered_to_the_pool_once(adapters):
    """A long generation keys each block it fills once, when it fills it: the keying work of a
    step does not grow with the context (it went over the whole table every step before). The
    whole conversation is then found cached, up to its last full block."""
    core = _core(True)
    offered = _offers(core)
    rng = random.Random(5)
    prompt = [rng.randrange(32, 127) for _ in range(20)]
    params = SamplingParams(max_new_tokens=150, ignore_eos=True)
    tokens, _ = _run(core, {"long": (prompt, None)}, params)
    computed = len(prompt) + 150 - 1  # the last token sampled is never fed back
    assert len(offered) == computed // BLOCK and len(set(offered)) == len(offered), offered
    history = prompt + tokens["long"]
    _, cached = _run(core, {"next": (history + [65], None)}, GREEDY)
    assert cached["next"] == len(history) // BLOCK * BLOCK
    _no_leak(core)
    core.shutdown()


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_blocks_recomputed_after_preemption_are_keyed_again(async_scheduling):
    """Requests preempted for KV memory drop their blocks and recompute them when they return: after
    every step each running request's full computed blocks are in the pool under its own keys (the
    prompts share nothing, so no block's key can belong to another's copy)."""
    block_bytes = kv_bytes_per_block(builtin_tiny_config(), BLOCK, torch.float32)
    core = _core(True, kv_cache_bytes=10 * block_bytes, async_scheduling=async_scheduling)
    rng = random.Random(21)
    for i in range(6):
        core.add_request(Request(f"r{i}", [rng.randrange(32, 127) for _ in range(rng.randrange(20, 40))],
                                 SamplingParams(max_new_tokens=30, ignore_eos=True)), None)
    pool = core.runner.kv.pool
    while core.has_work():
        core.step()
        # A launched step's tokens count as computed at launch; its blocks are keyed when it completes.
        launched = Counter()
        if core._in_flight is not None:
            launched.update({request.request_id: n for request, n in core._in_flight.batch.items})
        for request in core.scheduler.running:
            done = request.num_computed_tokens - launched[request.request_id]
            full = min(done // BLOCK, len(request.block_table))
            for i in range(full):
                assert pool._hash_of.get(request.block_table[i]) == request.block_hashes[i], (request.request_id, i)
    assert core.scheduler.num_preemptions > 0, "the KV budget did not force preemption"
    _no_leak(core)
    core.shutdown()
