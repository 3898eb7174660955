"""LoRAManager: the only face of the LoRA subsystem (its registry, slot pool and loader are private).

Runs on the scheduler thread only, so its state needs no locks. Host preparation (fetching,
validating) runs on a thread pool and slot copies on the copy engine; both are collected by
`drain()`, which the scheduler calls before every status or capacity decision.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from adapter_cache.adapter_format import BaseModelShapes, HostAdapter, LoadTier
from adapter_cache.errors import (
    FailedPreconditionError,
    LoraplexError,
    ResourceExhaustedError,
    UnavailableError,
)
from inference_service.device import CopyEngine, free_memory
from inference_service.limits import shown
from inference_service.lora.mem_pool import DEFAULT_PAGE_RANK, LoRAMemoryPool
from inference_service.lora.overlap_loader import OverlapLoader
from inference_service.lora.registry import AdapterRegistry, AdapterState, AdapterVersion, UnloadedWhileLoadingError
from inference_service.lora.source import AdapterSource
from inference_service.lora.staging_pool import StagingPool
from inference_service.lora.step_buffers import ExpertStepBuffers, LoRAStepBuffers, RowAdapter
from inference_service.metrics_sink import MetricsSink, NullMetrics

log = logging.getLogger(__name__)

STAGING_RETRY_SECONDS = 0.25


@dataclass
class AdminOp:
    """A LoadAdapter in progress: resolved once registered (or, with preload, once LOADED)."""

    entry: AdapterVersion
    future: concurrent.futures.Future[AdapterVersion]
    preload: bool
    started: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter version as callers see it (ListAdapters, LoadAdapter's answer)."""

    name: str
    version: int
    uri: str
    state: str
    slot: int
    pinned: bool
    rank: int
    size_bytes: int
    active_requests: int
    owner: str | None = None  # the tenant it belongs to; None: shared
    loads: int = 0  # copies into the pool completed (more than one: evicted and loaded again)


@dataclass(frozen=True)
class LoRAStats:
    slots_total: int  # adapters of the largest rank the pool holds at once
    slots_occupied: int  # adapters resident (or being copied in)
    slots_referenced: int  # resident adapters a queued or running request holds
    slots_pinned: int
    pending_loads: int  # copies in flight
    references: int  # request references over all versions
    loads_total: int
    evictions_total: int
    pool_bytes_total: int = 0  # the adapter pool's pages (the zero page not counted)
    pool_bytes_used: int = 0  # pages holding an adapter
    resident_by_rank: tuple[tuple[int, int], ...] = ()  # (rank, adapters resident)
    evictions_by_cause: tuple[tuple[str, int], ...] = ()  # (cause, count): see EVICTION_CAUSES
    pool_bytes_by_owner: tuple[tuple[str, int], ...] = ()  # (tenant, bytes its resident adapters hold)


# Why an adapter left the pool: made room for another (least recently used), its version was
# unloaded or replaced and drained, or its copy failed.
EVICTION_CAUSES = ("capacity", "drained", "failed")


@dataclass
class DrainResult:
    """What `drain` found: versions whose preparation failed (their waiters must fail)."""

    failed: dict[str, LoraplexError] = field(default_factory=dict)


class LoRAManager:
    def __init__(
        self,
        num_slots: int | None,
        max_rank: int,
        shapes: BaseModelShapes,
        device: torch.device,
        dtype: torch.dtype,
        source: AdapterSource,
        copy_engine: CopyEngine,
        host_workers: int = 2,
        metrics: MetricsSink | None = None,
        host_executor: concurrent.futures.Executor | None = None,
        b_rank_major: bool = False,
        max_registered: int = 1024,
        load_timeout_s: float = 120.0,
        num_pages: int | None = None,
        page_rank: int = DEFAULT_PAGE_RANK,
        pool_shares: Mapping[str, int] | None = None,
        huge_pages: bool = True,
    ) -> None:
        """`num_slots`: a fixed-slot pool of that many max-rank slots; None: a paged pool of
        `num_pages` pages of `page_rank` rank rows (sized by memory, `pool_pages`). `pool_shares`:
        bytes of the pool per tenant (lora/pool_shares.py: whose adapters a load may evict).
        `host_executor` replaces the host-preparation pool (tests use it to order stagings);
        `b_rank_major`: the pages' B layout, as the model's LoRA op reads it; `max_registered`: adapter
        names held at most; `load_timeout_s`: a host preparation's deadline (see StagingPool);
        `huge_pages`: the pool's pages on 2 MiB pages where the OS allows (kernels/hugepages.py)."""
        if num_slots is not None and num_slots < 1:
            raise ValueError("max_loras must be at least 1")
        self.shapes, self.max_rank, self.device = shapes, max_rank, device
        self._registry = AdapterRegistry()
        self._pool = LoRAMemoryPool(num_slots, max_rank, shapes, device, dtype, b_rank_major, num_pages=num_pages,
                                    page_rank=page_rank, share_bytes=pool_shares, huge_pages=huge_pages)
        self._loader = OverlapLoader(copy_engine)
        self._source = source
        self.metrics = metrics or NullMetrics()
        self.max_registered = max_registered
        self._staging_pool = StagingPool(host_workers, load_timeout_s) if host_executor is None else None
        self._host_pool: concurrent.futures.Executor | StagingPool = host_executor or self._staging_pool
        self._staging: set[str] = set()  # uids whose host preparation is in flight
        self._admin_ops: list[AdminOp] = []
        self._waiting_unloads: dict[str, list[concurrent.futures.Future[None]]] = {}
        self.loads_total = 0
        self.evictions = dict.fromkeys(EVICTION_CAUSES, 0)
        self._step_buffers: LoRAStepBuffers | None = None  # allocated by step_buffers()
        self._expert_buffers: ExpertStepBuffers | None = None  # allocated by expert_step_buffers()
        pool = self._pool
        log.info("LoRA pool: %d pages of rank %d (%.1f KiB each) = %.1f MiB, %s", pool.num_pages, pool.page_rank,
                 pool.page_nbytes / 1024, pool.nbytes / 2**20,
                 f"at most {num_slots} adapters" if num_slots is not None else
                 f"{pool.max_rank_capacity} adapters of rank {max_rank}, more of lower ranks")
        if pool.shares:
            log.info("LoRA pool shares (pages): %s",
                     ", ".join(f"{tenant}={pages}" for tenant, pages in sorted(pool.shares.pages.items())))

    # ---- admin API (public: logs, wraps the private implementation) ----

    def load_adapter(
        self,
        name: str,
        uri: str,
        sha256: str | None = None,
        pinned: bool = False,
        preload: bool = False,
        on_demand: bool = False,
        owner: str | None = None,
    ) -> concurrent.futures.Future[AdapterVersion]:
        """Register `name` at `uri` (a new version if the name exists); resolves when registered,
        or once in a slot with preload/pinned. Validation errors surface through the future.
        `on_demand`: the adapter resolver's registration, which the registry may unregister when idle
        to make room for a new name; an operator's LoadAdapter of the name makes it theirs.
        `owner`: the tenant the adapter belongs to, whose share of the pool it takes (None: shared);
        another owner for a registered name is a new version."""
        log.info("load adapter %s from %s (owner=%s pinned=%s preload=%s on_demand=%s); %s", name, shown(uri),
                 owner or "shared", pinned, preload, on_demand, self._memory())
        return self._load_adapter(name, uri, sha256, pinned, preload, on_demand, owner)

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        """Stop new requests at once; in-flight ones finish, then the slot is freed."""
        log.info("unload adapter %s; %s", name, self._memory())
        entry = self._registry.resolve(name)
        self._registry.retire(name)
        for version in list(self._registry.versions.values()):
            if version.name == name:
                self._registry.mark_draining(version)  # versions still staging too, or one would become current later
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._waiting_unloads.setdefault(entry.uid, []).append(future)
        self._reap_drained()
        return future

    def _load_adapter(
        self, name: str, uri: str, sha256: str | None, pinned: bool, preload: bool, on_demand: bool,
        owner: str | None,
    ) -> concurrent.futures.Future[AdapterVersion]:
        future: concurrent.futures.Future[AdapterVersion] = concurrent.futures.Future()
        existing = self._registry.current.get(name)
        if existing is not None:
            current = self._registry.versions[existing]
            if current.uri == uri and current.sha256 == sha256 and current.owner == owner and current.failure is None:
                if pinned and not current.pinned:
                    self._check_pin_capacity(name, current.rank, owner)
                current.pinned = current.pinned or pinned
                if not on_demand:
                    self._registry.set_on_demand(name, False)
                self._admin_ops.append(AdminOp(current, future, preload or current.pinned))
                return future
        if name not in self._registry.names:
            self._make_room()
        if pinned:
            self._check_pin_capacity(name, 0, owner)
        entry = self._registry.add_version(name, uri, sha256, pinned, owner)
        # A new name from the resolver is its; a new version of a name an operator holds stays theirs.
        self._registry.set_on_demand(name, on_demand and (existing is None or name in self._registry.on_demand))
        self._start_staging(entry)
        self._admin_ops.append(AdminOp(entry, future, preload or pinned))
        return future

    def _make_room(self) -> None:
        """Before a new name is registered at the cap: unregister the least recently used idle
        on-demand adapter, or refuse. Idle: no request references it, no load is in flight for it and
        no LoadAdapter waits on it. O(registered) at worst, only when a new name arrives at the cap."""
        registry = self._registry
        if len(registry.names) < self.max_registered:
            return
        waited_on = {op.entry.uid for op in self._admin_ops if not op.future.done()}
        for name in registry.on_demand:
            uid = registry.current.get(name)
            if uid is None or registry.names[name] != 1 or uid in waited_on:
                continue
            entry = registry.versions[uid]
            if entry.refs or entry.pinned or entry.staging is not None or self._loader.is_loading(uid):
                continue
            log.info("registry full (%d names): unregistering idle on-demand adapter %s (least recently used)",
                     len(registry.names), uid)
            registry.retire(name)
            registry.mark_draining(entry)
            self._reap_drained()
            return
        held = f"{len(registry.names)} adapters are registered, the most this server holds (--max-registered-adapters)"
        if registry.on_demand:  # resolver registrations in use now: one becomes idle once its requests end
            raise ResourceExhaustedError(f"{held}; every on-demand adapter is in use, retry later")
        # Only an operator can make room (UnloadAdapter): retrying cannot succeed before that.
        raise FailedPreconditionError(f"{held}, all by LoadAdapter or preload; an operator must unload one")

    def _check_pin_capacity(self, name: str, rank: int, owner: str | None) -> None:
        """Pinning never takes every slot: room for one more adapter of the largest rank stays, in
        the pool and, with shares, in the owner's share (or in what the shares leave, for owners
        without one), so a tenant's loads always find room once its adapters are idle.
        Another version of the same name is replaced by this one, so it does not count; a version
        not staged yet (rank 0) counts at the largest rank."""
        others = [v for v in self._registry.versions.values() if v.pinned and not v.draining and v.name != name]
        pool = self._pool
        largest = pool.pages_for(self.max_rank)
        if pool.max_adapters is not None and len(others) + 1 >= pool.max_adapters:
            raise ResourceExhaustedError(f"pinning another adapter would leave no unpinned slot "
                                         f"({len(others)} of {pool.max_adapters} pinned)")
        pages = [pool.pages_for(v.rank or self.max_rank) for v in others]
        mine = pool.pages_for(rank or self.max_rank)
        if pool.max_adapters is None and sum(pages) + mine + largest > pool.num_pages:
            raise ResourceExhaustedError(
                f"pinning another adapter would leave no room for an unpinned one ({sum(pages)} of "
                f"{pool.num_pages} pages pinned)"
            )
        shares = pool.shares
        if shares:
            group = sum(pool.pages_for(v.rank or self.max_rank) for v in others if shares.in_group(owner, v.owner))
            budget = shares.pin_budget(owner, pool.num_pages)
            if group + mine + largest > budget:
                whose = "its tenant's share" if shares.share(owner) is not None else "the part no share holds"
                raise ResourceExhaustedError(
                    f"pinning another adapter would leave no room for an unpinned one in {whose} of the adapter "
                    f"pool ({group} of {budget} pages pinned)")

    # ---- request references ----

    def acquire(self, name: str, request_id: str) -> str:
        entry = self._registry.resolve(name)
        if entry.failure is not None:
            raise entry.failure
        self._registry.add_ref(entry, request_id)
        self._registry.used(name)
        return entry.uid

    def release(self, uid: str, request_id: str) -> None:
        """Drop one request's reference (idempotent, so every end path may call it)."""
        self._registry.drop_ref(uid, request_id)

    # ---- snapshots (scheduler thread; the bridge publishes them) ----

    def stats(self) -> LoRAStats:
        versions, pool = self._registry.versions, self._pool
        occupied = list(pool.uid_to_pages)
        by_rank: dict[int, int] = {}
        for uid in occupied:
            by_rank[versions[uid].rank] = by_rank.get(versions[uid].rank, 0) + 1
        return LoRAStats(
            slots_total=pool.max_rank_capacity,
            slots_occupied=len(occupied),
            slots_referenced=sum(1 for uid in occupied if versions[uid].refs),
            slots_pinned=sum(1 for uid in occupied if versions[uid].pinned),
            pending_loads=len(self._loader.pending),
            references=self._registry.total_refs(),
            loads_total=self.loads_total,
            evictions_total=self.evictions_total,
            pool_bytes_total=self.pages_nbytes,
            pool_bytes_used=(pool.num_pages - pool.free_pages) * pool.page_nbytes,
            resident_by_rank=tuple(sorted(by_rank.items())),
            evictions_by_cause=tuple(self.evictions.items()),
            pool_bytes_by_owner=tuple(sorted((owner, pages * pool.page_nbytes)
                                             for owner, pages in pool.pages_by_owner().items() if owner is not None)),
        )

    @property
    def evictions_total(self) -> int:
        """Adapters evicted to make room (the other causes are not evictions by the pool's choice)."""
        return self.evictions["capacity"]

    def adapters(self, limit: int | None = None, after: tuple[str, int] | None = None) -> list[AdapterInfo]:
        """Adapters ordered by (name, version): the first `limit` after `after` (a page).
        O(registered) per call, never per step: it runs only for a ListAdapters."""
        versions = self._registry.versions.values()
        if after is not None:
            versions = [v for v in versions if (v.name, v.version) > after]  # type: ignore[assignment]
        key = lambda v: (v.name, v.version)  # noqa: E731
        chosen = sorted(versions, key=key) if limit is None else heapq.nsmallest(limit, versions, key=key)
        return [self.adapter_info(v.uid) for v in chosen]

    def adapter_info(self, uid: str) -> AdapterInfo:
        """One registered version (KeyError if it is gone)."""
        v = self._registry.versions[uid]
        return AdapterInfo(
            name=v.name,
            version=v.version,
            uri=v.uri,
            state=self.state(v.uid).value,
            slot=-1 if (slot := self._pool.slot_of(v.uid)) is None else slot,
            pinned=v.pinned,
            rank=v.rank,
            size_bytes=v.size_bytes,
            active_requests=len(v.refs),
            owner=v.owner,
            loads=v.loads,
        )

    def has_version(self, uid: str) -> bool:
        return uid in self._registry.versions

    def is_current(self, name: str) -> bool:
        """Whether new requests may use `name` now (a dict lookup: safe from any thread)."""
        return name in self._registry.current

    def residency(self) -> list[tuple[str, AdapterState, LoadTier]]:
        """(name, state, where its next load's bytes come from) of each adapter's current version:
        what routers want to know about warm adapters (inference_service/frontend/residency.py)."""
        versions = self._registry.versions
        return [(name, self.state(uid), versions[uid].tier) for name, uid in self._registry.current.items()]

    def adapter_names(self) -> frozenset[str]:
        """The names new requests may use now."""
        return frozenset(self._registry.current)

    @property
    def adapter_names_changes(self) -> int:
        """Bumped whenever `adapter_names()` changes (O(1): a process bridge polls it every step)."""
        return self._registry.current_changes

    def uid_of(self, name: str) -> str:
        """The uid of the version of `name` new requests get (NotFoundError if none)."""
        return self._registry.resolve(name).uid

    # ---- what the model runner needs ----

    @property
    def num_slots(self) -> int:
        """Adapters of the largest rank the pool holds at once."""
        return self._pool.max_rank_capacity

    @property
    def page_rank(self) -> int:
        return self._pool.page_rank

    @property
    def zero_page(self) -> int:
        """A page of zeros no adapter holds (the torch op pads page lists with it)."""
        return self._pool.zero_page

    def pages_of(self, uid: str) -> tuple[int, ...]:
        """The pages of a resident adapter, in rank order (stable while a request references it)."""
        return self._pool.uid_to_pages[uid]

    @property
    def slot_dtype(self) -> torch.dtype:
        return self._pool.dtype

    @property
    def slots_nbytes(self) -> int:
        """Device bytes of the whole pool (its pages and the zero page)."""
        return self._pool.nbytes

    @property
    def pages_nbytes(self) -> int:
        """Device bytes of the pages adapters can use (the zero page not counted): what the pool's
        metrics call used + free, and GetModelInfo's lora_pool_bytes."""
        return self._pool.num_pages * self._pool.page_nbytes

    @property
    def slot_buffers(self) -> dict:
        """The slot buffers grouped as the model's fused projections read them."""
        return self._pool.group_buffers

    def weights_identity(self, uid: str) -> tuple[str, ...]:
        """What the prefix cache keys a LOADED adapter's KV by, never its name alone: the version's
        uid (`name@version`, never reused in this process, so a reload or a version swap under the
        same name is another key) and its pinned digest; without a digest, which staging of it the
        slot holds (a re-staging after an eviction may have read other bytes at the same URI)."""
        entry = self._registry.versions[uid]
        return ("lora", uid, f"sha256:{entry.sha256}" if entry.sha256 else f"staging:{entry.stagings}")

    def rank_of(self, uid: str) -> int:
        """The adapter's own rank where known (0 before it was staged or once it is gone)."""
        entry = self._registry.versions.get(uid)
        return entry.rank if entry is not None else 0

    # ---- scheduler hooks ----

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Wraps each forward pass and sampling (the CPU copy engine copies only between them)."""
        return self._loader.engine.computing()

    def drain(self) -> DrainResult:
        """Collect completed slot copies and host preparations; free drained versions. O(adapters
        in flight, draining or referenced), never O(registered)."""
        result = DrainResult()
        if self._staging_pool is not None:
            self._staging_pool.expire()
        for done in self._loader.drain():
            self._finish_load(done.load.uid, done.seconds, done.load.tier, done.error, result)
        for uid in list(self._staging):
            entry = self._registry.versions.get(uid)
            if entry is None or entry.staging is None:
                self._staging.discard(uid)
            elif entry.staging.done():
                self._finish_staging(entry, result)
        self._advance_admin_ops(result)
        self._reap_drained()
        return result

    def state(self, uid: str) -> AdapterState:
        entry = self._registry.versions[uid]
        if entry.failure is not None:
            return AdapterState.FAILED
        if entry.draining:
            return AdapterState.DRAINING
        if self._loader.is_loading(uid):
            return AdapterState.LOADING
        if uid in self._pool.uid_to_pages:
            return AdapterState.LOADED
        if entry.staging is not None:
            return AdapterState.STAGING
        if entry.host is not None:
            return AdapterState.HOST_READY
        return AdapterState.REGISTERED

    def slot_of(self, uid: str) -> int | None:
        """The slot of a LOADED adapter; None while its copy is in flight or it has no slot."""
        if self._loader.is_loading(uid):
            return None
        return self._pool.slot_of(uid)

    def ensure_loading(self, uid: str, needed: set[str]) -> bool:
        """Move an adapter towards LOADED without blocking: stage it, or copy it into a slot.

        `needed` holds the adapters that queued or running requests need: their slots are never
        taken. Returns False when no slot can be had now (the request waits, never errors).
        """
        entry = self._registry.versions[uid]
        if entry.failure is not None or uid in self._pool.uid_to_pages:
            return True
        if entry.host is None:
            if entry.staging is None and time.monotonic() >= entry.retry_at:
                self._start_staging(entry)
            return True
        return self._start_slot_load(entry, needed)

    def touch(self, uids: set[str]) -> None:
        for uid in uids:
            self._pool.touch(uid)

    def held_back_by(self, uid: str) -> Callable[[str], bool]:
        """Which adapters' later requests a request of `uid` that cannot get a slot holds back (the
        scheduler's aging barrier): those of adapters whose pool pages its load may take, its
        owner's and those of owners over their share or without one. Without shares: every one."""
        pool, versions = self._pool, self._registry.versions
        if not pool.shares:
            return lambda other: True
        owner, held = versions[uid].owner, pool.pages_by_owner()

        def competes(other: str) -> bool:
            theirs = versions[other].owner
            return theirs == owner or pool.shares.unprotected(theirs, held)

        return competes

    def unevictable(self, needed: set[str]) -> set[str]:
        versions = self._registry.versions
        pinned = {uid for uid in self._pool.uid_to_pages if versions[uid].pinned}
        return needed | pinned | set(self._loader.pending)

    def has_pending_work(self) -> bool:
        return bool(self._loader.pending) or bool(self._staging)

    def shutdown(self) -> None:
        for uid in list(self._loader.pending):
            self._loader.wait(uid)
        self._host_pool.shutdown(wait=False, cancel_futures=True)
        self._loader.engine.close()

    # ---- internals ----

    def _start_staging(self, entry: AdapterVersion) -> None:
        entry.stagings += 1
        if self._staging_pool is not None:
            entry.staging = self._staging_pool.submit(self._prepare, entry.uri, entry.sha256,
                                                      key=_source_key(entry.uri), on_orphan=_release_host)
        else:
            entry.staging = self._host_pool.submit(self._prepare, entry.uri, entry.sha256)
        self._staging.add(entry.uid)

    def _prepare(self, uri: str, sha256: str | None) -> HostAdapter:
        """On a host thread: fetch and validate, then make the tensors copyable asynchronously
        (page-locked on CUDA; a no-op for buffers the source already registered, and on CPU)."""
        host = self._source.fetch(uri, sha256, self._pool.host_form)
        pin = self._loader.engine.pin
        host.modules = {key: (pin(a), pin(b), scaling) for key, (a, b, scaling) in host.modules.items()}
        return host

    def _finish_staging(self, entry: AdapterVersion, result: DrainResult) -> None:
        future, entry.staging = entry.staging, None
        self._staging.discard(entry.uid)
        assert future is not None
        try:
            host: HostAdapter = future.result()
        except ResourceExhaustedError as exc:
            if entry.refs and self._registry.current.get(entry.name) == entry.uid:
                # The sidecar's cache is full of leased entries: transient. The waiting requests
                # keep waiting and staging is retried shortly, instead of failing the adapter.
                entry.retry_at = time.monotonic() + STAGING_RETRY_SECONDS
                log.info("staging adapter %s refused for now (%s); retrying", entry.uid, exc)
                return
            self._fail(entry, exc, result)
            return
        except LoraplexError as exc:
            self._fail(entry, exc, result)
            return
        except Exception as exc:  # noqa: BLE001 - a bug in a source must not kill the scheduler
            log.exception("preparing adapter %s failed", entry.uid)
            self._fail(entry, UnavailableError(f"preparing adapter {entry.name} failed: {exc}"), result)
            return
        if host.rank > self.max_rank:
            self._fail(entry, FailedPreconditionError(f"rank {host.rank} exceeds max {self.max_rank}"), result)
            return
        entry.host, entry.rank, entry.size_bytes, entry.tier = host, host.rank, host.size_bytes, host.tier
        log.info("adapter %s host-ready: rank %d, %.1f KiB from %s", entry.uid, host.rank, host.size_bytes / 1024,
                 host.tier)

    def _fail(self, entry: AdapterVersion, error: LoraplexError, result: DrainResult) -> None:
        log.warning("adapter %s from %s failed: %s: %s", entry.uid, shown(entry.uri), error.code,
                    shown(str(error), 500))
        result.failed[entry.uid] = error
        # Retryable failures leave the version REGISTERED so the next request tries again.
        if not isinstance(error, UnavailableError):
            entry.failure = error

    def _start_slot_load(self, entry: AdapterVersion, needed: set[str]) -> bool:
        """Make room (evicting the least recently used adapters nothing needs, by pages) and start
        the copy; False when the adapter cannot fit now."""
        host = entry.host
        assert host is not None
        victims = self._pool.find_room(host.rank, self.unevictable(needed | {entry.uid}), entry.owner)
        if victims is None:
            return False
        for victim in victims:
            self._evict(victim, "capacity", f"for {entry.uid} of {entry.owner or 'shared'}")
        pages = self._pool.assign(entry.uid, host.rank, entry.owner)
        self._loader.start(entry.uid, pages[0], self._pool.copy_into_pages(pages, host), entry.tier, time.monotonic())
        return True

    def _evict(self, uid: str, cause: str, why: str = "") -> None:
        owner = self._pool.uid_to_owner[uid]
        pages = self._pool.free(uid)
        self.evictions[cause] += 1
        if cause == "capacity":
            self.metrics.adapter_evicted()
        log.info("adapter %s of %s left the pool (%s%s): %d pages free", uid, owner or "shared", cause,
                 f", {why}" if why else "", len(pages))

    def _finish_load(
        self, uid: str, seconds: float, tier: LoadTier, error: BaseException | None, result: DrainResult
    ) -> None:
        entry = self._registry.versions[uid]
        if error is not None:
            self._evict(uid, "failed")
            self._drop_host(entry)
            self._fail(entry, UnavailableError(f"copying adapter {entry.name} into its slot failed: {error}"), result)
            return
        self._drop_host(entry)  # the slot holds it now; re-staging is cheap (sidecar cache)
        entry.tier = LoadTier.CACHE
        entry.loads += 1
        self.loads_total += 1
        self.metrics.adapter_loaded(tier, seconds)
        log.info("adapter %s loaded into pages %s in %.1f ms (%s)", uid, self._pool.uid_to_pages[uid], seconds * 1e3,
                 tier)

    def _advance_admin_ops(self, result: DrainResult) -> None:
        still: list[AdminOp] = []
        for op in self._admin_ops:
            entry = op.entry
            if op.future.done():
                continue
            if entry.draining or entry.uid not in self._registry.versions:
                op.future.set_exception(
                    UnloadedWhileLoadingError(f"adapter {entry.name} was unloaded or replaced while loading"))
                continue
            error = result.failed.get(entry.uid) or entry.failure
            if error is not None:
                self._discard_failed(entry)
                op.future.set_exception(error)
                log.info("load adapter %s failed after %.1f ms", entry.name, (time.monotonic() - op.started) * 1e3)
                continue
            if entry.staging is not None or (entry.host is None and entry.uid not in self._pool.uid_to_pages):
                if entry.staging is None:
                    self._start_staging(entry)  # evicted meanwhile: stage again for the preload
                still.append(op)
                continue
            current = self._registry.versions.get(self._registry.current.get(entry.name, ""))
            if current is not None and current.version > entry.version:
                self._registry.mark_draining(entry)  # a later LoadAdapter of this name got ready first and wins
                op.future.set_exception(FailedPreconditionError(
                    f"adapter {entry.name} version {entry.version} was superseded by version {current.version}"))
                continue
            if current is not entry:
                old = self._registry.make_current(entry)
                if old is not None:
                    self._registry.mark_draining(old)
                    log.info("version swap %s: %s → %s (old drains)", entry.name, old.uid, entry.uid)
            if op.preload and self.slot_of(entry.uid) is None:
                if entry.uid not in self._pool.uid_to_pages:  # not yet copying: try for a slot
                    self._start_slot_load(entry, self._referenced())
                still.append(op)
                continue
            if not op.preload and entry.host is not None and not entry.refs:
                self._drop_host(entry)  # registered without preload: keep no host copy around
            # Most recently used once ready: the resolver's request follows, and must find it registered.
            self._registry.used(entry.name)
            op.future.set_result(entry)
            log.info("adapter %s ready as %s (%s) in %.1f ms; %s", entry.name, entry.uid, self.state(entry.uid).value,
                     (time.monotonic() - op.started) * 1e3, self._memory())
        self._admin_ops = still

    def _discard_failed(self, entry: AdapterVersion) -> None:
        """A version that never became current is forgotten; a current one stays FAILED."""
        if self._registry.current.get(entry.name) != entry.uid and not entry.refs:
            self._registry.remove(entry.uid)

    def _reap_drained(self) -> None:
        for uid in list(self._registry.draining):
            entry = self._registry.versions[uid]
            if entry.refs or self._loader.is_loading(entry.uid):
                continue
            if entry.uid in self._pool.uid_to_pages:
                self._evict(entry.uid, "drained")
            if entry.staging is not None:
                entry.staging.cancel()
                self._staging.discard(entry.uid)
            self._drop_host(entry)
            self._registry.remove(entry.uid)
            for future in self._waiting_unloads.pop(entry.uid, []):
                future.set_result(None)

    def _drop_host(self, entry: AdapterVersion) -> None:
        host, entry.host = entry.host, None
        if host is not None and host.release is not None:
            self._host_pool.submit(host.release)  # a sidecar call: never on the scheduler thread

    def _referenced(self) -> set[str]:
        return set(self._registry.referenced)

    # ---- static buffers of a capture-safe decode step ----

    def step_buffers(self, max_rows: int) -> LoRAStepBuffers:
        """The LoRA metadata buffers of captured decode steps (lora/step_buffers.py), allocated on
        the first call, for the largest bucket, and the same ones ever after."""
        buffers = self._step_buffers
        if buffers is None:
            pool = self._pool
            buffers = LoRAStepBuffers(max_rows, pool.pages_for(pool.max_rank), pool.page_rank, pool.zero_page,
                                      self.device)
            self._step_buffers = buffers
            log.info("LoRA step buffers: %d rows, %.1f KiB; %s", max_rows, buffers.nbytes / 1024, self._memory())
        assert buffers.max_rows >= max_rows, f"step buffers hold {buffers.max_rows} rows, {max_rows} asked"
        return buffers

    def expert_step_buffers(self, max_tokens: int, top_k: int) -> ExpertStepBuffers:
        """The LoRA grouping buffers of an MoE model's (token, expert) pairs (lora/step_buffers.py),
        allocated on the first call for steps of up to `max_tokens` tokens, and the same ever after."""
        buffers = self._expert_buffers
        if buffers is None:
            pool = self._pool
            assert self.shapes.num_experts, "expert buffers for a model without experts"
            buffers = ExpertStepBuffers(max_tokens, top_k, pool.pages_for(pool.max_rank), pool.page_rank,
                                        pool.zero_page, pool.pages_per_expert, self.device)
            self._expert_buffers = buffers
            log.info("LoRA expert step buffers: %d tokens x %d experts, %.1f KiB", max_tokens, top_k,
                     buffers.nbytes / 1024)
        assert buffers.max_pairs >= max_tokens * top_k, f"expert buffers hold {buffers.max_pairs} pairs"
        return buffers

    def fill_step_buffers(self, rows: list[RowAdapter]) -> None:
        """Write each row's adapter (its pages and rank, as the model runner planned them; ((), 0) for
        the base model) into the step buffers in place, before a captured step runs. A rank not
        known (0 with pages) reads its pages whole: rows past the real rank are zeros."""
        assert self._step_buffers is not None, "step_buffers() first"
        self._step_buffers.fill([(pages, rank or self._pool.page_rank * len(pages)) if pages else ((), 0)
                                 for pages, rank in rows])

    def _memory(self) -> str:
        pool = self._pool
        where = "device" if self.device.type == "cuda" else "host"
        return (f"{pool.free_pages}/{pool.num_pages} pages of rank {pool.page_rank} free, "
                f"{free_memory(self.device) / 2**30:.2f} GiB {where} memory free")


def _source_key(uri: str) -> str:
    """Where an adapter's bytes come from, for the staging pool's per-source share."""
    parsed = urllib.parse.urlsplit(uri)
    return f"{parsed.scheme}://{parsed.netloc}"


def _release_host(host: HostAdapter) -> None:
    """An adapter prepared after its staging was abandoned: give back what it holds (a lease)."""
    if host.release is not None:
        host.release()
