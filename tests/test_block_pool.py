"""The KV block pool with prefix caching against a simple model (hypothesis state machine).

Requests are admitted (taking the cached prefix of their chain and fresh blocks), grow, have their
full blocks cached, are cancelled, finish or are preempted (and readmitted), in random
interleavings, with allocation evicting cached blocks under pressure. After every rule: each block
is free, cached or held, never two of these; each block's reference count equals the tables that
hold it; a hit returns only blocks whose content is the looked-up chain's; held blocks are never
evicted; eviction takes the least recently released cached block first.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference_service.engine.block_pool import BlockPool
from inference_service.engine.prefix_cache import CacheNamespace, chain_hash
from inference_service.frontend.cache_salt import cache_salt

NUM_BLOCKS = 12
ROOTS = [CacheNamespace(("base",)).root(), CacheNamespace(("lora", "a@1", "staging:1")).root()]


def _chain(root: bytes, blocks: list[tuple[int, ...]]) -> list[bytes]:
    hashes: list[bytes] = []
    for tokens in blocks:
        hashes.append(chain_hash(hashes[-1] if hashes else root, list(tokens)))
    return hashes


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.live: dict[int, dict] = {}  # request -> {"hashes": chain, "table": blocks, "written": n}
        self.content: dict[int, bytes] = {}  # model: the hash of what a block holds (when written full)
        self.lru: list[int] = []  # model: unheld cached blocks, least recently released first
        self.next_id = 0

    def _held(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for request in self.live.values():
            for block in request["table"]:
                counts[block] = counts.get(block, 0) + 1
        return counts

    def _allocate(self, n: int) -> list[int] | None:
        if n > self.pool.num_free:
            return None
        free_list = self.pool.num_free - len(self.lru)
        expected_evicted = self.lru[: max(0, n - free_list)]
        blocks = self.pool.allocate(n)
        evicted = [b for b in blocks if b in self.content]
        assert evicted == expected_evicted, "eviction is not least recently released first"
        for block in evicted:
            self.lru.remove(block)
            del self.content[block]
        return blocks

    @rule(root=st.sampled_from(ROOTS), prefix=st.sampled_from([(), ((1, 2),), ((1, 2), (3, 4))]),
          rest=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=4))
    def admit(self, root, prefix, rest):
        """A request whose token blocks may share a prefix with others: hits, then fresh blocks."""
        self.admit_chain(_chain(root, list(prefix) + rest))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        blocks = self._allocate(1)
        if blocks is not None:
            request["table"] = request["table"] + blocks

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_written(self, data):
        """A step completed: the request's next full block is written and keyed."""
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        i = request["written"]
        if i >= min(len(request["hashes"]), len(request["table"])):
            return
        block, block_hash = request["table"][i], request["hashes"][i]
        known = block_hash in self.content.values()
        self.pool.cache(block, block_hash)
        if block not in self.content and not known:
            self.content[block] = block_hash
        request["written"] = i + 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["finish", "cancel", "preempt", "fail"]))
    def end(self, data, how):
        """Every end path drops each of the table's references once (preempt readmits later)."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        request = self.live.pop(rid)
        self.pool.release(request["table"])
        held = self._held()
        for block in reversed(request["table"]):
            if block not in held and block in self.content and block not in self.lru:
                self.lru.append(block)
        if how == "preempt":  # readmitted: its own blocks, cached meanwhile, are hits now
            self.admit_chain(request["hashes"])

    def admit_chain(self, hashes: list[bytes]) -> None:
        hits = self.pool.lookup(hashes)
        assert hits == self._expected_hits(hashes), "a hit on a block holding other content"
        num_new = max(1, len(hashes) - len(hits))
        held = self._held()
        unheld_hits = [b for b in hits if b not in held]
        fits = num_new <= self.pool.num_free - len(unheld_hits)
        assert self.pool.can_take(hits, num_new) == fits
        if not fits:
            return
        self.pool.take(hits)
        for block in unheld_hits:
            self.lru.remove(block)
        table = hits + self._allocate(num_new)
        self.live[self.next_id] = {"hashes": hashes, "table": table, "written": len(hits)}
        self.next_id += 1

    def _expected_hits(self, hashes: list[bytes]) -> list[int]:
        """The model's longest cached prefix: the blocks whose written content is each hash."""
        by_hash = {h: b for b, h in self.content.items()}
        hits = []
        for block_hash in hashes:
            if block_hash not in by_hash:
                break
            hits.append(by_hash[block_hash])
        return hits

    @invariant()
    def consistent(self):
        self.pool.check()
        held = self._held()
        for block in range(NUM_BLOCKS):
            assert self.pool.refs(block) == held.get(block, 0), block
        assert self.pool.num_held == len(held)
        assert self.pool.num_cached == len(self.lru)
        assert set(self.lru) == {b for b in self.content if b not in held}
        assert self.pool.num_held + self.pool.num_free == NUM_BLOCKS

    def teardown(self):
        for request in self.live.values():
            self.pool.release(request["table"])
        self.pool.check()
        assert self.pool.num_held == 0


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_release_more_often_than_held_is_refused():
    pool = BlockPool(2)
    table = pool.allocate(1)
    pool.release(table)
    with pytest.raises(RuntimeError):
        pool.release(table)


def test_caching_off_never_hits_or_caches():
    pool = BlockPool(4, caching=False)
    table = pool.allocate(2)
    hashes = _chain(ROOTS[0], [(1, 2), (3, 4)])
    for block, block_hash in zip(table, hashes, strict=True):
        pool.cache(block, block_hash)
    pool.release(table)
    assert pool.lookup(hashes) == [] and pool.num_cached == 0 and pool.num_free == 4


def test_namespaces_never_collide():
    """Typed roots: the base model, adapters, digests/stagings and salts never share a key, and a
    name that spells another's parts (`a@1` + salt vs `a` + `@1...`) is another key."""
    spaces = [
        CacheNamespace(("base",)),
        CacheNamespace(("base",), (("identity", "tenant-a"),)),
        CacheNamespace(("base",), (("operator", "tenant-a"),)),
        CacheNamespace(("base",), (("listener", "grpc"),)),
        CacheNamespace(("base",), (("listener", "grpc"), ("identity", "a"))),
        CacheNamespace(("base",), (("listener", "grpc"), ("identity", ""))),
        CacheNamespace(("base",), ()),
        CacheNamespace(("lora", "a@1", "staging:1")),
        CacheNamespace(("lora", "a@1", "staging:2")),
        CacheNamespace(("lora", "a@2", "staging:1")),
        CacheNamespace(("lora", "a@1", "sha256:00")),
        CacheNamespace(("lora", "a@1", "staging:1"), (("identity", "t"),)),
        CacheNamespace(("lora", "a@1", "staging:1t")),
        CacheNamespace(("lora", "a@1staging:1")),
    ]
    roots = {space.root() for space in spaces}
    assert len(roots) == len(spaces)
    assert cache_salt("shared", None, "grpc", "tenant-a") is None  # one namespace per weights
    assert cache_salt("listener", None, "grpc", "tenant-a") != cache_salt("listener", None, "http", None)
    assert cache_salt("identity", "op", "grpc", "a") != cache_salt("identity", "op", "grpc", "b")
    assert cache_salt("identity", "op", "grpc", None) == cache_salt("listener", "op", "grpc", None)
    with pytest.raises(ValueError):
        cache_salt("nobody", None, "grpc", None)
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(16)]
    assert len({chain_hash(root, tokens) for root in roots}) == len(spaces)


def test_a_fresh_pool_hands_out_blocks_in_order():
    """Block 0 first, then upwards: allocation is deterministic (the same arrivals, the same tables)."""
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]


def test_evictions_count_each_cached_block_taken_back():
    """`evictions` (the prefix-cache eviction metric) counts each cached block an allocation takes,
    and nothing taken from the free list."""
    pool = BlockPool(4)
    table = pool.allocate(3)
    for block, block_hash in zip(table, _chain(ROOTS[0], [(1, 2), (3, 4), (5, 6)]), strict=True):
        pool.cache(block, block_hash)
    pool.release(table)
    assert (pool.num_cached, pool.evictions) == (3, 0)
    pool.allocate(1)  # the free block
    assert pool.evictions == 0
    pool.allocate(2)  # two cached ones
    assert (pool.evictions, pool.num_cached) == (2, 1)
