"""Each tenant's share of the adapter pool, and whose resident adapters a load may evict.

While the pool has room it is shared: a load that fits in free pages evicts nothing, whoever owns
it, so a tenant may hold more than its share while nobody needs the pages. When a load needs room,
its owner's standing decides which unreferenced, unpinned adapters it may evict (least recently
used first within each group):

- an owner WITHIN its share (its pages, counting this load, at most its share): first adapters of
  owners over their share or without one, then its own;
- an owner AT OR OVER its share: first its own, then those of owners over their share or without one;
- an owner WITHOUT a share (shared adapters, tenants without `adapter_pool_bytes`): those of owners
  over their share or without one (its own among them).

An owner within its share is never evicted by anyone else: a tenant's cold adapters evict its own
resident ones before anyone else's, and never a well-behaved neighbour's. Standing is judged at each
eviction, so an owner stops losing adapters once it is back within its share. Without any share
configured every owner is without one, and this is the pool's global least-recently-used order.

Shares are in pages (an adapter of rank r takes ceil(r / page_rank)); one smaller than an adapter of
the largest rank counts as one (else such a tenant could never load its largest adapter). Together
they must leave an adapter of the largest rank outside them for owners without a share: with that
and pinning bounded per share (`pin_budget`), every load that waits only on idle adapters finds room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

# A resident adapter a load could evict: (uid, owner, pages it holds).
Candidate = tuple[str, str | None, int]


@dataclass(frozen=True)
class PoolShares:
    pages: Mapping[str, int]  # owner (a tenant name) → pages it is entitled to

    @classmethod
    def from_bytes(cls, shares: Mapping[str, int], page_nbytes: int, largest: int, num_pages: int) -> PoolShares:
        """Bytes per owner → pages (rounded down, at least `largest`, an adapter of the largest
        rank); ValueError when they leave no room for such an adapter outside them."""
        pages = {owner: max(nbytes // page_nbytes, largest) for owner, nbytes in shares.items()}
        if pages and sum(pages.values()) + largest > num_pages:
            raise ValueError(
                f"tenants' adapter_pool_bytes come to {sum(pages.values())} pages of the adapter pool's "
                f"{num_pages} ({page_nbytes} B each, a share counted as at least {largest}): together they "
                f"must leave room for an adapter of the largest rank ({largest} of the pages) for shared adapters")
        return cls(pages)

    def __bool__(self) -> bool:
        return bool(self.pages)

    def share(self, owner: str | None) -> int | None:
        return None if owner is None else self.pages.get(owner)

    def unprotected(self, owner: str | None, held: Mapping[str | None, int]) -> bool:
        """Whether others may evict this owner's adapters: it has no share or holds more than it."""
        share = self.share(owner)
        return share is None or held.get(owner, 0) > share

    def within(self, owner: str | None, held: Mapping[str | None, int], wanted: int) -> bool:
        """Whether `wanted` more pages keep this owner within its share."""
        share = self.share(owner)
        return share is not None and held.get(owner, 0) + wanted <= share

    def pin_budget(self, owner: str | None, num_pages: int) -> int:
        """Pages the adapters of `owner`'s group may be pinned in, one adapter of the largest rank
        left unpinned in it: its share, or for owners without one what the shares leave of the pool."""
        share = self.share(owner)
        return share if share is not None else num_pages - sum(self.pages.values())

    def in_group(self, owner: str | None, other: str | None) -> bool:
        """Whether `other`'s pins count against `owner`'s pin budget (the same share, or both none)."""
        share = self.share(owner)
        return other == owner if share is not None else self.share(other) is None

    def victims(self, requester: str | None, wanted: int, candidates: Iterable[Candidate],
                held: Mapping[str | None, int], needed: int, over_count: bool) -> list[str] | None:
        """Adapters to evict, in order, so that a load of `wanted` pages by `requester` fits:
        `needed` pages more than are free, `over_count` when the pool's adapter count is at its cap.
        `candidates` are the evictable adapters, least recently used first; `held` each owner's pages
        now (unevictable ones included). None: no room this owner may take (the load waits)."""
        ordered = list(candidates)
        left = Counter(held)
        victims: list[str] = []
        taken: set[str] = set()

        def take(allowed: Callable[[str | None], bool]) -> bool:
            nonlocal needed, over_count
            for uid, owner, pages in ordered:
                if needed <= 0 and not over_count:
                    break
                if uid in taken or not allowed(owner):
                    continue
                taken.add(uid)
                victims.append(uid)
                needed -= pages
                left[owner] -= pages
                over_count = False
            return needed <= 0 and not over_count

        def own(owner: str | None) -> bool:
            return owner == requester

        def others_unprotected(owner: str | None) -> bool:
            return owner != requester and self.unprotected(owner, left)

        if self.share(requester) is None:
            stages = [lambda owner: self.unprotected(owner, left)]
        elif self.within(requester, held, wanted):
            stages = [others_unprotected, own]
        else:
            stages = [own, others_unprotected]
        for allowed in stages:
            if take(allowed):
                return victims
        return None
