"""LoRAManager: the only entry point for adapters (registry, slot pool, overlap loader).

Runs on the scheduler thread only, so its state needs no locks. Host preparation (fetching,
validating) runs on a thread pool and slot copies on the copy engine; both are collected by
`drain()`, which the scheduler calls before every status or capacity decision.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
import urllib.parse
from dataclasses import dataclass, field

import torch

from inference_service.device import CopyEngine
from inference_service.errors import (
    FailedPreconditionError,
    LoraplexError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from inference_service.limits import shown
from inference_service.lora.adapter import BaseModelShapes, HostAdapter
from inference_service.lora.mem_pool import LoRAMemoryPool
from inference_service.lora.overlap_loader import OverlapLoader
from inference_service.lora.registry import AdapterRegistry, AdapterState, AdapterVersion
from inference_service.lora.source import AdapterSource
from inference_service.lora.staging_pool import StagingPool
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


@dataclass
class DrainResult:
    """What `drain` found: versions whose preparation failed (their waiters must fail)."""

    failed: dict[str, LoraplexError] = field(default_factory=dict)


class LoRAManager:
    def __init__(
        self,
        num_slots: int,
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
    ) -> None:
        """`host_executor` replaces the host-preparation pool (tests use it to order stagings);
        `b_rank_major`: the slots' B layout, as the model's LoRA op reads it; `max_registered`: adapter
        names held at most; `load_timeout_s`: a host preparation's deadline (see StagingPool)."""
        if num_slots < 1:
            raise ValueError("max_loras must be at least 1")
        self.shapes, self.max_rank, self.device = shapes, max_rank, device
        self.registry = AdapterRegistry()
        self.pool = LoRAMemoryPool(num_slots, max_rank, shapes, device, dtype, b_rank_major)
        self.loader = OverlapLoader(copy_engine)
        self.source = source
        self.metrics = metrics or NullMetrics()
        self.max_registered = max_registered
        self._staging_pool = StagingPool(host_workers, load_timeout_s) if host_executor is None else None
        self._host_pool: concurrent.futures.Executor | StagingPool = host_executor or self._staging_pool
        self._staging: set[str] = set()  # uids whose host preparation is in flight
        self._admin_ops: list[AdminOp] = []
        self._waiting_unloads: dict[str, list[concurrent.futures.Future[None]]] = {}
        self.loads_total = 0
        self.evictions_total = 0
        log.info("LoRA slots: %d x rank %d = %.1f MiB", num_slots, max_rank, self.pool.nbytes / 2**20)

    # ---- admin API (public: logs, wraps the private implementation) ----

    def load_adapter(
        self,
        name: str,
        uri: str,
        sha256: str | None = None,
        pinned: bool = False,
        preload: bool = False,
    ) -> concurrent.futures.Future[AdapterVersion]:
        """Register `name` at `uri` (a new version if the name exists); resolves when registered,
        or once in a slot with preload/pinned. Validation errors surface through the future."""
        log.info("load adapter %s from %s (pinned=%s preload=%s); %s", name, shown(uri), pinned, preload,
                 self._memory())
        return self._load_adapter(name, uri, sha256, pinned, preload)

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        """Stop new requests at once; in-flight ones finish, then the slot is freed."""
        log.info("unload adapter %s; %s", name, self._memory())
        entry = self.registry.resolve(name)
        del self.registry.current[name]
        for version in list(self.registry.versions.values()):
            if version.name == name:
                self.registry.mark_draining(version)  # versions still staging too, or one would become current later
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._waiting_unloads.setdefault(entry.uid, []).append(future)
        self._reap_drained()
        return future

    def set_pinned(self, name: str, pinned: bool) -> concurrent.futures.Future[AdapterVersion]:
        """Pin the current version (resolves once in a slot) or unpin it (evictable again)."""
        log.info("%s adapter %s; %s", "pin" if pinned else "unpin", name, self._memory())
        entry = self.registry.resolve(name)
        if pinned:
            return self._load_adapter(name, entry.uri, entry.sha256, True, True)
        entry.pinned = False
        future: concurrent.futures.Future[AdapterVersion] = concurrent.futures.Future()
        future.set_result(entry)
        return future

    def _load_adapter(
        self, name: str, uri: str, sha256: str | None, pinned: bool, preload: bool
    ) -> concurrent.futures.Future[AdapterVersion]:
        future: concurrent.futures.Future[AdapterVersion] = concurrent.futures.Future()
        existing = self.registry.current.get(name)
        if existing is not None:
            current = self.registry.versions[existing]
            if current.uri == uri and current.sha256 == sha256 and current.failure is None:
                if pinned and not current.pinned:
                    self._check_pin_capacity(name)
                current.pinned = current.pinned or pinned
                self._admin_ops.append(AdminOp(current, future, preload or current.pinned))
                return future
        if name not in self.registry.names and len(self.registry.names) >= self.max_registered:
            raise ResourceExhaustedError(
                f"{len(self.registry.names)} adapters are registered, the most this server holds "
                "(--max-registered-adapters); unload one first"
            )
        if pinned:
            self._check_pin_capacity(name)
        entry = self.registry.add_version(name, uri, sha256, pinned)
        self._start_staging(entry)
        self._admin_ops.append(AdminOp(entry, future, preload or pinned))
        return future

    def _check_pin_capacity(self, name: str) -> None:
        # Another version of the same name is replaced by this one, so it does not count.
        pinned = sum(1 for v in self.registry.versions.values() if v.pinned and not v.draining and v.name != name)
        if pinned + 1 >= self.pool.num_slots:
            raise ResourceExhaustedError(
                f"pinning another adapter would leave no unpinned slot ({pinned} of {self.pool.num_slots} pinned)"
            )

    # ---- request references ----

    def acquire(self, name: str, request_id: str) -> str:
        entry = self.registry.resolve(name)
        if entry.failure is not None:
            raise entry.failure
        self.registry.add_ref(entry, request_id)
        return entry.uid

    def release(self, uid: str, request_id: str) -> None:
        """Drop one request's reference (idempotent, so every end path may call it)."""
        self.registry.drop_ref(uid, request_id)

    # ---- scheduler hooks ----

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Wraps each forward pass and sampling (the CPU copy engine copies only between them)."""
        return self.loader.engine.computing()

    def drain(self) -> DrainResult:
        """Collect completed slot copies and host preparations; free drained versions. O(adapters
        in flight, draining or referenced), never O(registered)."""
        result = DrainResult()
        if self._staging_pool is not None:
            self._staging_pool.expire()
        for done in self.loader.drain():
            self._finish_load(done.load.uid, done.seconds, done.load.tier, done.error, result)
        for uid in list(self._staging):
            entry = self.registry.versions.get(uid)
            if entry is None or entry.staging is None:
                self._staging.discard(uid)
            elif entry.staging.done():
                self._finish_staging(entry, result)
        self._advance_admin_ops(result)
        self._reap_drained()
        return result

    def state(self, uid: str) -> AdapterState:
        entry = self.registry.versions[uid]
        if entry.failure is not None:
            return AdapterState.FAILED
        if entry.draining:
            return AdapterState.DRAINING
        if self.loader.is_loading(uid):
            return AdapterState.LOADING
        if uid in self.pool.uid_to_slot:
            return AdapterState.LOADED
        if entry.staging is not None:
            return AdapterState.STAGING
        if entry.host is not None:
            return AdapterState.HOST_READY
        return AdapterState.REGISTERED

    def slot_of(self, uid: str) -> int | None:
        """The slot of a LOADED adapter; None while its copy is in flight or it has no slot."""
        if self.loader.is_loading(uid):
            return None
        return self.pool.uid_to_slot.get(uid)

    def ensure_loading(self, uid: str, needed: set[str]) -> bool:
        """Move an adapter towards LOADED without blocking: stage it, or copy it into a slot.

        `needed` holds the adapters that queued or running requests need: their slots are never
        taken. Returns False when no slot can be had now (the request waits, never errors).
        """
        entry = self.registry.versions[uid]
        if entry.failure is not None or uid in self.pool.uid_to_slot:
            return True
        if entry.host is None:
            if entry.staging is None and time.monotonic() >= entry.retry_at:
                self._start_staging(entry)
            return True
        return self._start_slot_load(entry, needed)

    def touch(self, uids: set[str]) -> None:
        for uid in uids:
            self.pool.touch(uid)

    def unevictable(self, needed: set[str]) -> set[str]:
        versions = self.registry.versions
        pinned = {uid for uid in self.pool.slot_to_uid if uid is not None and versions[uid].pinned}
        return needed | pinned | set(self.loader.pending)

    def has_pending_work(self) -> bool:
        return bool(self.loader.pending) or bool(self._staging)

    def shutdown(self) -> None:
        for uid in list(self.loader.pending):
            self.loader.wait(uid)
        self._host_pool.shutdown(wait=False, cancel_futures=True)
        self.loader.engine.close()

    # ---- internals ----

    def _start_staging(self, entry: AdapterVersion) -> None:
        if self._staging_pool is not None:
            entry.staging = self._staging_pool.submit(self._prepare, entry.uri, entry.sha256,
                                                      key=_source_key(entry.uri), on_orphan=_release_host)
        else:
            entry.staging = self._host_pool.submit(self._prepare, entry.uri, entry.sha256)
        self._staging.add(entry.uid)

    def _prepare(self, uri: str, sha256: str | None) -> HostAdapter:
        """On a host thread: fetch and validate, then make the tensors copyable asynchronously
        (page-locked on CUDA; a no-op for buffers the source already registered, and on CPU)."""
        host = self.source.fetch(uri, sha256, self.pool.host_form)
        pin = self.loader.engine.pin
        host.modules = {key: (pin(a), pin(b), scaling) for key, (a, b, scaling) in host.modules.items()}
        return host

    def _finish_staging(self, entry: AdapterVersion, result: DrainResult) -> None:
        future, entry.staging = entry.staging, None
        self._staging.discard(entry.uid)
        assert future is not None
        try:
            host: HostAdapter = future.result()
        except ResourceExhaustedError as exc:
            if entry.refs and self.registry.current.get(entry.name) == entry.uid:
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
        slot = self.pool.find_slot(self.unevictable(needed | {entry.uid}))
        if slot is None:
            return False
        victim = self.pool.slot_to_uid[slot]
        if victim is not None:
            self._evict(victim)
        host = entry.host
        assert host is not None
        self.pool.assign(slot, entry.uid)
        tier = entry.tier
        self.loader.start(entry.uid, slot, self.pool.copy_into_slot(slot, host), tier, time.monotonic())
        return True

    def _evict(self, uid: str) -> None:
        slot = self.pool.free(uid)
        self.evictions_total += 1
        self.metrics.adapter_evicted()
        log.info("evicted adapter %s from slot %d", uid, slot)

    def _finish_load(
        self, uid: str, seconds: float, tier: str, error: BaseException | None, result: DrainResult
    ) -> None:
        entry = self.registry.versions[uid]
        if error is not None:
            self.pool.free(uid)
            self._drop_host(entry)
            self._fail(entry, UnavailableError(f"copying adapter {entry.name} into its slot failed: {error}"), result)
            return
        self._drop_host(entry)  # the slot holds it now; re-staging is cheap (sidecar cache)
        entry.tier = "cache"
        self.loads_total += 1
        self.metrics.adapter_loaded(tier, seconds)
        log.info("adapter %s loaded into slot %d in %.1f ms (%s)", uid, self.pool.uid_to_slot[uid], seconds * 1e3,
                 tier)

    def _advance_admin_ops(self, result: DrainResult) -> None:
        still: list[AdminOp] = []
        for op in self._admin_ops:
            entry = op.entry
            if op.future.done():
                continue
            if entry.draining or entry.uid not in self.registry.versions:
                op.future.set_exception(NotFoundError(f"adapter {entry.name} was unloaded or replaced while loading"))
                continue
            error = result.failed.get(entry.uid) or entry.failure
            if error is not None:
                self._discard_failed(entry)
                op.future.set_exception(error)
                log.info("load adapter %s failed after %.1f ms", entry.name, (time.monotonic() - op.started) * 1e3)
                continue
            if entry.staging is not None or (entry.host is None and entry.uid not in self.pool.uid_to_slot):
                if entry.staging is None:
                    self._start_staging(entry)  # evicted meanwhile: stage again for the preload
                still.append(op)
                continue
            current = self.registry.versions.get(self.registry.current.get(entry.name, ""))
            if current is not None and current.version > entry.version:
                self.registry.mark_draining(entry)  # a later LoadAdapter of this name got ready first and wins
                op.future.set_exception(FailedPreconditionError(
                    f"adapter {entry.name} version {entry.version} was superseded by version {current.version}"))
                continue
            if current is not entry:
                old = self.registry.make_current(entry)
                if old is not None:
                    self.registry.mark_draining(old)
                    log.info("version swap %s: %s → %s (old drains)", entry.name, old.uid, entry.uid)
            if op.preload and self.slot_of(entry.uid) is None:
                if entry.uid not in self.pool.uid_to_slot:  # not yet copying: try for a slot
                    self._start_slot_load(entry, self._referenced())
                still.append(op)
                continue
            if not op.preload and entry.host is not None and not entry.refs:
                self._drop_host(entry)  # registered without preload: keep no host copy around
            op.future.set_result(entry)
            log.info("adapter %s ready as %s (%s) in %.1f ms; %s", entry.name, entry.uid, self.state(entry.uid).value,
                     (time.monotonic() - op.started) * 1e3, self._memory())
        self._admin_ops = still

    def _discard_failed(self, entry: AdapterVersion) -> None:
        """A version that never became current is forgotten; a current one stays FAILED."""
        if self.registry.current.get(entry.name) != entry.uid and not entry.refs:
            self.registry.remove(entry.uid)

    def _reap_drained(self) -> None:
        for uid in list(self.registry.draining):
            entry = self.registry.versions[uid]
            if entry.refs or self.loader.is_loading(entry.uid):
                continue
            if entry.uid in self.pool.uid_to_slot:
                slot = self.pool.free(entry.uid)
                log.info("drained adapter %s freed slot %d", entry.uid, slot)
            if entry.staging is not None:
                entry.staging.cancel()
                self._staging.discard(entry.uid)
            self._drop_host(entry)
            self.registry.remove(entry.uid)
            for future in self._waiting_unloads.pop(entry.uid, []):
                future.set_result(None)

    def _drop_host(self, entry: AdapterVersion) -> None:
        host, entry.host = entry.host, None
        if host is not None and host.release is not None:
            self._host_pool.submit(host.release)  # a sidecar call: never on the scheduler thread

    def _referenced(self) -> set[str]:
        return set(self.registry.referenced)

    def _memory(self) -> str:
        free_slots = sum(1 for uid in self.pool.slot_to_uid if uid is None)
        text = f"{free_slots}/{self.pool.num_slots} slots free"
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            text += f", {free / 2**30:.2f} GiB device memory free"
        return text


def _source_key(uri: str) -> str:
    """Where an adapter's bytes come from, for the staging pool's per-source share."""
    parsed = urllib.parse.urlsplit(uri)
    return f"{parsed.scheme}://{parsed.netloc}"


def _release_host(host: HostAdapter) -> None:
    """An adapter prepared after its staging was abandoned: give back what it holds (a lease)."""
    if host.release is not None:
        host.release()
