"""A Hypothesis state machine over EngineCore + LoRAManager: the slot pool invariants of docs/architecture.md,
for the fixed-slot pool (`--max-loras N`) and the pool sized by memory (pages of rank rows).

Rules: load / version-swap an adapter (optionally pinned or preloaded, owned by a tenant or shared; some pools give
tenants shares of the pool), pin (the same version loaded pinned), unload,
start a request (an adapter or the base model; a tenant and a priority, so fair-share and priority
preemptions happen) or a request's n samples (a group: the scheduler holds the
samples after the first until its prompt blocks are cached; every plan checks no sample was admitted before,
and none is held once its leader ended or has its first token), abort one, run a scheduler step, and complete any
host staging or slot copy in any order. After every rule every invariant of "Slot pool
invariants" is checked, the slot buffers against the adapters' own tensors; every forward pass
is checked as it is issued; at the end every request is ended and nothing may be left over. Every load that
evicts is checked against the shares (lora/pool_shares.py): a tenant within its share never loses an adapter to
another tenant, and an owner at or over its share evicts its own idle adapters before anyone else's.

Host staging and slot copies run on hand-driven test doubles (`ManualExecutor`,
`ManualCopyEngine`). They exist only to force completion orders a real thread pool and a single
FIFO copy thread would rarely or never produce; the work they run is the real one (reading the
PEFT files, copying into the slot buffers).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from adapter_cache.adapter_format import load_adapter_dir
from adapter_cache.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from harness.adapters import write_tiny_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams, TenantTag, WaitReason
from inference_service.lora.manager import LoRAManager
from inference_service.lora.mem_pool import bytes_per_page
from inference_service.lora.registry import AdapterState
from inference_service.models.loader import builtin_tiny_config

# 200 examples x up to 60 rules (400 x 60 took 89 s in CI on a loaded 2-core machine; 1,500 x 80 found
# nothing more than 400 x 60).
MAX_EXAMPLES = 200
STEPS = 60
MAX_RANK = 8
NAMES = ("a", "b", "c")
OWNERS = (None, "t1", "t2")  # adapters' tenants (None: shared)
TENANTS = (None, TenantTag("x"), TenantTag("y", weight=2.0), TenantTag("z", max_running=1))
# Different ranks, scalings and target modules, so a reused slot must be fully overwritten.
URI_SPECS = [
    dict(seed=1, rank=4, alpha=8.0),  # all 7 modules
    dict(seed=2, rank=8, alpha=16.0, modules=("q_proj", "v_proj")),
    dict(seed=3, rank=2, alpha=2.0, modules=("gate_proj", "up_proj", "down_proj")),
    dict(seed=4, rank=8, alpha=4.0, modules=("o_proj", "k_proj")),
]
KV_BLOCK_BYTES = 2 * 2 * 16 * 64 * 4  # K and V, 2 layers, 16 tokens, 2 kv heads x 32, fp32


class _ManualHandle:
    def __init__(self, copy: Callable[[], None]) -> None:
        self._copy, self.ran = copy, False

    def run(self) -> None:
        if not self.ran:
            with torch.no_grad():
                self._copy()
            self.ran = True

    def done(self) -> bool:
        return self.ran

    def wait(self) -> None:
        self.run()

    def before_use(self) -> None:
        self.run()  # only reached unfinished from shutdown's wait


class ManualCopyEngine:
    """Copy engine whose real slot copies run when the state machine completes them (any order)."""

    def __init__(self) -> None:
        self.queued: list[_ManualHandle] = []

    def submit(self, copy: Callable[[], None]) -> _ManualHandle:
        handle = _ManualHandle(copy)
        self.queued.append(handle)
        return handle

    def complete(self, index: int) -> None:
        self.queued.pop(index).run()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def computing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        while self.queued:
            self.complete(0)


class ManualExecutor(concurrent.futures.Executor):
    """Host-preparation executor whose jobs run when the state machine completes them (any order)."""

    def __init__(self) -> None:
        self.queued: list[tuple[concurrent.futures.Future, Callable, tuple, dict]] = []

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:  # type: ignore[override]
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.queued.append((future, fn, args, kwargs))
        return future

    def complete(self, index: int) -> None:
        future, fn, args, kwargs = self.queued.pop(index)
        if not future.set_running_or_notify_cancel():
            return  # cancelled (the version was unloaded while staging)
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the manager like a thread pool would
            future.set_exception(exc)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for future, *_ in self.queued:
            future.cancel()
        self.queued.clear()


PAGE_RANK = 4  # the paged pools': ranks 2 and 4 take one page, rank 8 two
PADDED = 2 * MAX_RANK  # rank rows past the largest rank, enough for any page rounding here


def _expected_slot(path: Path) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """What an adapter's pages must hold, in rank order: padded A, alpha/r-scaled padded B, zeros where absent."""
    shapes = builtin_tiny_config().lora_shapes()
    host = load_adapter_dir(path, shapes, MAX_RANK)
    expected = {}
    for layer in range(shapes.num_layers):
        for module, (in_features, out_features) in shapes.features.items():
            a_exp, b_exp = torch.zeros(PADDED, in_features), torch.zeros(out_features, PADDED)
            if (layer, module) in host.modules:
                a, b, scaling = host.modules[(layer, module)]
                rank = a.shape[0]
                a_exp[:rank] = a
                b_exp[:, :rank] = b
                b_exp[:, :rank].mul_(scaling)
            expected[(layer, module)] = (a_exp, b_exp)
    return expected


@pytest.fixture(scope="module")
def uris(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("sm-adapters")
    return [str(write_tiny_adapter(root / f"u{i}", **spec)) for i, spec in enumerate(URI_SPECS)]


class SlotPoolMachine(RuleBasedStateMachine):
    uris: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.core: EngineCore | None = None
        self.expected = {uri: _expected_slot(Path(uri)) for uri in self.uris}
        self.live: dict[str, str | None] = {}  # request id → adapter uid (None: base model)
        self.aborted: set[str] = set()
        self.ids = 0
        self.load_futures: list[concurrent.futures.Future] = []
        self.unload_futures: list[concurrent.futures.Future] = []
        self.newest_current: dict[str, int] = {}
        self.prev_pages: dict[str, tuple[int, ...]] = {}
        self.prev_protected: set[str] = set()
        self.prev_pinned: set[str] = set()
        self.batches = 0
        self.leaders: dict[str, str] = {}  # sample group -> the request id of its first sample

    # ---- setup ----

    @initialize(
        slots=st.integers(1, 3), kv_blocks=st.sampled_from([4, 64]), max_num_seqs=st.sampled_from([2, 64]),
        async_scheduling=st.sampled_from(["off", "on"]), pages=st.sampled_from([None, 2, 3, 5, 7]),
        shared_tenants=st.integers(0, 2), extra=st.integers(0, 1),
    )
    def setup(self, slots: int, kv_blocks: int, max_num_seqs: int, async_scheduling: str, pages: int | None,
              shared_tenants: int, extra: int) -> None:
        """`pages`: None, the fixed-slot pool of `slots` slots; else the pool sized by memory, with
        room for that many pages of PAGE_RANK rows (a rank-8 adapter takes 2). `shared_tenants`: how
        many of t1, t2 get a share of the pool (an adapter of the largest rank, `extra` pages more for
        t1), as many as leave room for one such adapter outside the shares."""
        self.executor, self.copies = ManualExecutor(), ManualCopyEngine()

        def manager(**kwargs: object) -> LoRAManager:
            return LoRAManager(**{**kwargs, "host_executor": self.executor})  # type: ignore[arg-type]

        pool: dict = {"max_loras": slots}
        num_pages, largest = slots, 1
        per_page = bytes_per_page(builtin_tiny_config().lora_shapes(), MAX_RANK, torch.float32)
        if pages is not None:
            per_page = bytes_per_page(builtin_tiny_config().lora_shapes(), PAGE_RANK, torch.float32)
            pool = {"max_loras": "auto", "lora_page_rank": PAGE_RANK, "lora_memory_bytes": (pages + 1) * per_page}
            num_pages, largest = pages, 2
        shares: dict[str, int] = {}
        for tenant in OWNERS[1:][:shared_tenants]:
            share = largest + (extra if tenant == "t1" else 0)
            if sum(shares.values()) + share + largest <= num_pages:
                shares[tenant] = share * per_page
        config = EngineConfig(
            model="builtin:tiny", device="cpu", **pool, max_lora_rank=MAX_RANK,
            kv_cache_bytes=kv_blocks * KV_BLOCK_BYTES,
            max_num_seqs=max_num_seqs, aging_steps=10**9,  # no aging barrier: every queued request's adapter is needed
            async_scheduling=async_scheduling,  # on: each step runs on the device worker while the next is planned
            adapter_pool_shares=shares,
        )
        with mock.patch("inference_service.engine.core.LoRAManager", manager), \
                mock.patch("inference_service.engine.core.make_copy_engine", lambda *a: self.copies):
            self.core = EngineCore(config)
        assert self.core.runner.kv.num_blocks == kv_blocks
        if pages is not None:
            assert self.lora._pool.num_pages == pages and self.lora._pool.max_adapters is None
        assert self.lora._pool.shares.pages == {t: b // per_page for t, b in shares.items()}
        self._check_evictions_by_share()
        real_plan = self.core.runner.plan

        def checked_plan(batch):  # every step is planned here, with or without async scheduling
            self._check_batch(batch)
            return real_plan(batch)

        self.core.runner.plan = checked_plan  # type: ignore[method-assign]

    # ---- rules ----

    @rule(name=st.sampled_from(NAMES), uri=st.integers(0, len(URI_SPECS) - 1), pinned=st.booleans(),
          preload=st.booleans(), owner=st.sampled_from(OWNERS))
    def load(self, name: str, uri: int, pinned: bool, preload: bool, owner: str | None) -> None:
        """Register, re-register or version-swap (a different URI or owner) an adapter."""
        self._load(lambda: self.lora.load_adapter(name, self.uris[uri], pinned=pinned, preload=preload, owner=owner),
                   name, pinned, self.uris[uri], owner)

    @precondition(lambda self: self.core is not None and bool(self.lora._registry.current))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.lora._registry.current)))
        current = self.lora._registry.resolve(name)
        self._load(lambda: self.lora.load_adapter(name, current.uri, current.sha256, pinned=True, owner=current.owner),
                   name, True, current.uri, current.owner)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        if name not in self.lora._registry.current:
            with pytest.raises(NotFoundError):
                self.lora.unload_adapter(name)
            return
        self.unload_futures.append(self.lora.unload_adapter(name))
        assert name not in self.lora._registry.current

    @rule(name=st.sampled_from((None, *NAMES)), prompt_len=st.integers(1, 40), new_tokens=st.integers(1, 4),
          tenant=st.sampled_from(TENANTS), priority=st.sampled_from((0, 0, 2, -1)))
    def start_request(self, name: str | None, prompt_len: int, new_tokens: int, tenant: TenantTag | None,
                      priority: int) -> None:
        """A request of a tenant (fair share: admission by served tokens, preemption for a seat) at a
        priority (preemption for a seat or for KV memory)."""
        rid = f"r{self.ids}"
        self.ids += 1
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        prompt = [(7 * i + self.ids) % 250 + 3 for i in range(prompt_len)]
        self.core.validate(prompt, params)
        request = Request(rid, prompt, params)
        request.tenant, request.priority = tenant, priority
        if name is not None and name not in self.lora._registry.current:
            with pytest.raises(NotFoundError):
                self.core.add_request(request, name)
            return
        self.core.add_request(request, name)
        uid = self.core.scheduler.requests[rid].adapter_uid
        assert uid == (self.lora.uid_of(name) if name else None)  # new requests get the current version
        self.live[rid] = uid

    @rule(tenant=st.sampled_from(TENANTS[1:]), count=st.integers(2, 4), prompt_len=st.integers(1, 40),
          new_tokens=st.integers(4, 10))
    def start_burst(self, tenant: TenantTag, count: int, prompt_len: int, new_tokens: int) -> None:
        """Several longer base-model requests of one tenant at once: with a small batch, another
        tenant's next request preempts one of them for a seat (paused, then resumed or its blocks
        dropped under memory pressure)."""
        for _ in range(count):
            self.start_request(None, prompt_len, new_tokens, tenant, 0)

    @rule(name=st.sampled_from((None, *NAMES)), prompt_len=st.integers(1, 40), new_tokens=st.integers(1, 4),
          n=st.integers(2, 3))
    def start_samples(self, name: str | None, prompt_len: int, new_tokens: int, n: int) -> None:
        """A request's n samples: n requests of one group, the first its leader."""
        if name is not None and name not in self.lora._registry.current:
            return  # NotFoundError, as start_request shows
        group = f"g{self.ids}"
        self.ids += 1
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        prompt = [(5 * i + self.ids) % 250 + 3 for i in range(prompt_len)]
        for i in range(n):
            rid = f"{group}.{i}"
            request = Request(rid, prompt, params)
            request.group = group
            self.core.add_request(request, name)
            self.live[rid] = self.core.scheduler.requests[rid].adapter_uid
        self.leaders[group] = f"{group}.0"

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.core.abort(rid)
        self.core.abort(rid)  # idempotent: the reference is released once
        del self.live[rid]
        self.aborted.add(rid)

    @rule()
    def step(self) -> None:
        for output in self.core.step():
            if not output.finished:
                continue
            if output.request_id in self.aborted:
                assert output.finish_reason is FinishReason.CANCELLED
                self.aborted.discard(output.request_id)
            else:
                assert output.finish_reason is FinishReason.LENGTH, (output.finish_reason, output.error)
                del self.live[output.request_id]

    @precondition(lambda self: self.core is not None and bool(self.copies.queued))
    @rule(data=st.data())
    def complete_copy(self, data: st.DataObject) -> None:
        self.copies.complete(data.draw(st.integers(0, len(self.copies.queued) - 1)))

    @precondition(lambda self: self.core is not None and bool(self.executor.queued))
    @rule(data=st.data())
    def complete_staging(self, data: st.DataObject) -> None:
        self.executor.complete(data.draw(st.integers(0, len(self.executor.queued) - 1)))

    @rule(rounds=st.integers(1, 8))
    def settle(self, rounds: int) -> None:
        """The common case, to reach deep states: stagings and copies finish in order between steps."""
        for _ in range(rounds):
            self._complete_next_in_order()
            self.step()
            self.slot_pool_invariants()

    def _complete_next_in_order(self) -> None:
        """The oldest queued staging, then the oldest queued copy, checking invariants after each."""
        if self.executor.queued:
            self.executor.complete(0)
            self.slot_pool_invariants()
        if self.copies.queued:
            self.copies.complete(0)
            self.slot_pool_invariants()

    # ---- invariants ----

    @invariant()
    def slot_pool_invariants(self) -> None:
        if self.core is None:
            return
        lora, pool, registry = self.lora, self.lora._pool, self.lora._registry
        # uid_to_pages / page_to_uid are one mapping over known versions: pages disjoint, free pages
        # exactly the unowned ones.
        assert len(pool.page_to_uid) == pool.num_pages
        owned = {page: uid for uid, pages in pool.uid_to_pages.items() for page in pages}
        assert sum(map(len, pool.uid_to_pages.values())) == len(owned)
        assert {p: u for p, u in enumerate(pool.page_to_uid) if u is not None} == owned
        assert pool.free_pages == pool.num_pages - len(owned)
        assert set(pool.uid_to_pages) <= set(registry.versions)
        # An adapter takes memory in proportion to its rank: its pages hold its rank, within one page.
        for uid, pages in pool.uid_to_pages.items():
            assert len(pages) == pool.pages_for(registry.versions[uid].rank), (uid, pages)
        if pool.max_adapters is not None:
            assert len(pool.uid_to_pages) <= pool.max_adapters
        # LOADING ⇔ a pending load; LOADED ⇔ no pending load and in uid_to_pages. A pending load
        # holds its pages, so pending loads count against capacity.
        for uid, pending in lora._loader.pending.items():
            assert pool.slot_of(uid) == pending.slot
        for uid, entry in registry.versions.items():
            state = lora.state(uid)
            loading = lora._loader.is_loading(uid)
            if not entry.draining and entry.failure is None:
                assert (state is AdapterState.LOADING) == loading, (uid, state)
                assert (state is AdapterState.LOADED) == (not loading and uid in pool.uid_to_pages), (uid, state)
            assert (lora.slot_of(uid) is not None) == (not loading and uid in pool.uid_to_pages)
        # Pinning never takes every slot: room for one more adapter of the largest rank stays.
        pinned_now = self._pinned()
        if pool.max_adapters is not None:
            n = pool.max_adapters
            assert len({registry.versions[u].name for u in pinned_now}) < n
            assert sum(1 for uid in pool.uid_to_pages if uid in pinned_now) < n
        else:
            # Per name (a later pinned version of a name replaces the earlier), at the largest rank until staged.
            by_name: dict[str, int] = {}
            for u in pinned_now:
                v = registry.versions[u]
                by_name[v.name] = max(by_name.get(v.name, 0), pool.pages_for(v.rank or MAX_RANK))
            assert sum(by_name.values()) + pool.pages_for(MAX_RANK) <= pool.num_pages
            resident = sum(len(pages) for u, pages in pool.uid_to_pages.items() if u in pinned_now)
            assert resident + pool.pages_for(MAX_RANK) <= pool.num_pages
        # And none takes every page of a share (or of the part no share holds): per group, as above.
        if pool.shares:
            by_group: dict[tuple[str | None, str], int] = {}
            for u in pinned_now:
                v = registry.versions[u]
                group = v.owner if pool.shares.share(v.owner) is not None else None
                by_group[(group, v.name)] = max(by_group.get((group, v.name), 0), pool.pages_for(v.rank or MAX_RANK))
            for group in {g for g, _ in by_group}:
                total = sum(p for (g, _), p in by_group.items() if g == group)
                assert total + pool.pages_for(MAX_RANK) <= pool.shares.pin_budget(group, pool.num_pages), group
        # An adapter that was protected before the last rule still holds the same pages.
        protected = self.prev_protected - (self.prev_pinned - pinned_now)
        for uid, pages in self.prev_pages.items():
            if uid in protected:
                assert pool.uid_to_pages.get(uid) == pages, f"{uid} was evicted or its pages overwritten"
        # Every loaded adapter's pages hold exactly its adapter: reused pages fully overwritten.
        for uid in pool.uid_to_pages:
            if not lora._loader.is_loading(uid):
                self._check_slot(uid)
        # References equal the live requests; KV blocks are exactly theirs.
        assert set(self.core.scheduler.requests) == set(self.live)
        for uid, entry in registry.versions.items():
            assert entry.refs == {rid for rid, u in self.live.items() if u == uid}, uid
        assert all(u is None or u in registry.versions for u in self.live.values())
        # Fair share: exactly the live requests' tenants are live, each counted once per request.
        requests = self.core.scheduler.requests.values()
        assert self.core.scheduler.fair.live == Counter(r.tenant.name if r.tenant else "" for r in requests)
        assert set(self.core.scheduler.fair.counters) == set(self.core.scheduler.fair.live)
        # Held blocks are exactly the live tables' (prefix-cache hits share blocks: counted once).
        blocks = {b for r in self.core.scheduler.requests.values() for b in r.block_table}
        assert self.core.runner.kv.num_used == len(blocks)
        self.core.runner.kv.pool.check()
        # The version new requests get never goes back (a later LoadAdapter wins).
        for name, uid in registry.current.items():
            version = registry.versions[uid].version
            assert version >= self.newest_current.get(name, 0), (name, version)
            self.newest_current[name] = version
        # Snapshot for the next rule: what must not be evicted or overwritten meanwhile.
        self.prev_pages = dict(pool.uid_to_pages)
        self.prev_pinned = pinned_now
        self.prev_protected = (
            {u for u in self.live.values() if u is not None}
            | pinned_now
            | {uid for uid, p in lora._loader.pending.items() if not p.handle.done()}
        )

    def teardown(self) -> None:
        if self.core is None:
            return
        try:
            self._end_everything()
        finally:
            self.core.shutdown()

    # ---- helpers ----

    @property
    def lora(self) -> LoRAManager:
        assert self.core is not None
        return self.core.lora

    def _check_evictions_by_share(self) -> None:
        """Wrap the manager's slot loads: each one's capacity evictions, in order, must follow the shares."""
        lora = self.lora
        real_start, real_evict = lora._start_slot_load, lora._evict
        evicted: list[str] = []

        def recording_evict(uid: str, cause: str, why: str = "") -> None:
            if cause == "capacity":
                evicted.append(uid)
            real_evict(uid, cause, why)

        def checked_start(entry, needed: set[str]) -> bool:
            pool, shares = lora._pool, lora._pool.shares
            held, owners = pool.pages_by_owner(), dict(pool.uid_to_owner)
            pages = {uid: len(p) for uid, p in pool.uid_to_pages.items()}
            evictable = set(pool.uid_to_pages) - lora.unevictable(needed | {entry.uid})
            wanted, requester = pool.pages_for(entry.host.rank), entry.owner
            fits = wanted <= pool.free_pages and (pool.max_adapters is None or len(pages) < pool.max_adapters)
            evicted.clear()
            started = real_start(entry, needed)
            if fits or not started:
                assert not evicted, "evicted while the pool had room, or for a load that did not start"
            within = shares.within(requester, held, wanted)
            left = Counter(held)
            for i, uid in enumerate(evicted):
                owner = owners[uid]
                assert uid in evictable
                if owner != requester:
                    # A tenant within its share never loses an adapter to another tenant.
                    assert shares.unprotected(owner, left), f"{uid} of {owner} evicted for {entry.uid} of {requester}"
                    if shares.share(requester) is not None and not within:
                        mine = {u for u in evictable if owners[u] == requester}
                        assert mine <= set(evicted[:i]), f"{uid} evicted before {requester}'s own {mine}"
                left[owner] -= pages[uid]
            return started

        lora._start_slot_load = checked_start  # type: ignore[method-assign]
        lora._evict = recording_evict  # type: ignore[method-assign]

    def _pinned(self) -> set[str]:
        return {v.uid for v in self.lora._registry.versions.values() if v.pinned and not v.draining}

    def _load(self, call: Callable[[], concurrent.futures.Future], name: str, pinned: bool, uri: str,
              owner: str | None) -> None:
        registry = self.lora._registry
        current = registry.versions[registry.current[name]] if name in registry.current else None
        same = current is not None and current.uri == uri and current.owner == owner
        already_pinned = same and current.pinned
        # The manager counts pinned versions of the other names (a swap replaces this name's).
        others = [v for v in registry.versions.values() if v.pinned and not v.draining and v.name != name]
        pool = self.lora._pool
        if pool.max_adapters is not None:
            full = len(others) + 1 >= pool.max_adapters
        mine = pool.pages_for((current.rank if same else 0) or MAX_RANK)
        if pool.max_adapters is None:  # pages: the others' and this one's (at the largest rank until staged) leave room
            full = sum(pool.pages_for(v.rank or MAX_RANK) for v in others) + mine + pool.pages_for(MAX_RANK) \
                > pool.num_pages
        shares = pool.shares
        if shares:  # and so do those of its share (or of the part no share holds)
            group = sum(pool.pages_for(v.rank or MAX_RANK) for v in others if shares.in_group(owner, v.owner))
            full = full or group + mine + pool.pages_for(MAX_RANK) > shares.pin_budget(owner, pool.num_pages)
        refused = pinned and not already_pinned and full
        try:
            self.load_futures.append(call())
        except ResourceExhaustedError:
            assert refused
            return
        assert not refused

    def _check_slot(self, uid: str) -> None:
        expected = self.expected[self.lora._registry.versions[uid].uri]
        pool = self.lora._pool
        rows = pool.page_rank
        for key, (a_buf, b_buf) in pool.buffers.items():
            a_exp, b_exp = expected[key]
            for k, page in enumerate(pool.uid_to_pages[uid]):
                part = slice(k * rows, (k + 1) * rows)
                assert torch.equal(a_buf[page], a_exp[part]), f"page {page} ({uid}) A of {key} is not its adapter's"
                assert torch.equal(b_buf[page], b_exp[:, part]), f"page {page} ({uid}) B of {key} is not its adapter's"

    def _check_batch(self, batch) -> None:
        """At every step's plan: each adapter is LOADED with exactly its weights; no more adapters than
        slots. (A live request's reference keeps its slot from reloading until its step has run: the
        invariants check protected slots are never overwritten.)"""
        self.batches += 1
        uids = {r.adapter_uid for r, _ in batch.items if r.adapter_uid is not None}
        pool = self.lora._pool
        assert pool.max_adapters is None or len(uids) <= pool.max_adapters
        assert sum(len(pool.uid_to_pages.get(uid, ())) for uid in uids) <= pool.num_pages
        for uid in uids:
            assert self.lora.slot_of(uid) is not None, f"{uid} in a batch but not LOADED"
            self._check_slot(uid)
        self._check_sample_holds(batch)

    def _check_sample_holds(self, batch) -> None:
        """Right after a schedule: a sample other than its group's leader is admitted only once the
        leader has its first token (its prompt blocks cached) or has ended; and one held is held for a
        leader still live without a token (a leader that ended never strands its samples)."""
        scheduler = self.core.scheduler
        block = self.core.runner.kv.block_size

        def leader_pending(request: Request) -> bool:
            leader = scheduler.requests.get(self.leaders.get(request.group or "", ""))
            return leader is not None and leader is not request and not leader.output_token_ids

        for request, _ in batch.items:
            admitted_now = request.timings.first_scheduled is None  # set once its first step is launched
            if request.group is not None and admitted_now and request.num_prompt_tokens > block:
                assert not leader_pending(request), f"{request.request_id} prefilled before its leader's blocks"
        for request in scheduler.waiting:
            if request.wait_reason is WaitReason.SAMPLES:
                assert leader_pending(request), f"{request.request_id} held with no leader to wait for"

    def _end_everything(self) -> None:
        """Cancel every request, finish every staging and copy: nothing may be left over."""
        for rid in list(self.live):
            self.abort_request(rid)
            self.slot_pool_invariants()
        for _ in range(100):
            while self.executor.queued or self.copies.queued:
                self._complete_next_in_order()
            self.step()
            self.slot_pool_invariants()
            if not (self.core.has_work() or self.lora.has_pending_work() or self.executor.queued
                    or self.copies.queued or not all(f.done() for f in self.load_futures + self.unload_futures)):
                break
        self.lora.drain()
        assert self.lora.stats().references == 0
        assert not self.lora._loader.pending and self.core.stats().pending_load_events == 0
        assert self.core.runner.kv.num_used == 0
        assert not self.core.scheduler.requests and not self.aborted
        assert all(f.done() for f in self.unload_futures), "an UnloadAdapter never resolved"
        for future in self.load_futures:
            assert future.done(), "a LoadAdapter never resolved"
            error = future.exception()
            assert error is None or isinstance(error, (NotFoundError, FailedPreconditionError)), error
        for uid, entry in self.lora._registry.versions.items():
            assert not entry.draining, f"{uid} still draining with no requests"
            if entry.pinned:
                assert self.lora.state(uid) is AdapterState.LOADED, f"pinned {uid} not in a slot"

    def abort_request(self, rid: str) -> None:
        self.core.abort(rid)
        del self.live[rid]
        self.aborted.add(rid)


def test_slot_pool_state_machine(uris):
    SlotPoolMachine.uris = uris
    run_state_machine_as_test(SlotPoolMachine, settings=settings(
        max_examples=MAX_EXAMPLES,
        stateful_step_count=STEPS,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ))
