"""A small client of the sidecar for the inference service: stage / release / read / list / evict.

gRPC failures come back as the matching `inference_service.errors` class, so callers handle
sidecar and local errors alike (an unreachable sidecar is UnavailableError: retryable).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import grpc

from inference_service.api import adapter_cache_pb2 as pb
from inference_service.api import adapter_cache_pb2_grpc as pb_grpc
from inference_service.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

_ERRORS: dict[grpc.StatusCode, type[LoraplexError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


@dataclass(frozen=True)
class StagedTensor:
    name: str
    dtype: str  # safetensors dtype string: "F32", "F16", "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the staged file
    nbytes: int


@dataclass(frozen=True)
class StagedAdapter:
    lease_id: str
    path: str  # the staged safetensors file in the shared-memory directory
    tensors: tuple[StagedTensor, ...]
    config: dict  # adapter_config.json, parsed
    config_json: str
    size_bytes: int
    sha256: str
    cache_hit: bool
    lease_expires_at: float  # unix seconds


@dataclass(frozen=True)
class CachedAdapter:
    uri: str
    size_bytes: int
    leases: int
    last_used_at: float
    hits: int
    sha256: str
    path: str


def _error(exc: grpc.RpcError) -> LoraplexError:
    cls = _ERRORS.get(exc.code(), LoraplexError)
    return cls(f"adapter cache: {exc.details()}")


class AdapterCacheClient:
    """Blocking client; call it from a worker thread (or `asyncio.to_thread`), never the scheduler thread.

    `target` is what the sidecar listens on: `unix:///path` or `host:port`; `token` is sent as
    `authorization: Bearer <token>` when the sidecar requires one (its --token-file, or an
    admin token for List/Evict).
    """

    def __init__(self, target: str, timeout_s: float = 300.0, token: str | None = None) -> None:
        self._channel = grpc.insecure_channel(
            target, options=[("grpc.max_receive_message_length", 8 << 20)]
        )
        self._stub = pb_grpc.AdapterCacheServiceStub(self._channel)
        self._timeout = timeout_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def stage(self, uri: str, sha256: str = "", lease_seconds: int = 0) -> StagedAdapter:
        try:
            r = self._stub.Stage(pb.StageRequest(uri=uri, sha256=sha256, lease_seconds=lease_seconds),
                                 timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return StagedAdapter(
            lease_id=r.lease_id,
            path=r.path,
            tensors=tuple(StagedTensor(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in r.tensors),
            config=json.loads(r.config_json),
            config_json=r.config_json,
            size_bytes=r.size_bytes,
            sha256=r.sha256,
            cache_hit=r.cache_hit,
            lease_expires_at=r.lease_expires_at,
        )

    def release(self, lease_id: str) -> None:
        try:
            self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def read(self, lease_id: str, chunk_bytes: int = 0) -> bytes:
        """The staged file's bytes, streamed (for a client without the shared directory)."""
        out = bytearray()
        try:
            for chunk in self._stub.Read(pb.ReadRequest(lease_id=lease_id, chunk_bytes=chunk_bytes),
                                         timeout=self._timeout, metadata=self._metadata):
                if chunk.offset != len(out):
                    raise UnavailableError(f"adapter cache: Read out of order at {chunk.offset}")
                out += chunk.data
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return bytes(out)

    def list(self) -> list[CachedAdapter]:
        try:
            r = self._stub.List(pb.ListRequest(), timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return [CachedAdapter(e.uri, e.size_bytes, e.leases, e.last_used_at, e.hits, e.sha256, e.path)
                for e in r.entries]

    def evict(self, uri: str = "") -> list[str]:
        """Evict one unleased entry, or every unleased one when `uri` is empty."""
        try:
            r = self._stub.Evict(pb.EvictRequest(uri=uri), timeout=self._timeout, metadata=self._metadata)
            return list(r.evicted_uris)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdapterCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
