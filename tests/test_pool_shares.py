"""Per-tenant shares of the adapter pool (lora/pool_shares.py): whose resident adapters a load may evict.

Examples of each rule, then a property over random pools: a tenant within its share never loses an
adapter to another tenant, an owner at or over its share evicts its own idle adapters before anyone
else's, the victims make exactly the room asked for, and without shares the order is global LRU.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from inference_service.lora.pool_shares import Candidate, PoolShares

SHARES = PoolShares({"quiet": 4, "noisy": 4})


def held_of(candidates: list[Candidate], extra: dict[str | None, int] | None = None) -> Counter[str | None]:
    held: Counter[str | None] = Counter(extra or {})
    for _, owner, pages in candidates:
        held[owner] += pages
    return held


def test_without_shares_the_least_recently_used_go_first_whoever_owns_them():
    candidates = [("q1", "quiet", 1), ("n1", "noisy", 1), ("n2", "noisy", 1)]
    assert PoolShares({}).victims("noisy", 1, candidates, held_of(candidates), 2, False) == ["q1", "n1"]


def test_an_owner_over_its_share_evicts_its_own_first_even_when_others_are_older():
    candidates = [("s1", None, 1), ("n1", "noisy", 2), ("n2", "noisy", 3)]
    assert SHARES.victims("noisy", 2, candidates, held_of(candidates), 2, False) == ["n1"]


def test_an_owner_over_its_share_never_evicts_a_tenant_within_its_share():
    candidates = [("q1", "quiet", 2), ("n1", "noisy", 4)]
    held = held_of(candidates)
    assert SHARES.victims("noisy", 2, candidates, held, 6, False) is None
    # Shared adapters and tenants without a share are fair game once its own are gone.
    candidates = [("q1", "quiet", 2), ("s1", None, 2), ("n1", "noisy", 4)]
    assert SHARES.victims("noisy", 2, candidates, held_of(candidates), 6, False) == ["n1", "s1"]


def test_an_owner_within_its_share_evicts_tenants_over_theirs_then_its_own_never_another_within():
    candidates = [("q1", "quiet", 1), ("n1", "noisy", 3), ("n2", "noisy", 3), ("o1", "other", 1)]
    held = held_of(candidates)  # noisy 6 > 4; quiet 1 (+1 wanted) within 4
    assert SHARES.victims("quiet", 1, candidates, held, 1, False) == ["n1"]
    # noisy is back within its share after n1: quiet's own goes next, never n2.
    assert SHARES.victims("quiet", 1, candidates, held, 5, False) == ["n1", "o1", "q1"]
    assert SHARES.victims("quiet", 1, candidates, held, 6, False) is None


def test_an_over_share_tenant_stops_losing_adapters_once_within_its_share():
    candidates = [("n1", "noisy", 1), ("n2", "noisy", 1), ("n3", "noisy", 1), ("n4", "noisy", 1),
                  ("n5", "noisy", 1)]
    held = held_of(candidates)  # 5 pages, share 4: one page over
    assert SHARES.victims(None, 1, candidates, held, 1, False) == ["n1"]
    assert SHARES.victims(None, 1, candidates, held, 2, False) is None


def test_a_full_adapter_count_is_room_made_by_one_eviction():
    candidates = [("q1", "quiet", 1), ("n1", "noisy", 1)]
    held = held_of(candidates, {"noisy": 4})
    assert SHARES.victims("noisy", 1, candidates, held, 0, True) == ["n1"]


def test_shares_in_pages_round_down_count_at_least_one_largest_adapter_and_leave_room_outside():
    shares = PoolShares.from_bytes({"a": 1000, "b": 100}, page_nbytes=100, largest=2, num_pages=20)
    assert shares.pages == {"a": 10, "b": 2}
    assert shares.pin_budget("a", 20) == 10 and shares.pin_budget(None, 20) == 8
    with pytest.raises(ValueError, match=r"largest rank \(2 of the pages\)"):
        PoolShares.from_bytes({"a": 1000, "b": 900}, page_nbytes=100, largest=2, num_pages=20)
    assert not PoolShares.from_bytes({}, page_nbytes=100, largest=2, num_pages=2)


OWNERS = (None, "a", "b", "c")  # c has no share


@st.composite
def pools(draw):
    shares = PoolShares({"a": draw(st.integers(1, 6)), "b": draw(st.integers(1, 6))}) if draw(st.booleans()) \
        else PoolShares({})
    resident = draw(st.lists(st.tuples(st.sampled_from(OWNERS), st.integers(1, 3), st.booleans()), max_size=10))
    candidates = [(f"u{i}", owner, pages) for i, (owner, pages, evictable) in enumerate(resident) if evictable]
    held: Counter[str | None] = Counter()
    for owner, pages, _ in resident:
        held[owner] += pages
    return shares, candidates, held, draw(st.sampled_from(OWNERS)), draw(st.integers(1, 3)), \
        draw(st.integers(1, 8)), draw(st.booleans())


@settings(max_examples=400, deadline=None, database=None)
@given(pools())
def test_victims_never_take_from_a_tenant_within_its_share_and_take_own_first(pool):
    shares, candidates, held, requester, wanted, needed, over_count = pool
    victims = shares.victims(requester, wanted, candidates, held, needed, over_count)
    if not shares:  # the old pool: global LRU, exactly as many as needed
        taken, need, over = [], needed, over_count
        for uid, _, pages in candidates:
            if need <= 0 and not over:
                break
            taken.append(uid)
            need, over = need - pages, False
        assert victims == (taken if need <= 0 and not over else None)
        return
    if victims is None:
        return
    by_uid = {uid: (owner, pages) for uid, owner, pages in candidates}
    assert len(set(victims)) == len(victims) and set(victims) <= set(by_uid)
    freed = sum(by_uid[v][1] for v in victims)
    assert freed >= needed and (victims or not over_count)
    assert freed - by_uid[victims[-1]][1] < needed or (over_count and len(victims) == 1), "evicted more than needed"
    within = shares.within(requester, held, wanted)
    left = Counter(held)
    own = [uid for uid, owner, _ in candidates if owner == requester]
    for i, victim in enumerate(victims):
        owner, pages = by_uid[victim]
        if owner != requester:
            # Never a tenant within its share (whoever asks), judged when it is evicted.
            assert shares.unprotected(owner, left), (victim, owner, dict(left))
            if shares.share(requester) is not None and not within:
                assert set(own) <= set(victims[:i]), "another's adapter evicted before the owner's own"
        left[owner] -= pages
