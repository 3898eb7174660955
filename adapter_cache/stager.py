"""Stage = allow-list check, cache lookup, single-flight fetch, validate, commit, lease.

The one place that joins the pure host cache (under one lock) with I/O (object stores,
the shared-memory directory). Nothing reaches the cache index before it is fully written,
fsynced, checksummed, digest-checked and validated, so a half-written entry can never be served.

sha256 is computed only when a caller pins one: it is serial and, on a small node, costs more
CPU than the download. A hit whose entry was staged without a digest is hashed once, when a
caller first pins one. Every entry has a fast parallel checksum (see shm.py) for restarts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from adapter_cache.deadline import Deadline
from adapter_cache.host_cache import Entry, HostCache, Lease
from adapter_cache.metrics import CacheMetrics
from adapter_cache.shm import PartChecksum, PendingFile, ShmDir, StoredMeta, entry_key, sha256_of
from adapter_cache.store import (
    FetchConfig,
    Fetcher,
    FileStore,
    HttpStore,
    ObjectStore,
    S3Config,
    S3Store,
)
from inference_service.errors import (
    AdapterError,
    InvalidArgumentError,
    LoraplexError,
    ResourceExhaustedError,
    UnavailableError,
)
from inference_service.lora.adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoRAAdapterConfig,
    StreamingFiniteCheck,
    TensorEntry,
    parse_adapter_config,
    parse_adapter_tensors,
    safetensors_manifest,
)
from inference_service.uri_policy import UriPolicy

log = logging.getLogger(__name__)


@dataclass
class CacheConfig:
    shm_dir: str
    capacity_bytes: int
    allow_prefixes: list[str]
    max_adapter_bytes: int = 2 << 30
    max_config_bytes: int = 1 << 20
    max_rank: int = 256
    default_lease_s: float = 600.0
    max_lease_s: float = 900.0
    max_leases_per_client: int = 256
    follower_grace_s: float = 30.0  # a follower waits the fetch deadline plus this (validate, commit)
    lock_memory: bool = True
    group: int | None = None  # staged files readable by this group too (else the owner only)
    enable_http: bool = True
    fetch: FetchConfig = field(default_factory=FetchConfig)
    s3: S3Config = field(default_factory=S3Config)


@dataclass
class EntryMeta:
    path: str
    manifest: list[TensorEntry]
    config_json: str


@dataclass
class Staged:
    lease: Lease
    path: str
    manifest: list[TensorEntry]
    config_json: str
    size: int
    sha256: str  # "" unless a caller pinned a digest and it was verified
    cache_hit: bool


class _InOrderHasher:
    """sha256 of parts that arrive out of order, hashed as soon as they are contiguous.

    Hashing overlaps the remaining GETs (hashlib drops the GIL) instead of re-reading the
    whole file afterwards. One thread hashes at a time; the others just deposit their part.
    """

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._next = 0
        self._pending: dict[int, bytes] = {}
        self._busy = False
        self._lock = threading.Lock()

    def add(self, offset: int, data: bytes) -> None:
        with self._lock:
            self._pending[offset] = data
            if self._busy:
                return
            self._busy = True
        while True:
            with self._lock:
                chunk = self._pending.pop(self._next, None)
                if chunk is None:
                    self._busy = False
                    return
            self._hash.update(chunk)
            self._next += len(chunk)

    def hexdigest(self, size: int) -> str:
        if self._next != size:
            raise RuntimeError(f"hashed {self._next} of {size} bytes")
        return self._hash.hexdigest()


class _Flight:
    """One fetch in progress; callers of the same uri wait on it instead of fetching again
    (for a bounded time: see `Stager.follower_wait_s`)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: LoraplexError | None = None


class Stager:
    def __init__(
        self,
        cfg: CacheConfig,
        metrics: CacheMetrics | None = None,
        clock: Callable[[], float] = time.time,
        stores: dict[str, ObjectStore] | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics or CacheMetrics()
        self.policy = UriPolicy(cfg.allow_prefixes, flag="--allow-prefix")
        if stores is None:
            stores = {"s3": S3Store(cfg.s3), "file": FileStore(self.policy)}
            if cfg.enable_http:
                stores["http"] = stores["https"] = HttpStore(cfg.s3.read_timeout_s)
        self.fetcher = Fetcher(stores, cfg.fetch, self.metrics.on_request, self.metrics.on_bytes)
        self.shm = ShmDir(cfg.shm_dir, lock_memory=cfg.lock_memory, group=cfg.group)
        self.cache = HostCache(cfg.capacity_bytes, clock)
        self._clock = clock
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self.metrics.bind_state(
            used=lambda: self.cache.used_bytes,
            entries=lambda: len(self.cache.entries()),
            leases=lambda: self.cache.lease_count,
            capacity=cfg.capacity_bytes,
        )
        self._recover()

    # --- start-up --------------------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild the index from the directory so a restarted sidecar serves warm."""
        restored = []
        for meta in self.shm.recover():
            key = entry_key(meta.uri)
            mm = self.shm.open_map(key)
            try:
                manifest = safetensors_manifest(mm)
            except AdapterError as exc:
                log.warning("dropping staged %s at restart: %s", meta.uri, exc)
                self.shm.remove(meta.uri)
                continue
            finally:
                mm.close()
            path = str(self.shm.data_path(key))
            restored.append(Entry(meta.uri, meta.size, meta.sha256, meta.last_used,
                                  meta=EntryMeta(path, manifest, meta.config_json)))
        for entry in self.cache.restore(restored):
            log.info("dropping staged %s at restart: over the byte budget", entry.uri)
            self.shm.remove(entry.uri)
        for entry in self.cache.entries():
            self.shm.lock(entry_key(entry.uri))
        log.info("recovered %d staged adapter(s), %d bytes, from %s",
                 len(self.cache.entries()), self.cache.used_bytes, self.cfg.shm_dir)

    # --- public API ------------------------------------------------------------------------
    @property
    def follower_wait_s(self) -> float:
        """How long a caller waits on another caller's fetch of the same uri: the fetch deadline
        plus time to validate and commit. A leader stuck past that is not waited on forever."""
        return self.cfg.fetch.deadline_s + self.cfg.follower_grace_s

    def stage(self, uri: str, sha256: str = "", lease_seconds: float = 0, owner: str = "",
              wait_s: float | None = None) -> Staged:
        """Stage `uri` (fetching it at most once however many callers ask) and lease it to `owner`.

        A caller that finds the uri already being fetched waits at most `wait_s` (its own RPC
        deadline, say), and never longer than `follower_wait_s`.
        """
        uri = self.policy.check(uri)
        sha256 = sha256.lower()
        lease_s = min(lease_seconds or self.cfg.default_lease_s, self.cfg.max_lease_s)
        wait_s = self.follower_wait_s if wait_s is None else min(wait_s, self.follower_wait_s)
        while True:
            with self._lock:
                self._check_lease_cap(owner)
                entry = self.cache.get(uri)
                if entry is not None:
                    lease = self.cache.acquire(uri, lease_s, hit=True, owner=owner)
                else:
                    flight = self._flights.get(uri)
                    leader = flight is None
                    if leader:
                        flight = self._flights[uri] = _Flight()
            if entry is not None:
                if sha256 and entry.sha256 != sha256:
                    self._check_pinned_digest(entry, lease, sha256)
                self.metrics.hits.inc()
                log.info("stage %s: hit, lease %s", uri, lease.lease_id)
                return self._staged(entry, lease, hit=True)
            if leader:
                return self._lead(uri, sha256, lease_s, owner, flight)
            self.metrics.followers.inc()
            try:
                finished = flight.done.wait(wait_s)
            finally:
                self.metrics.followers.dec()
            if not finished:
                raise UnavailableError(f"{uri} is being fetched by another call that has not finished "
                                       f"within {wait_s:.3g}s; retry later")
            if flight.error is not None:
                raise flight.error

    def release(self, lease_id: str, owner: str | None = None) -> None:
        """Give a lease back; with `owner`, only a lease that caller holds is found."""
        with self._lock:
            uri = self.cache.release(lease_id, owner)
        log.info("released lease %s on %s", lease_id, uri)

    def read(self, lease_id: str, chunk_bytes: int, owner: str | None = None) -> Iterator[tuple[int, bytes]]:
        """The staged bytes of a leased entry, for clients that do not share the directory."""
        with self._lock:
            self._expire()
            path = self.cache.entry_for_lease(lease_id, owner).meta.path
        with open(path, "rb") as fh:
            offset = 0
            while chunk := fh.read(chunk_bytes):
                yield offset, chunk
                offset += len(chunk)

    def evict(self, uri: str = "") -> list[str]:
        with self._lock:
            victims = self.cache.evict(self.policy.check(uri) if uri else None)
        for entry in victims:
            self._drop(entry, "evicted on request")
        return [e.uri for e in victims]

    def list(self) -> list[Entry]:
        with self._lock:
            self._expire()
            return self.cache.entries()

    def close(self) -> None:
        self.fetcher.close()
        self.shm.close()

    # --- internals -------------------------------------------------------------------------
    def _staged(self, entry: Entry, lease: Lease, hit: bool) -> Staged:
        meta: EntryMeta = entry.meta
        return Staged(lease, meta.path, meta.manifest, meta.config_json, entry.size, entry.sha256, hit)

    def _check_pinned_digest(self, entry: Entry, lease: Lease, sha256: str) -> None:
        """A hit whose caller pins a digest: hash the entry if it never was (it holds a lease, so
        it cannot be evicted meanwhile), then compare; on a mismatch the lease is given back."""
        if not entry.sha256:
            with self.shm.open_map(entry_key(entry.uri)) as mm:  # entries are never empty files
                digest = sha256_of(mm)
            with self._lock:
                entry.sha256 = digest
        if entry.sha256 != sha256:
            self.release(lease.lease_id)
            raise InvalidArgumentError(f"{entry.uri}: staged copy has sha256 {entry.sha256}, request expects {sha256}")

    def _check_lease_cap(self, owner: str) -> None:
        """Under the lock: one caller cannot pin the cache with leases (the rest still stage)."""
        if self.cache.leases_of(owner) >= self.cfg.max_leases_per_client:
            self._expire()
            if self.cache.leases_of(owner) >= self.cfg.max_leases_per_client:
                raise ResourceExhaustedError(
                    f"caller {owner or 'local'} holds {self.cache.leases_of(owner)} leases, the most one caller "
                    f"may hold (--max-leases-per-client); release some first"
                )

    def _expire(self) -> None:
        for lease in self.cache.expire():
            log.info("lease %s on %s expired", lease.lease_id, lease.uri)

    def _drop(self, entry: Entry, why: str) -> None:
        self.shm.remove(entry.uri)
        self.metrics.evictions.inc()
        log.info("evicted %s (%d bytes): %s", entry.uri, entry.size, why)

    def _lead(self, uri: str, sha256: str, lease_s: float, owner: str, flight: _Flight) -> Staged:
        self.metrics.misses.inc()
        self.metrics.inflight.inc()
        try:
            entry = self._fetch(uri, sha256)
            with self._lock:
                self.cache.commit(entry)
                lease = self.cache.acquire(uri, lease_s, hit=False, owner=owner)
            self.shm.lock(entry_key(uri))
            log.info("stage %s: fetched %d bytes, lease %s", uri, entry.size, lease.lease_id)
            return self._staged(entry, lease, hit=False)
        except LoraplexError as exc:
            flight.error = exc
            log.warning("stage %s failed: %s: %s", uri, exc.code, exc)
            raise
        except Exception as exc:  # a bug: followers must still be woken with an error
            flight.error = LoraplexError(f"{uri}: internal error: {exc}")
            raise
        finally:
            self.metrics.inflight.dec()
            with self._lock:
                del self._flights[uri]
            flight.done.set()

    def _fetch(self, uri: str, sha256: str) -> Entry:
        """Fetch config then weights into a temp file; digest-check and validate; commit the file.
        Both GETs run under one deadline (--fetch-deadline-seconds)."""
        deadline = self.fetcher.deadline(uri)
        try:
            return self._fetch_within(uri, sha256, deadline)
        finally:
            deadline.cancel()

    def _fetch_within(self, uri: str, sha256: str, deadline: Deadline) -> Entry:
        config_raw = self.fetcher.get_small(f"{uri}/{CONFIG_FILE}", self.cfg.max_config_bytes, deadline)
        config = parse_adapter_config(config_raw, self.cfg.max_rank)
        pending: list[PendingFile] = []
        checksum = PartChecksum(self.cfg.fetch.part_bytes)
        hasher = _InOrderHasher() if sha256 else None
        finite: list[StreamingFiniteCheck] = []

        def write(sink: PendingFile, data: memoryview, offset: int) -> None:
            sink.pwrite(data, offset)
            checksum.add(offset, data)
            if hasher is not None:
                hasher.add(offset, bytes(data))  # the fetch buffer is reused once this returns
            # While the part is in cache, on this fetch thread (one torch thread: see _validate).
            torch.set_num_threads(1)
            if offset == 0:
                finite.append(StreamingFiniteCheck(sink.size))
            finite[0].add(offset, data)

        def open_sink(size: int) -> PendingFile:
            with self._lock:
                victims = self.cache.reserve(uri, size)
            for victim in victims:
                self._drop(victim, f"LRU, to make room for {uri}")
            pending.append(self.shm.create(uri, size))
            return pending[0]

        try:
            self.fetcher.fetch(f"{uri}/{WEIGHTS_FILE}", self.cfg.max_adapter_bytes, open_sink, write, deadline)
            file = pending[0]
            digest = hasher.hexdigest(file.size) if hasher is not None else ""
            if digest != sha256:
                raise InvalidArgumentError(f"{uri}: sha256 mismatch: got {digest}, expected {sha256}")
            manifest = self._validate(file, config, uri, finite[0])
            now = self._clock()
            config_json = config_raw.decode()
            meta = StoredMeta(uri, checksum.hexdigest(file.size), checksum.part_bytes, digest, file.size,
                              config_json, now)
            path = file.commit(meta)
        except BaseException:
            if pending:
                pending[0].discard()
                with self._lock:
                    self.cache.abort(uri)
            raise
        return Entry(uri, file.size, digest, now, meta=EntryMeta(str(path), manifest, config_json))

    def _validate(
        self, file: PendingFile, config: LoRAAdapterConfig, uri: str, finite: StreamingFiniteCheck
    ) -> list[TensorEntry]:
        """The shared PEFT checks, run on a mapping of the temp file before it is committed; the
        values were checked for NaN/Inf as the parts arrived, unless `finite` could not."""
        # One torch thread per handler: the sidecar shares the node's cores with the inference
        # service, and OpenMP teams fighting over busy cores spin-wait (2 s instead of 30 ms here).
        torch.set_num_threads(1)
        mm = file.map()
        problem = None
        try:
            manifest = safetensors_manifest(mm)
            checked = finite.finish(mm)
            parse_adapter_tensors(mm, config, self.cfg.max_rank, manifest, check_finite=not checked)
        except AdapterError as exc:
            # Re-raised below, outside this block: the original traceback holds tensor views
            # into the mapping, which must be gone before it can be closed.
            problem = str(exc)
        finally:
            if problem is None:
                mm.close()
        if problem is not None:
            _close_quietly(mm)
            raise AdapterError(f"{uri}: {problem}")
        return manifest


def _close_quietly(mm) -> None:
    try:
        mm.close()
    except BufferError:  # a view survived; the mapping is freed when it is collected
        pass

