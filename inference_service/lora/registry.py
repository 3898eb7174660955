"""Adapter names, versions, states and request references.

State is derived (`LoRAManager.state`) from what exists: a pending load, a slot, host tensors,
an in-flight host preparation. Only what cannot be derived is stored here: the user's intent
(pinned, draining) and a failure. Beside the versions it keeps small indexes (draining versions,
referenced versions, names) so that a scheduler step never walks every registered adapter.
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from adapter_cache.adapter_format import HostAdapter, LoadTier
from adapter_cache.errors import LoraplexError, NotFoundError


class UnloadedWhileLoadingError(NotFoundError):
    """A LoadAdapter whose version an UnloadAdapter (or a newer version) retired before it was ready:
    an operator's decision, which a retrying loader (the preloader) must not undo."""


class AdapterState(enum.Enum):
    REGISTERED = "REGISTERED"
    STAGING = "STAGING"
    HOST_READY = "HOST_READY"
    LOADING = "LOADING"
    LOADED = "LOADED"
    DRAINING = "DRAINING"
    FAILED = "FAILED"


@dataclass(eq=False)
class AdapterVersion:
    name: str
    version: int
    uri: str
    sha256: str | None
    owner: str | None = None  # the tenant it belongs to (its share of the pool); None: shared, an operator's
    pinned: bool = False
    draining: bool = False
    failure: LoraplexError | None = None
    host: HostAdapter | None = None  # HOST_READY tensors (dropped once copied into a slot)
    staging: concurrent.futures.Future[HostAdapter] | None = None
    rank: int = 0
    size_bytes: int = 0
    tier: LoadTier = LoadTier.STORE  # where the next load's bytes come from
    retry_at: float = 0.0  # monotonic time before which a transiently refused staging is not retried
    refs: set[str] = field(default_factory=set)  # ids of queued and running requests
    stagings: int = 0  # host preparations started (each may read other bytes when no digest pins them)
    loads: int = 0  # copies into the pool completed (more than one: it was evicted and loaded again)

    @property
    def uid(self) -> str:
        return f"{self.name}@{self.version}"


def adapter_name(uid: str) -> str:
    """The name in a version's uid (`name@version`, made by `AdapterVersion.uid`)."""
    return uid.rpartition("@")[0]


class AdapterRegistry:
    def __init__(self) -> None:
        self.current: dict[str, str] = {}  # name → uid of the version new requests get
        self.versions: dict[str, AdapterVersion] = {}
        self.names: Counter[str] = Counter()  # name → versions held (the registry cap counts names)
        self.draining: set[str] = set()  # uids marked draining, not yet removed
        self.referenced: set[str] = set()  # uids with at least one request reference
        # Names the adapter resolver registered (a cache, not an operator's intent), least recently
        # used first: the registry unregisters idle ones of these to make room for new names.
        self.on_demand: OrderedDict[str, None] = OrderedDict()
        self._next_version: dict[str, int] = {}
        self.current_changes = 0  # bumped whenever `current` changes: mirrors of it know when to refresh

    def add_version(self, name: str, uri: str, sha256: str | None, pinned: bool,
                    owner: str | None = None) -> AdapterVersion:
        version = self._next_version.get(name, 1)
        self._next_version[name] = version + 1
        entry = AdapterVersion(name=name, version=version, uri=uri, sha256=sha256, owner=owner, pinned=pinned)
        self.versions[entry.uid] = entry
        self.names[name] += 1
        return entry

    def set_on_demand(self, name: str, on_demand: bool) -> None:
        """Whether `name` is the resolver's (evictable) or an operator's (LoadAdapter, preload)."""
        if on_demand:
            self.on_demand[name] = None
            self.on_demand.move_to_end(name)
        else:
            self.on_demand.pop(name, None)

    def used(self, name: str) -> None:
        """A request named `name`: it becomes the most recently used on-demand name (O(1))."""
        if name in self.on_demand:
            self.on_demand.move_to_end(name)

    def mark_draining(self, entry: AdapterVersion) -> None:
        entry.draining = True
        self.draining.add(entry.uid)

    def add_ref(self, entry: AdapterVersion, request_id: str) -> None:
        if request_id not in entry.refs:
            entry.refs.add(request_id)
            self.referenced.add(entry.uid)

    def drop_ref(self, uid: str, request_id: str) -> None:
        """Idempotent, so every end path of a request may call it."""
        entry = self.versions.get(uid)
        if entry is not None and request_id in entry.refs:
            entry.refs.discard(request_id)
            if not entry.refs:
                self.referenced.discard(uid)

    def make_current(self, entry: AdapterVersion) -> AdapterVersion | None:
        """Point the name at this version; returns the version it replaces (to be drained)."""
        old_uid = self.current.get(entry.name)
        self.current[entry.name] = entry.uid
        self.current_changes += 1
        return self.versions.get(old_uid) if old_uid and old_uid != entry.uid else None

    def resolve(self, name: str) -> AdapterVersion:
        uid = self.current.get(name)
        if uid is None:
            raise NotFoundError(f"unknown adapter {name!r}")
        return self.versions[uid]

    def remove(self, uid: str) -> None:
        entry = self.versions.pop(uid)
        assert not entry.refs, f"{uid} removed while requests reference it"
        self.draining.discard(uid)
        self.names[entry.name] -= 1
        if not self.names[entry.name]:
            del self.names[entry.name]
            self.on_demand.pop(entry.name, None)
        if self.current.get(entry.name) == uid:
            self.retire(entry.name)

    def retire(self, name: str) -> None:
        """New requests may no longer use `name` (its versions drain)."""
        del self.current[name]
        self.on_demand.pop(name, None)
        self.current_changes += 1

    def total_refs(self) -> int:
        """Counted from the references themselves (no second counter that could drift from them),
        over the referenced versions only: O(adapters with requests), so any step may ask."""
        return sum(len(self.versions[uid].refs) for uid in self.referenced)
