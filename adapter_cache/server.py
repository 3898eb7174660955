"""The gRPC servicer: wire messages in, `Stager` calls, wire messages out, errors to status codes."""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from adapter_cache.auth import CacheAuth
from adapter_cache.stager import Staged, Stager
from inference_service.api import adapter_cache_pb2 as pb
from inference_service.api import adapter_cache_pb2_grpc as pb_grpc
from inference_service.errors import LoraplexError

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["AdapterCacheService"].full_name
_MAX_CHUNK = 2 << 20
_ANSWER_MARGIN_S = 0.5


class AdapterCacheServicer(pb_grpc.AdapterCacheServiceServicer):
    """Stage/Read/Release for authenticated callers (leases are theirs alone), List/Evict for
    admins; see adapter_cache.auth."""

    def __init__(self, stager: Stager, auth: CacheAuth) -> None:
        self._stager = stager
        self._auth = auth
        self._metrics = stager.metrics

    def _fail(self, context: grpc.ServicerContext, exc: Exception) -> None:
        if isinstance(exc, LoraplexError):
            code = getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
        else:
            log.exception("internal error")
            code = grpc.StatusCode.INTERNAL
        self._metrics.errors.labels(reason=code.name.lower()).inc()
        context.abort(code, str(exc))

    def Stage(self, request: pb.StageRequest, context: grpc.ServicerContext) -> pb.StageResponse:
        start = time.perf_counter()
        try:
            caller = self._auth.caller(context.invocation_metadata())
            staged = self._stager.stage(request.uri, request.sha256, request.lease_seconds, owner=caller.name,
                                        wait_s=_follower_wait(context))
        except Exception as exc:
            self._fail(context, exc)
        finally:
            self._metrics.stage_seconds.observe(time.perf_counter() - start)
        return _stage_response(staged)

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        try:
            caller = self._auth.caller(context.invocation_metadata())
            self._stager.release(request.lease_id, owner=caller.name)
        except Exception as exc:
            self._fail(context, exc)
        return pb.ReleaseResponse()

    def Read(self, request: pb.ReadRequest, context: grpc.ServicerContext):
        chunk = min(request.chunk_bytes or (1 << 20), _MAX_CHUNK)
        try:
            caller = self._auth.caller(context.invocation_metadata())
            for offset, data in self._stager.read(request.lease_id, chunk, owner=caller.name):
                yield pb.ReadResponse(offset=offset, data=data)
        except Exception as exc:
            self._fail(context, exc)

    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        try:
            self._auth.caller(context.invocation_metadata(), admin=True)
            return pb.EvictResponse(evicted_uris=self._stager.evict(request.uri))
        except Exception as exc:
            self._fail(context, exc)

    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        try:
            self._auth.caller(context.invocation_metadata(), admin=True)
        except Exception as exc:
            self._fail(context, exc)
        entries = self._stager.list()
        cache = self._stager.cache
        return pb.ListResponse(
            entries=[
                pb.CacheEntry(uri=e.uri, size_bytes=e.size, leases=len(e.leases), last_used_at=e.last_used,
                              hits=e.hits, sha256=e.sha256, path=e.meta.path)
                for e in entries
            ],
            capacity_bytes=cache.capacity_bytes,
            used_bytes=cache.used_bytes,
        )


def _follower_wait(context: grpc.ServicerContext) -> float | None:
    """How long this Stage may wait on another call's fetch: its own deadline, less a margin so
    the caller gets the sidecar's explanation (UNAVAILABLE) rather than a bare DEADLINE_EXCEEDED."""
    remaining = context.time_remaining()
    return None if remaining is None else max(0.0, remaining - _ANSWER_MARGIN_S)


def _stage_response(staged: Staged) -> pb.StageResponse:
    return pb.StageResponse(
        lease_id=staged.lease.lease_id,
        path=staged.path,
        tensors=[
            pb.TensorInfo(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes)
            for t in staged.manifest
        ],
        config_json=staged.config_json,
        size_bytes=staged.size,
        sha256=staged.sha256,
        cache_hit=staged.cache_hit,
        lease_expires_at=staged.lease.expires_at,
    )


def build_server(stager: Stager, listen: str, auth: CacheAuth | None = None,
                 max_workers: int = 64) -> tuple[grpc.Server, health.HealthServicer]:
    """A server with the cache service, grpc.health.v1 and reflection, bound to `listen`.

    `listen` is `unix:///path` or `host:port` (as grpc spells them). Health and reflection
    need no token (probes call them).
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"))
    pb_grpc.add_AdapterCacheServiceServicer_to_server(AdapterCacheServicer(stager, auth or CacheAuth()), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if server.add_insecure_port(listen) == 0 and not listen.startswith("unix:"):
        raise RuntimeError(f"cannot listen on {listen}")
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer
