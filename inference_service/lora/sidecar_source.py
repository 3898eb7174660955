"""Adapters staged by the adapter-cache sidecar into its shared-memory directory.

The staged file is the adapter's safetensors bytes; we map it read-only and view tensors at the
manifest's offsets (no copy), page-locked on CUDA so the slot copy can overlap compute. Without
a shared directory the bytes come over the sidecar's Read stream instead. The lease is released
once the slot copy is done (or the preparation is dropped).
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

from adapter_cache.auth import read_tokens
from adapter_cache.client import AdapterCacheClient
from inference_service.device import register_host_memory, unregister_host_memory
from inference_service.lora.adapter import (
    BaseModelShapes,
    HostAdapter,
    TensorEntry,
    build_host_adapter,
    parse_adapter_config,
    parse_adapter_tensors,
)
from inference_service.lora.source import HostForm

log = logging.getLogger(__name__)


class SidecarSource:
    """`token_file`: holds the bearer token the sidecar requires (--cache-token-file; its first line)."""

    def __init__(self, address: str, shapes: BaseModelShapes, max_rank: int, lease_seconds: int = 600,
                 token_file: str | None = None) -> None:
        self.client = AdapterCacheClient(address, token=read_tokens(token_file)[0] if token_file else None)
        self.shapes, self.max_rank, self.lease_seconds = shapes, max_rank, lease_seconds

    def fetch(self, uri: str, sha256: str | None, host_form: HostForm | None = None) -> HostAdapter:
        staged = self.client.stage(uri, sha256 or "", self.lease_seconds)
        try:
            config = parse_adapter_config(staged.config_json, self.max_rank)
            manifest = [TensorEntry(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in staged.tensors]
            buffer, pinned = self._map(staged.path, staged.lease_id)
            tensors = parse_adapter_tensors(buffer, config, self.max_rank, manifest)
            adapter = build_host_adapter(config, tensors, self.shapes, keepalive=buffer)
            if host_form is not None:
                adapter = host_form(adapter)
        except BaseException:
            self.client.release(staged.lease_id)
            raise
        adapter.tier = "cache" if staged.cache_hit else "store"
        adapter.release = lambda: self._release(staged.lease_id, pinned)
        log.info("staged %s via sidecar (lease %s, %s, %d bytes)", uri, staged.lease_id,
                 "hit" if staged.cache_hit else "miss", staged.size_bytes)
        return adapter

    def _map(self, path: str, lease_id: str) -> tuple[object, torch.Tensor | None]:
        if not os.path.exists(path):  # no shared memory directory with the sidecar
            return self.client.read(lease_id), None
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        pinned = None
        if torch.cuda.is_available():
            whole = torch.frombuffer(mapped, dtype=torch.uint8)
            pinned = whole if register_host_memory(whole) else None
        return mapped, pinned

    def _release(self, lease_id: str, pinned: torch.Tensor | None) -> None:
        if pinned is not None:
            unregister_host_memory(pinned)
        self.client.release(lease_id)
