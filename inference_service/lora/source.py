"""Where adapter bytes come from. Runs on host-loader threads, never on the scheduler thread."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from adapter_cache.adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    BaseModelShapes,
    HostAdapter,
    LoadTier,
    load_adapter_dir,
)
from adapter_cache.errors import InvalidArgumentError
from adapter_cache.uri_policy import local_path

HostForm = Callable[[HostAdapter], HostAdapter]


class AdapterSource(Protocol):
    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        """Validated host tensors for the adapter at `uri`; raises LoraplexError subclasses.

        `host_form` turns a freshly read adapter into the form it is kept and copied in (the
        slots' layout, `LoRAMemoryPool.host_form`); a source with a host cache keeps that form.
        The returned adapter's `tier` says where the bytes came from (cache | store)."""


class LocalDirectorySource:
    """PEFT directories on the local filesystem (file:// URIs or plain paths).

    Validated adapters are kept in host memory, least recently used first out, up to
    `cache_bytes`: an adapter evicted from its slot and wanted again is copied from there instead
    of read, parsed and checked again (what the sidecar's shared-memory cache does for remote
    adapters). An entry is only used while both files keep the size, mtime and inode it was read
    with. Entries are kept in the caller's `host_form`, so a repeated load is plain copies.
    """

    def __init__(self, shapes: BaseModelShapes, max_rank: int, cache_bytes: int = 0) -> None:
        self.shapes, self.max_rank, self.cache_bytes = shapes, max_rank, cache_bytes
        self._cache: OrderedDict[Path, tuple[tuple, HostAdapter, str | None]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # fetches run on several host-loader threads

    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        path = local_path(uri)
        stamp = _file_stamp(path)
        with self._lock:
            hit = self._cache.get(path)
            if hit is not None and (hit[0] != stamp or (sha256 is not None and hit[2] is None)):
                # The files changed since, or a digest is asked for that was not taken when they
                # were read (the raw bytes are not kept): read them again.
                hit = None
            if hit is not None:
                self._cache.move_to_end(path)
        digest: str | None
        if hit is not None:
            _, adapter, digest = hit
            tier = LoadTier.CACHE
        else:
            adapter, tier = load_adapter_dir(path, self.shapes, self.max_rank), LoadTier.STORE
            digest = None if sha256 is None else hashlib.sha256(bytes(adapter.keepalive)).hexdigest()  # type: ignore[arg-type]
        if sha256 is not None and digest != sha256.lower():
            raise InvalidArgumentError(f"{WEIGHTS_FILE} sha256 {digest} does not match the expected {sha256}")
        if tier is LoadTier.STORE:
            adapter = host_form(adapter) if host_form is not None else adapter
            if stamp is not None:
                self._remember(path, stamp, adapter, digest)
        # Each caller gets its own record (the manager sets fields on it); the tensors are shared
        # and only ever read.
        return dataclasses.replace(adapter, tier=tier)

    def _remember(self, path: Path, stamp: tuple, adapter: HostAdapter, digest: str | None) -> None:
        if adapter.size_bytes > self.cache_bytes:
            return
        with self._lock:
            old = self._cache.pop(path, None)
            if old is not None:
                self._cached_bytes -= old[1].size_bytes
            self._cache[path] = (stamp, adapter, digest)
            self._cached_bytes += adapter.size_bytes
            while self._cached_bytes > self.cache_bytes:
                _, (_, evicted, _) = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.size_bytes


def _file_stamp(path: Path) -> tuple | None:
    """What says the adapter's files are unchanged since they were read; None if unreadable."""
    try:
        return tuple((st.st_size, st.st_mtime_ns, st.st_ino) for st in (
            (path / name).stat() for name in (CONFIG_FILE, WEIGHTS_FILE)))
    except OSError:
        return None
