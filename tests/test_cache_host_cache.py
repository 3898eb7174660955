"""Property test of the host cache's bookkeeping (adapter_cache/host_cache.py), with a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from adapter_cache.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError
from adapter_cache.host_cache import Entry, HostCache

CAPACITY = 100
URIS = [f"s3://b/a{i}" for i in range(6)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HostCacheMachine(RuleBasedStateMachine):
    """stage / release / expire / evict / restart must keep bytes <= budget and never drop a leased entry."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cache = HostCache(CAPACITY, self.clock)
        self.leases: dict[str, tuple[str, float]] = {}  # lease_id -> (uri, expires_at): the model

    def _live(self) -> dict[str, tuple[str, float]]:
        return {lid: v for lid, v in self.leases.items() if v[1] > self.clock.now}

    def _leased_bytes(self) -> int:
        uris = {uri for uri, _ in self._live().values()}
        return sum(self.cache.get(u).size for u in uris)

    @rule(uri=st.sampled_from(URIS), size=st.integers(1, 70), lease_s=st.integers(1, 50))
    def stage(self, uri: str, size: int, lease_s: int) -> None:
        if self.cache.get(uri) is None:
            leased = self._leased_bytes()
            try:
                victims = self.cache.reserve(uri, size)
            except ResourceExhaustedError:
                fits = leased + size <= self.cache.capacity_bytes
                assert not fits, "refused although evicting unleased entries would make room"
                return
            live_uris = {u for u, _ in self._live().values()}
            assert not {v.uri for v in victims} & live_uris, "evicted a leased entry"
            self.cache.commit(Entry(uri, size, f"sha-{uri}", self.clock.now))
        lease = self.cache.acquire(uri, lease_s, hit=False)
        self.leases[lease.lease_id] = (uri, lease.expires_at)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data) -> None:
        lease_id = data.draw(st.sampled_from(list(self.leases)))
        del self.leases[lease_id]
        try:
            self.cache.release(lease_id)
        except NotFoundError:
            pass  # it had expired and been swept already

    @rule(dt=st.integers(0, 30))
    def advance_clock(self, dt: int) -> None:
        self.clock.now += dt
        for lease in self.cache.expire():
            assert lease.expires_at <= self.clock.now

    @rule(uri=st.one_of(st.none(), st.sampled_from(URIS)))
    def evict(self, uri: str | None) -> None:
        live_uris = {u for u, _ in self._live().values()}
        try:
            victims = self.cache.evict(uri)
        except (NotFoundError, FailedPreconditionError):
            return
        assert not {v.uri for v in victims} & live_uris

    @rule(capacity_after=st.sampled_from([CAPACITY, CAPACITY // 2]))
    def restart(self, capacity_after: int) -> None:
        """A restart rebuilds the index from the directory; leases do not survive it."""
        directory = [dataclasses.replace(e, leases=dict(e.leases)) for e in self.cache.entries()]
        self.cache = HostCache(capacity_after, self.clock)
        dropped = self.cache.restore(directory)
        kept = {e.uri for e in self.cache.entries()}
        assert kept | {e.uri for e in dropped} == {e.uri for e in directory}
        self.leases.clear()

    @invariant()
    def within_budget(self) -> None:
        assert self.cache.used_bytes <= self.cache.capacity_bytes

    @invariant()
    def leased_entries_present(self) -> None:
        for uri, _ in self._live().values():
            assert self.cache.get(uri) is not None, f"leased entry {uri} was dropped"


HostCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestHostCache = HostCacheMachine.TestCase


def test_reservations_count_against_the_budget():
    cache = HostCache(100, FakeClock())
    cache.reserve("s3://b/x", 60)
    with pytest.raises(ResourceExhaustedError):
        cache.reserve("s3://b/y", 60)  # x is in flight: not evictable, still counted
    cache.abort("s3://b/x")
    assert cache.used_bytes == 0


def test_lru_order_and_leased_entry_survives():
    clock = FakeClock()
    cache = HostCache(100, clock)
    for i, uri in enumerate(["s3://b/old", "s3://b/mid", "s3://b/new"]):
        clock.now += 1
        cache.reserve(uri, 30)
        cache.commit(Entry(uri, 30, str(i), clock.now))
    lease = cache.acquire("s3://b/old", 10, hit=True)
    victims = cache.reserve("s3://b/big", 70)
    assert [v.uri for v in victims] == ["s3://b/mid", "s3://b/new"]  # old is leased, so mid and new go
    clock.now += 11  # the lease expires: a crashed client no longer pins it
    cache.commit(Entry("s3://b/big", 70, "b", clock.now))
    assert [v.uri for v in cache.reserve("s3://b/more", 30)] == ["s3://b/old"]
    with pytest.raises(NotFoundError):
        cache.release(lease.lease_id)
