"""LoRAManager, slot pool and overlap loader: the known failure modes, on a real EngineCore.

Loads are held "in flight" with the real copy thread: a gate job submitted to it first makes
every slot copy queue behind it until the gate opens. Each test ends leak-free: zero adapter
references, zero pending loads, zero KV blocks in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from adapter_cache.adapter_format import SUPPORTED_TARGET_MODULES
from adapter_cache.errors import NotFoundError, ResourceExhaustedError
from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, make_core, run_to_completion
from harness.models import AdapterSpec, make_adapter, make_checkpoint, peft_reference
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from inference_service.kernels.copy import CopyJob
from inference_service.lora.registry import AdapterState

ALL_MODULES = tuple(SUPPORTED_TARGET_MODULES)
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 99, 42, 7, 120, 33]


def hold_copies(core: EngineCore) -> threading.Event:
    """Occupy the real copy thread: slot copies submitted from now on wait until the gate is set."""
    gate = threading.Event()
    core.lora._loader.engine.submit(CopyJob(gate.wait))
    return gate


def step_until(core: EngineCore, done: Callable[[], bool], timeout: float = 30.0) -> list:
    outputs = []
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "condition not reached in time"
        outputs += core.step()
        time.sleep(0.001)
    return outputs


def uid_of(core: EngineCore, name: str) -> str:
    return core.lora.uid_of(name)


def tokens_by_request(outputs) -> dict[str, list[int]]:
    result: dict[str, list[int]] = {}
    for out in outputs:
        result.setdefault(out.request_id, []).extend(out.new_token_ids)
    return result


def assert_leak_free(core: EngineCore) -> None:
    step_until(core, lambda: not core.has_work() and not core.lora._loader.pending)
    core.lora.drain()
    assert core.lora.stats().references == 0
    assert not core.lora._loader.pending
    assert core.runner.kv.num_used == 0
    assert core.stats().pending_load_events == 0 and core.stats().adapter_references == 0


def solo_run(adapter_dir: Path | None, prompt: list[int] = PROMPT, params: SamplingParams = GREEDY) -> list[int]:
    """Greedy tokens of one request in a fresh engine holding only this adapter (or none)."""
    core = make_core()
    if adapter_dir is not None:
        load_adapters(core, {"solo": adapter_dir})
    core.add_request(Request("solo", prompt, params), "solo" if adapter_dir else None)
    out = tokens_by_request(o for outs in run_to_completion(core).values() for o in outs)["solo"]
    core.shutdown()
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        "a": write_tiny_adapter(root / "a", seed=1),
        "b": write_tiny_adapter(root / "b", seed=2, modules=("q_proj", "v_proj")),
        "c": write_tiny_adapter(root / "c", seed=3, rank=8, alpha=16),
        "a2": write_tiny_adapter(root / "a2", seed=4, modules=("gate_proj", "up_proj", "down_proj")),
    }


def test_adapters_change_the_output(adapters):
    """Guards every output comparison below against a LoRA path that does nothing."""
    base = solo_run(None)
    outs = {name: solo_run(path) for name, path in adapters.items()}
    assert all(out != base for out in outs.values()), (base, outs)
    assert outs["a"] != outs["a2"]


def test_cancelled_during_load_slot_is_reclaimed(adapters):
    core = make_core(max_loras=1)
    load_adapters(core, {"a": adapters["a"], "b": adapters["b"]})
    uid_a = uid_of(core, "a")
    gate = hold_copies(core)
    for rid in ("a1", "a2"):
        core.add_request(Request(rid, PROMPT, GREEDY), "a")
    step_until(core, lambda: core.lora.state(uid_a) is AdapterState.LOADING)
    for rid in ("a1", "a2"):
        core.abort(rid)
    assert core.lora.stats().references == 0
    finished = {o.request_id: o.finish_reason for o in core.step() if o.finished}
    assert finished == {"a1": FinishReason.CANCELLED, "a2": FinishReason.CANCELLED}
    assert core.lora.state(uid_a) is AdapterState.LOADING  # the copy is still in flight
    gate.set()
    # Drained although no request wants it any more: LOADED, unreferenced, so evictable.
    step_until(core, lambda: not core.lora._loader.pending)
    assert core.lora.state(uid_a) is AdapterState.LOADED and core.lora.slot_of(uid_a) == 0
    assert core.lora.loads_total == 1
    core.add_request(Request("b1", PROMPT, GREEDY), "b")
    outputs = run_to_completion(core)
    assert outputs["b1"][-1].finish_reason is FinishReason.LENGTH
    uid_b = uid_of(core, "b")
    assert core.lora._pool.slot_to_uid == [uid_b] and core.lora.evictions_total == 1
    assert core.lora.state(uid_a) is AdapterState.REGISTERED
    assert tokens_by_request(o for outs in outputs.values() for o in outs)["b1"] == solo_run(adapters["b"])
    assert_leak_free(core)
    core.shutdown()


def test_pending_load_is_not_loaded(adapters):
    core = make_core(max_loras=2)
    load_adapters(core, {"a": adapters["a"]})
    uid = uid_of(core, "a")
    gate = hold_copies(core)
    core.add_request(Request("r", PROMPT, GREEDY), "a")
    step_until(core, lambda: core.lora.state(uid) is AdapterState.LOADING)
    for _ in range(5):  # the slot is assigned, but the copy has not landed: never admitted
        assert core.step() == []
        assert uid in core.lora._pool.uid_to_slot
        assert core.lora.state(uid) is AdapterState.LOADING and core.lora.slot_of(uid) is None
        request = core.scheduler.requests["r"]
        assert request.status is RequestStatus.WAITING and request.wait_reason == "adapter_loading"
        assert core.stats().requests_waiting == {"adapter_loading": 1}
        assert core.stats().pending_load_events == 1
    gate.set()
    outputs = run_to_completion(core)
    assert tokens_by_request(outputs["r"]) == {"r": solo_run(adapters["a"])}
    assert_leak_free(core)
    core.shutdown()


def test_capacity_counts_pending_loads(adapters):
    """2 slots: A running, B loading → a request for C waits (slots_full) and never errors."""
    core = make_core(max_loras=2)
    load_adapters(core, {n: adapters[n] for n in ("a", "b", "c")})
    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    core.add_request(Request("ra", PROMPT, long), "a")
    step_until(core, lambda: core.scheduler.requests["ra"].status is RequestStatus.RUNNING)
    gate = hold_copies(core)
    core.add_request(Request("rb", PROMPT, GREEDY), "b")
    step_until(core, lambda: core.lora.state(uid_of(core, "b")) is AdapterState.LOADING)
    core.add_request(Request("rc", PROMPT, GREEDY), "c")
    # Staging C's host copy needs no slot; once host-ready, no slot is free or evictable.
    outputs = step_until(core, lambda: core.lora.state(uid_of(core, "c")) is AdapterState.HOST_READY)
    for _ in range(5):
        outputs += core.step()
        assert core.scheduler.requests["rc"].wait_reason == "slots_full"
        assert core.lora.state(uid_of(core, "c")) is AdapterState.HOST_READY
        assert core.stats().requests_waiting == {"adapter_loading": 1, "slots_full": 1}
    assert not any(o.finished for o in outputs)
    gate.set()
    outputs += step_until(core, lambda: not core.has_work())
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {"ra": FinishReason.LENGTH, "rb": FinishReason.LENGTH, "rc": FinishReason.LENGTH}
    tokens = tokens_by_request(outputs)
    assert tokens["rc"] == solo_run(adapters["c"]) and tokens["rb"] == solo_run(adapters["b"])
    assert_leak_free(core)
    core.shutdown()


@pytest.mark.parametrize("num_slots", [1, 2, 3])
def test_pinning_never_takes_every_slot(adapters, num_slots):
    core = make_core(max_loras=num_slots)
    names = ["a", "b", "c"]
    load_adapters(core, {n: adapters[n] for n in names})
    pinned = []
    for name in names:
        if len(pinned) + 1 >= num_slots:
            with pytest.raises(ResourceExhaustedError):
                core.lora.load_adapter(name, str(adapters[name]), pinned=True)
            assert not core.lora._registry.resolve(name).pinned
            continue
        future = core.lora.load_adapter(name, str(adapters[name]), pinned=True)  # the same version, now pinned
        step_until(core, future.done)
        assert core.lora.state(future.result().uid) is AdapterState.LOADED
        pinned.append(name)
    assert len(pinned) == num_slots - 1
    # The unpinned slot still serves every other adapter, one after the other.
    unpinned = [n for n in names if n not in pinned]
    for name in unpinned:
        core.add_request(Request(f"r-{name}", PROMPT, GREEDY), name)
    outputs = run_to_completion(core)
    assert {rid for rid, outs in outputs.items() if outs[-1].finish_reason is FinishReason.LENGTH} == {
        f"r-{n}" for n in unpinned
    }
    assert all(core.lora.state(uid_of(core, n)) is AdapterState.LOADED for n in pinned)
    if pinned:  # unloading a pinned adapter gives its slot back to the pool
        step_until(core, core.lora.unload_adapter(pinned[0]).done)
        step_until(core, core.lora.load_adapter(unpinned[0], str(adapters[unpinned[0]]), pinned=True).done)
        assert core.lora._registry.resolve(unpinned[0]).pinned
    assert_leak_free(core)
    core.shutdown()


def test_unload_during_in_flight_load(adapters):
    core = make_core(max_loras=1)
    load_adapters(core, {"a": adapters["a"]})
    uid = uid_of(core, "a")
    gate = hold_copies(core)
    core.add_request(Request("queued", PROMPT, GREEDY), "a")
    step_until(core, lambda: core.lora.state(uid) is AdapterState.LOADING)
    unloaded = core.lora.unload_adapter("a")
    with pytest.raises(NotFoundError):
        core.add_request(Request("late", PROMPT, GREEDY), "a")
    for _ in range(5):
        core.step()
        assert not unloaded.done()
        assert core.lora.state(uid) is AdapterState.DRAINING and core.lora._loader.is_loading(uid)
        assert core.lora._pool.slot_to_uid == [uid]  # the copy in flight keeps its slot
    gate.set()
    outputs = step_until(core, unloaded.done)
    assert unloaded.result() is None
    # The queued request had its reference: it finished on the unloaded adapter first.
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.LENGTH]
    assert tokens_by_request(outputs)["queued"] == solo_run(adapters["a"])
    assert core.lora._pool.slot_to_uid == [None] and core.lora._pool.uid_to_slot == {}
    assert uid not in core.lora._registry.versions and "a" not in core.lora._registry.current
    with pytest.raises(NotFoundError):
        core.add_request(Request("later", PROMPT, GREEDY), "a")
    assert_leak_free(core)
    core.shutdown()


def test_unload_during_in_flight_load_without_requests(adapters):
    """A preload in flight: unload resolves once the copy landed, the slot is then free."""
    core = make_core(max_loras=1)
    gate = hold_copies(core)
    loaded = core.lora.load_adapter("a", str(adapters["a"]), preload=True)
    step_until(core, lambda: bool(core.lora._loader.pending))
    unloaded = core.lora.unload_adapter("a")
    time.sleep(0.05)
    core.step()
    assert not unloaded.done() and core.lora._pool.slot_to_uid == ["a@1"]
    gate.set()
    step_until(core, unloaded.done)
    assert loaded.done() and core.lora._pool.slot_to_uid == [None] and not core.lora._registry.versions
    assert_leak_free(core)
    core.shutdown()


def test_unload_while_staging_resolves_the_load(adapters):
    """Found by the state machine: a LoadAdapter whose version was unloaded while staging hung forever."""
    core = make_core(max_loras=1)
    load_adapters(core, {"a": adapters["a"]})
    newer = core.lora.load_adapter("a", str(adapters["a2"]), preload=True)  # staging on the host pool
    core.lora.unload_adapter("a")
    step_until(core, newer.done)
    with pytest.raises(NotFoundError):
        newer.result()
    assert not core.lora._registry.versions and not core.lora._registry.current
    assert_leak_free(core)
    core.shutdown()


def test_version_swap_order_last_load_wins(adapters):
    """Two swaps in flight: the later LoadAdapter wins even when the earlier one gets ready last."""
    core = make_core(max_loras=2)
    load_adapters(core, {"a": adapters["a"]})
    release = threading.Event()
    real_fetch = core.lora._source.fetch

    def fetch(uri: str, sha256: str | None, host_form=None):
        if uri == str(adapters["b"]):
            release.wait(10)  # this version's staging finishes last
        return real_fetch(uri, sha256, host_form)

    core.lora._source.fetch = fetch  # type: ignore[method-assign]
    slow = core.lora.load_adapter("a", str(adapters["b"]))
    fast = core.lora.load_adapter("a", str(adapters["c"]))
    step_until(core, fast.done)
    assert fast.result().version == 3
    release.set()
    step_until(core, slow.done)
    assert slow.exception() is not None
    assert uid_of(core, "a") == "a@3" and set(core.lora._registry.versions) == {"a@3"}
    assert_leak_free(core)
    core.shutdown()


@pytest.mark.parametrize("num_slots", [1, 2])
def test_version_swap_with_request_in_flight(adapters, num_slots):
    core = make_core(max_loras=num_slots)
    load_adapters(core, {"a": adapters["a"]})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    core.add_request(Request("old", PROMPT, params), "a")
    outputs = step_until(core, lambda: len(core.scheduler.requests["old"].output_token_ids) >= 2)
    swap = core.lora.load_adapter("a", str(adapters["a2"]))
    outputs += step_until(core, swap.done)
    v1, v2 = "a@1", swap.result().uid
    assert v2 == "a@2" and uid_of(core, "a") == v2
    assert core.lora.state(v1) is AdapterState.DRAINING and core.scheduler.requests["old"].adapter_uid == v1
    core.add_request(Request("new", PROMPT, params), "a")
    assert core.scheduler.requests["new"].adapter_uid == v2
    seen_draining = False
    while core.has_work():
        seen_draining |= v1 in core.lora._registry.versions and core.lora.state(v1) is AdapterState.DRAINING
        outputs += core.step()
    assert seen_draining
    tokens = tokens_by_request(outputs)
    assert tokens["old"] == solo_run(adapters["a"], params=params)
    assert tokens["new"] == solo_run(adapters["a2"], params=params)
    assert tokens["old"] != tokens["new"]
    core.lora.drain()
    assert v1 not in core.lora._registry.versions and v1 not in core.lora._pool.uid_to_slot
    assert core.lora._pool.uid_to_slot.get(v2) is not None
    assert_leak_free(core)
    core.shutdown()


# ---- a reused slot leaks nothing: against transformers + PEFT ----

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    checkpoint = make_checkpoint(root / "model", "llama", seed=5)
    x = make_adapter(checkpoint, root / "x", AdapterSpec("x", 8, 16, seed=11))  # all 7 modules
    y = make_adapter(checkpoint, root / "y", AdapterSpec("y", 4, 8, ("q_proj", "v_proj"), seed=12))
    return checkpoint, x, y


def _logits(core: EngineCore, rid: str, adapter: str) -> torch.Tensor:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True)
    core.add_request(Request(rid, PROMPT, params), adapter)
    outputs = run_to_completion(core)
    return torch.stack([x for o in outputs[rid] for x in (o.logits or [])])


def test_reused_slot_leaks_nothing(hf_setup):
    checkpoint, x, y = hf_setup
    config = dict(model=str(checkpoint), max_loras=1, max_lora_rank=8, kv_cache_bytes=4 << 20)
    core = EngineCore(EngineConfig(device="cpu", **config))
    load_adapters(core, {"x": x, "y": y})
    _logits(core, "on-x", "x")
    assert core.lora._pool.slot_to_uid == [uid_of(core, "x")]
    reused = _logits(core, "on-y", "y")  # evicts x, overwrites the same slot
    assert core.lora._pool.slot_to_uid == [uid_of(core, "y")] and core.lora.evictions_total == 1
    assert_leak_free(core)
    core.shutdown()

    fresh_core = EngineCore(EngineConfig(device="cpu", **config))
    load_adapters(fresh_core, {"y": y})
    fresh = _logits(fresh_core, "fresh", "y")
    fresh_core.shutdown()
    assert torch.equal(reused, fresh)

    model = peft_reference(checkpoint, {"y": y})
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            adapter_names=["y"], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    ref = torch.cat(out.logits).float()
    assert reused.shape == ref.shape
    assert (reused - ref).abs().max().item() < 1e-4


def test_swapping_a_pinned_adapter_is_not_refused(adapters):
    """2 slots, A pinned: a pinned new version of A replaces A's pin, it does not add one."""
    core = make_core(max_loras=2)
    step_until(core, core.lora.load_adapter("a", str(adapters["a"]), pinned=True).done)
    swap = core.lora.load_adapter("a", str(adapters["a2"]), pinned=True)
    step_until(core, swap.done)
    v2 = swap.result()
    assert v2.pinned and core.lora.state(v2.uid) is AdapterState.LOADED
    assert set(core.lora._registry.versions) == {v2.uid}
    with pytest.raises(ResourceExhaustedError):  # still one unpinned slot only
        core.lora.load_adapter("b", str(adapters["b"]), pinned=True)
    assert_leak_free(core)
    core.shutdown()


def test_memory_per_resident_adapter_is_its_real_size(tmp_path):
    """The pool sized by memory: a resident adapter's pages are its real size within one page's
    rounding (rank 8 takes half of rank 16; rank 4 in pages of 8 rows rounds up to one page), and
    the bytes gauge counts exactly those pages."""
    core = EngineCore(EngineConfig(model="builtin:tiny", device="cpu", max_loras="auto", lora_page_rank=8,
                                   max_lora_rank=16, lora_memory_bytes=16 << 20, kv_cache_bytes=4 << 20))
    try:
        paths = {f"r{rank}": write_tiny_adapter(tmp_path / f"r{rank}", seed=rank, rank=rank) for rank in (4, 8, 16)}
        load_adapters(core, paths, preload=True)
        pool = core.lora._pool
        shapes = core.runner.model.config.lora_shapes()
        # Real size: A [r, in] and B [out, r] of every module of every layer, in the pool's dtype.
        real_per_rank = sum(i + o for i, o in shapes.features.values()) * shapes.num_layers * pool.dtype.itemsize
        used = {}
        for name, rank in (("r4", 4), ("r8", 8), ("r16", 16)):
            pages = pool.uid_to_pages[uid_of(core, name)]
            used[rank] = len(pages) * pool.page_nbytes
            assert used[rank] - rank * real_per_rank < pool.page_nbytes, (rank, used[rank])
            assert used[rank] >= rank * real_per_rank
        assert used[8] * 2 == used[16] and used[4] == used[8]  # rank 4 rounds up to one page of 8 rows
        stats = core.lora.stats()
        assert stats.pool_bytes_used == sum(used.values())
        assert stats.resident_by_rank == ((4, 1), (8, 1), (16, 1))
        assert stats.pool_bytes_total == pool.num_pages * pool.page_nbytes <= 16 << 20
    finally:
        core.shutdown()
