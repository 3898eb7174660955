"""The host cache's bookkeeping: byte budget, leases, LRU. Pure logic, no I/O.

Kept free of files and threads so a property test can drive it with a fake clock; the
stager owns the lock and does the I/O the returned decisions call for (deleting evicted
files). Bytes of fetches in flight are reserved up front so concurrent misses can never
push the total over the budget.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from inference_service.errors import FailedPreconditionError, NotFoundError, ResourceExhaustedError


@dataclass
class Entry:
    """One staged adapter. `meta` is opaque here (path, manifest, config) and owned by the stager."""

    uri: str
    size: int
    sha256: str
    last_used: float
    hits: int = 0
    leases: dict[str, float] = field(default_factory=dict)  # lease_id -> expires_at
    meta: Any = None


@dataclass(frozen=True)
class Lease:
    lease_id: str
    uri: str
    expires_at: float
    owner: str = ""  # the authenticated caller that took it (see adapter_cache.auth)


class HostCache:
    """Byte-budgeted LRU of staged entries; an entry with a live lease is never evicted."""

    def __init__(self, capacity_bytes: int, clock: Callable[[], float]) -> None:
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._entries: dict[str, Entry] = {}
        self._reserved: dict[str, int] = {}  # uri -> bytes of a fetch in flight
        self._leases: dict[str, Lease] = {}
        self._owned: Counter[str] = Counter()  # owner -> live leases

    # --- queries -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        """Committed plus reserved bytes: the figure the budget bounds."""
        return sum(e.size for e in self._entries.values()) + sum(self._reserved.values())

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def leases_of(self, owner: str) -> int:
        """Live leases `owner` holds (expired ones count until the next `expire`)."""
        return self._owned[owner]

    def entries(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: e.last_used)

    def get(self, uri: str) -> Entry | None:
        return self._entries.get(uri)

    def entry_for_lease(self, lease_id: str, owner: str | None = None) -> Entry:
        """The entry a lease holds; with `owner`, only that caller's leases are found."""
        return self._entries[self._lease(lease_id, owner).uri]

    def _lease(self, lease_id: str, owner: str | None) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            raise NotFoundError(f"unknown or expired lease {lease_id!r}")
        return lease

    # --- leases --------------------------------------------------------------------------
    def acquire(self, uri: str, lease_seconds: float, hit: bool, owner: str = "") -> Lease:
        """Lease a committed entry for `owner` and mark it most recently used."""
        entry = self._entries.get(uri)
        if entry is None:
            raise NotFoundError(f"{uri} is not staged")
        now = self._clock()
        entry.last_used = now
        if hit:
            entry.hits += 1
        lease = Lease(uuid.uuid4().hex, uri, now + lease_seconds, owner)
        entry.leases[lease.lease_id] = lease.expires_at
        self._leases[lease.lease_id] = lease
        self._owned[owner] += 1
        return lease

    def release(self, lease_id: str, owner: str | None = None) -> str:
        """Drop a lease (with `owner`: only one of that caller's); returns the uri it held."""
        lease = self._lease(lease_id, owner)
        self._drop_lease(lease)
        self._entries[lease.uri].leases.pop(lease_id, None)
        return lease.uri

    def _drop_lease(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        self._owned[lease.owner] -= 1
        if not self._owned[lease.owner]:
            del self._owned[lease.owner]

    def expire(self) -> list[Lease]:
        """Drop leases whose time is up, so a crashed client cannot pin memory forever."""
        now = self._clock()
        expired = []
        for entry in self._entries.values():
            for lease_id, expires_at in list(entry.leases.items()):
                if expires_at <= now:
                    del entry.leases[lease_id]
                    lease = self._leases[lease_id]
                    self._drop_lease(lease)
                    expired.append(lease)
        return expired

    # --- space ---------------------------------------------------------------------------
    def reserve(self, uri: str, size: int) -> list[Entry]:
        """Reserve `size` bytes for a fetch of `uri`, evicting unleased entries in LRU order.

        Returns the evicted entries (their files are the caller's to delete). Raises
        ResourceExhaustedError, evicting nothing, when even evicting every unleased entry
        would not make room.
        """
        if uri in self._reserved or uri in self._entries:
            raise FailedPreconditionError(f"{uri} is already staged or being staged")
        self.expire()
        need = self.used_bytes + size - self.capacity_bytes
        victims: list[Entry] = []
        if need > 0:
            for entry in self.entries():
                if need <= 0:
                    break
                if not entry.leases:
                    victims.append(entry)
                    need -= entry.size
            if need > 0:
                raise ResourceExhaustedError(
                    f"{uri}: {size} bytes do not fit in the cache budget of {self.capacity_bytes} bytes "
                    f"({self.used_bytes} in use, of which leased or in flight cannot be evicted)"
                )
        for entry in victims:
            del self._entries[entry.uri]
        self._reserved[uri] = size
        return victims

    def commit(self, entry: Entry) -> None:
        """Turn the reservation for `entry.uri` into a committed entry (sizes must agree)."""
        reserved = self._reserved.pop(entry.uri)
        if reserved != entry.size:
            raise ValueError(f"{entry.uri}: reserved {reserved} bytes but committing {entry.size}")
        self._entries[entry.uri] = entry

    def abort(self, uri: str) -> None:
        """Give back the reservation of a failed fetch."""
        self._reserved.pop(uri, None)

    def evict(self, uri: str | None = None) -> list[Entry]:
        """Evict one unleased entry, or every unleased entry when `uri` is None."""
        self.expire()
        if uri is None:
            victims = [e for e in self._entries.values() if not e.leases]
        else:
            entry = self._entries.get(uri)
            if entry is None:
                raise NotFoundError(f"{uri} is not staged")
            if entry.leases:
                raise FailedPreconditionError(f"{uri} has {len(entry.leases)} live lease(s)")
            victims = [entry]
        for entry in victims:
            del self._entries[entry.uri]
        return victims

    def restore(self, entries: Iterable[Entry]) -> list[Entry]:
        """Rebuild the index after a restart (no leases survive one).

        The most recently used entries win when the directory holds more than the budget;
        the rest are returned for the caller to delete.
        """
        dropped: list[Entry] = []
        for entry in sorted(entries, key=lambda e: e.last_used, reverse=True):
            entry.leases = {}
            if entry.uri in self._entries or self.used_bytes + entry.size > self.capacity_bytes:
                dropped.append(entry)
            else:
                self._entries[entry.uri] = entry
        return dropped
