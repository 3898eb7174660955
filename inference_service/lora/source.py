"""Where adapter bytes come from. Runs on host-loader threads, never on the scheduler thread."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from adapter_cache import file_access
from adapter_cache.adapter_format import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    BaseModelShapes,
    HostAdapter,
    LoadTier,
    load_adapter_bytes,
    max_weights_bytes,
)
from adapter_cache.errors import InvalidArgumentError
from adapter_cache.uri_policy import UriPolicy, local_path

HostForm = Callable[[HostAdapter], HostAdapter]


class AdapterSource(Protocol):
    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        """Validated host tensors for the adapter at `uri`; raises LoraplexError subclasses.

        `host_form` turns a freshly read adapter into the form it is kept and copied in (the
        slots' layout, `LoRAMemoryPool.host_form`); a source with a host cache keeps that form.
        The returned adapter's `tier` says where the bytes came from (cache | store)."""


class LocalDirectorySource:
    """PEFT directories on the local filesystem (file:// URIs or plain paths).

    Files are opened on every fetch by `file_access.open_regular`, the rule the sidecar's
    FileStore follows too: regular files only, inside the `allow` list's file:// roots at open
    time, within the size bounds. With no `allow` list at all there is no root to confine to: the
    engine then trusts its caller (the server refuses every URI without --adapter-source-allow).

    Validated adapters are kept in host memory, least recently used first out, up to
    `cache_bytes`: an adapter evicted from its slot and wanted again is copied from there instead
    of parsed and checked again (what the sidecar's shared-memory cache does for remote adapters).
    Both files are still read on every fetch and an entry is used only for the same content: it
    is keyed by the SHA-256 of the config and of the weights as read now, never by the file's
    metadata (a file rewritten in place at the same size, its mtime put back, keeps its device,
    inode, size and mtime, and must not be served its old weights). Hashing costs a pass over the
    bytes (~1-2 GB/s); parsing, validating and `host_form` are what a hit saves. Entries are kept
    in the caller's `host_form`, so a repeated load is plain copies.
    """

    def __init__(self, shapes: BaseModelShapes, max_rank: int, cache_bytes: int = 0,
                 allow: Sequence[str] = ()) -> None:
        self.shapes, self.max_rank, self.cache_bytes = shapes, max_rank, cache_bytes
        self.roots = UriPolicy(allow).file_roots if allow else None
        self.max_weights_bytes = max_weights_bytes(shapes, max_rank)
        # path -> ((config digest, weights digest), the adapter in host form)
        self._cache: OrderedDict[Path, tuple[tuple[str, str], HostAdapter]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # fetches run on several host-loader threads

    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        path = local_path(uri)
        config_fd, config_st = file_access.open_regular(path / CONFIG_FILE, self.roots, MAX_CONFIG_BYTES)
        try:
            weights_fd, weights_st = file_access.open_regular(path / WEIGHTS_FILE, self.roots,
                                                              self.max_weights_bytes)
            try:
                raw_config = bytes(file_access.read_fd(config_fd, config_st.st_size, path / CONFIG_FILE))
                data = file_access.read_fd(weights_fd, weights_st.st_size, path / WEIGHTS_FILE)
            finally:
                os.close(weights_fd)
        finally:
            os.close(config_fd)
        return self._fetch_read(path, sha256, host_form, raw_config, data)

    def _fetch_read(self, path: Path, sha256: str | None, host_form: HostForm | None, raw_config: bytes,
                    data: bytearray) -> HostAdapter:
        digest = hashlib.sha256(data).hexdigest()
        if sha256 is not None and digest != sha256.lower():
            raise InvalidArgumentError(f"{WEIGHTS_FILE} sha256 {digest} does not match the expected {sha256}")
        content = (hashlib.sha256(raw_config).hexdigest(), digest)
        with self._lock:
            hit = self._cache.get(path)
            if hit is not None and hit[0] == content:
                self._cache.move_to_end(path)
                # Each caller gets its own record (the manager sets fields on it); the tensors are
                # shared and only ever read.
                return dataclasses.replace(hit[1], tier=LoadTier.CACHE)
        adapter = load_adapter_bytes(raw_config, data, self.shapes, self.max_rank)
        adapter = host_form(adapter) if host_form is not None else adapter
        self._remember(path, content, adapter)
        return dataclasses.replace(adapter, tier=LoadTier.STORE)

    def _remember(self, path: Path, content: tuple[str, str], adapter: HostAdapter) -> None:
        if adapter.size_bytes > self.cache_bytes:
            return
        with self._lock:
            old = self._cache.pop(path, None)
            if old is not None:
                self._cached_bytes -= old[1].size_bytes
            self._cache[path] = (content, adapter)
            self._cached_bytes += adapter.size_bytes
            while self._cached_bytes > self.cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.size_bytes
