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
from urllib.parse import unquote, urlparse

from inference_service import file_access
from inference_service.errors import InvalidArgumentError, PermissionDeniedError
from inference_service.lora.adapter import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    BaseModelShapes,
    HostAdapter,
    load_adapter_bytes,
    max_weights_bytes,
)
from inference_service.uri_policy import UriPolicy

HostForm = Callable[[HostAdapter], HostAdapter]


class AdapterSource(Protocol):
    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        """Validated host tensors for the adapter at `uri`; raises LoraplexError subclasses.

        `host_form` turns a freshly read adapter into the form it is kept and copied in (the
        slots' layout, `LoRAMemoryPool.host_form`); a source with a host cache keeps that form.
        The returned adapter's `tier` says where the bytes came from (cache | store)."""


def local_path(uri: str) -> Path:
    """file:///abs/dir or a plain path → a normalised absolute path (links not resolved: that is
    the open-time check's job)."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise PermissionDeniedError("file URI with a remote host or credentials is not allowed")
        raw = unquote(parsed.path)
    elif parsed.scheme == "":
        raw = uri
    else:
        raise InvalidArgumentError(f"unsupported adapter URI scheme {parsed.scheme!r} (no sidecar configured)")
    if ".." in Path(raw).parts:
        raise PermissionDeniedError(f"path traversal ('..') in adapter URI: {uri}")
    return Path(os.path.abspath(raw))


class LocalDirectorySource:
    """PEFT directories on the local filesystem (file:// URIs or plain paths).

    Files are opened on every fetch by `file_access.open_regular`, the rule the sidecar's
    FileStore follows too: regular files only, inside the `allow` list's file:// roots at open
    time, within the size bounds. With no `allow` list at all there is no root to confine to: the
    engine then trusts its caller (the server refuses every URI without --adapter-source-allow).

    Validated adapters are kept in host memory, least recently used first out, up to
    `cache_bytes`: an adapter evicted from its slot and wanted again is copied from there instead
    of read, parsed and checked again (what the sidecar's shared-memory cache does for remote
    adapters). An entry is only used while both files, opened afresh under the rule above, keep the
    device, inode, size and mtime it was read with. Entries are kept in the caller's `host_form`,
    so a repeated load is plain copies.
    """

    def __init__(self, shapes: BaseModelShapes, max_rank: int, cache_bytes: int = 0,
                 allow: Sequence[str] = ()) -> None:
        self.shapes, self.max_rank, self.cache_bytes = shapes, max_rank, cache_bytes
        self.roots = UriPolicy(allow).file_roots if allow else None
        self.max_weights_bytes = max_weights_bytes(shapes, max_rank)
        self._cache: OrderedDict[Path, tuple[tuple, HostAdapter, str | None]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # fetches run on several host-loader threads

    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        path = local_path(uri)
        config_fd, config_st = file_access.open_regular(path / CONFIG_FILE, self.roots, MAX_CONFIG_BYTES)
        try:
            weights_fd, weights_st = file_access.open_regular(path / WEIGHTS_FILE, self.roots,
                                                              self.max_weights_bytes)
            try:
                return self._fetch_open(path, sha256, host_form, (config_fd, config_st), (weights_fd, weights_st))
            finally:
                os.close(weights_fd)
        finally:
            os.close(config_fd)

    def _fetch_open(self, path: Path, sha256: str | None, host_form: HostForm | None,
                    config: tuple[int, os.stat_result], weights: tuple[int, os.stat_result]) -> HostAdapter:
        stamp = tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for _, st in (config, weights))
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
            tier = "cache"
        else:
            raw_config = file_access.read_fd(config[0], config[1].st_size, path / CONFIG_FILE)
            data = file_access.read_fd(weights[0], weights[1].st_size, path / WEIGHTS_FILE)
            adapter, tier = load_adapter_bytes(bytes(raw_config), data, self.shapes, self.max_rank), "store"
            digest = None if sha256 is None else hashlib.sha256(data).hexdigest()
        if sha256 is not None and digest != sha256.lower():
            raise InvalidArgumentError(f"{WEIGHTS_FILE} sha256 {digest} does not match the expected {sha256}")
        if tier == "store":
            adapter = host_form(adapter) if host_form is not None else adapter
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
