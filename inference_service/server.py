"""gRPC servicer around the Engine: validate, submit, stream, abort in `finally`.

The asyncio loop only does I/O. The engine's scheduler runs on its own thread; a Generate
handler submits the request and awaits its output stream. Whatever ends the handler (the
last token, a client cancel or disconnect, a deadline, an error) passes through its
`finally`, which aborts the request in the engine unless it already finished, so its KV
blocks and adapter reference are released within one scheduler step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.auth import AdminAuth
from inference_service.request import FinishReason, RequestOutput, SamplingParams

log = logging.getLogger("loraplex.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
MAX_ADAPTER_NAME_LEN = 256
MAX_REQUEST_ID_LEN = 256

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: pb.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


@dataclass
class ServerConfig:
    """Server-only settings (the engine's live in EngineConfig)."""

    listen: str = "127.0.0.1:50051"
    metrics_port: int = 0  # 0: no /metrics endpoint
    metrics_addr: str = "127.0.0.1"
    admin_token: str | None = None
    insecure_admin: bool = False  # allow admin RPCs without a token on a non-loopback address
    adapter_source_allow: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: clients must present a certificate signed by it (mTLS)
    max_message_bytes: int = 4 * 1024 * 1024
    default_max_new_tokens: int = 64
    adapter_metrics_top_k: int = 20
    preload: list[dict[str, Any]] = field(default_factory=list)  # [{name, uri, pinned}]
    shutdown_grace_s: float = 5.0


class InferenceServicer(pb_grpc.InferenceServicer):
    """loraplex.v1.Inference over an Engine (see inference_service/engine.py)."""

    def __init__(self, engine: Any, config: ServerConfig, metrics: Any = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics  # PrometheusMetrics or None
        self.auth = AdminAuth(config.admin_token)
        self.uri_policy = UriPolicy(config.adapter_source_allow)

    # ---- Generate -------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator:
        started = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        adapter = request.adapter or None
        code = "OK"
        reason: FinishReason | None = None
        generated = 0
        submitted = False
        finished = False
        abort_reason = FinishReason.CANCELLED
        try:
            prompt_ids = self._prompt_ids(request)
            params = self._sampling_params(request)
            if len(request_id) > MAX_REQUEST_ID_LEN:
                raise InvalidArgumentError(f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
            stream = self.engine.add_request(prompt_ids, params, adapter=adapter, request_id=request_id)
            submitted = True
            async for out in stream:
                generated = out.generated_tokens or generated + len(out.new_token_ids)
                if out.finished:
                    finished = True
                    reason = out.finish_reason
                yield self._response(request_id, out)
                if out.finished:
                    break
            if reason in (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR):
                # Ended by the engine, not the client: tell the client with a status, not an OK.
                code = _engine_end_code(reason, out)
                await context.abort(grpc.StatusCode[code], str(out.error or f"request {reason.value}"))
        except LoraplexError as e:
            code = e.code
            await context.abort(grpc.StatusCode[e.code], str(e))
        except asyncio.CancelledError:
            code = _cancel_code(context)
            if code == "DEADLINE_EXCEEDED":
                abort_reason = FinishReason.DEADLINE
            reason = abort_reason
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            code = "INTERNAL"
            log.exception("Generate %s failed", request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in request {request_id}")
        finally:
            if submitted and not finished:
                self.engine.abort(request_id, reason=abort_reason)
                if reason is None:  # the handler left early for a reason other than a cancel
                    reason = abort_reason
            self._count("Generate", code)
            log.info(
                "request %s adapter=%s finish=%s code=%s tokens=%d seconds=%.3f",
                request_id,
                adapter or "-",
                reason.value if reason else "-",
                code,
                generated,
                time.monotonic() - started,
            )

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgumentError("prompt is required (text or token_ids)")
        if which == "text":
            if not request.text:
                raise InvalidArgumentError("prompt is empty")
            ids = list(self.engine.tokenizer.encode(request.text))
        else:
            ids = list(request.token_ids.ids)
            vocab = self.engine.model_info.vocab_size
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidArgumentError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        if not ids:
            raise InvalidArgumentError("prompt is empty")
        return ids

    def _sampling_params(self, request: pb.GenerateRequest) -> SamplingParams:
        s = request.sampling
        if request.HasField("max_new_tokens"):
            max_new = request.max_new_tokens
        else:
            max_new = min(self.config.default_max_new_tokens, self.engine.model_info.max_new_tokens_limit)
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            max_new_tokens=max_new,
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        # The engine validates again; checking here too keeps the contract independent of it.
        params.validate(self.engine.model_info.max_new_tokens_limit)
        return params

    @staticmethod
    def _response(request_id: str, out: RequestOutput) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.text)
        if out.finished:
            resp.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            resp.usage.prompt_tokens = out.prompt_tokens
            resp.usage.generated_tokens = out.generated_tokens
            t = out.timings
            if t is not None:
                end = t.finished or time.monotonic()
                resp.timings.queue_seconds = _since(t.arrival, t.first_scheduled)
                resp.timings.adapter_wait_seconds = _since(t.arrival, t.adapter_ready)
                resp.timings.time_to_first_token_seconds = _since(t.arrival, t.first_token)
                resp.timings.total_seconds = _since(t.arrival, end)
        return resp

    # ---- admin ----------------------------------------------------------------------------
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext):
        return await self._unary("LoadAdapter", context, self._load_adapter, request, admin=True)

    async def _load_adapter(self, request: pb.LoadAdapterRequest) -> pb.LoadAdapterResponse:
        _check_name(request.name)
        uri = self.uri_policy.check(request.uri)
        sha256 = request.sha256.lower() or None
        if sha256 is not None and (len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256)):
            raise InvalidArgumentError("sha256 must be 64 hex characters")
        fut = self.engine.load_adapter(
            request.name, uri, sha256=sha256, pinned=request.pinned, preload=request.preload
        )
        info = await asyncio.wrap_future(fut)
        log.info("adapter %s loaded from %s (pinned=%s preload=%s)", request.name, uri, request.pinned,
                 request.preload)
        return pb.LoadAdapterResponse(adapter=_adapter_pb(info))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext):
        return await self._unary("UnloadAdapter", context, self._unload_adapter, request, admin=True)

    async def _unload_adapter(self, request: pb.UnloadAdapterRequest) -> pb.UnloadAdapterResponse:
        _check_name(request.name)
        await asyncio.wrap_future(self.engine.unload_adapter(request.name))
        log.info("adapter %s unloaded", request.name)
        return pb.UnloadAdapterResponse()

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        async def run(_: Any) -> pb.ListAdaptersResponse:
            return pb.ListAdaptersResponse(adapters=[_adapter_pb(a) for a in self.engine.list_adapters()])

        return await self._unary("ListAdapters", context, run, request)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        async def run(_: Any) -> pb.GetModelInfoResponse:
            m = self.engine.model_info
            return pb.GetModelInfoResponse(
                model_name=m.name,
                max_context=m.max_context,
                vocab_size=m.vocab_size,
                max_loras=m.max_loras,
                max_lora_rank=m.max_lora_rank,
                max_new_tokens_limit=m.max_new_tokens_limit,
            )

        return await self._unary("GetModelInfo", context, run, request)

    async def _unary(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        fn: Callable[[Any], Awaitable[Any]],
        request: Any,
        admin: bool = False,
    ) -> Any:
        code = "OK"
        try:
            if admin:
                self.auth.check(context.invocation_metadata())
            return await fn(request)
        except LoraplexError as e:
            code = e.code
            await context.abort(grpc.StatusCode[e.code], str(e))
        except asyncio.CancelledError:
            code = _cancel_code(context)
            raise
        except Exception:
            code = "INTERNAL"
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}")
        finally:
            self._count(method, code)

    def _count(self, method: str, code: str) -> None:
        if self.metrics is not None:
            self.metrics.grpc_request(method, code)


def _check_name(name: str) -> None:
    if not name:
        raise InvalidArgumentError("adapter name is required")
    if len(name) > MAX_ADAPTER_NAME_LEN or any(ord(c) < 0x21 or ord(c) == 0x7F for c in name) or "," in name:
        raise InvalidArgumentError(
            f"adapter name must be 1-{MAX_ADAPTER_NAME_LEN} printable characters without spaces or commas"
        )


def _cancel_code(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0.001 else "CANCELLED"


def _engine_end_code(reason: FinishReason, out: RequestOutput) -> str:
    if reason is FinishReason.DEADLINE:
        return "DEADLINE_EXCEEDED"
    if reason is FinishReason.CANCELLED:
        return "CANCELLED"
    # The engine hands the LoraplexError itself (e.g. the adapter failed to load: INVALID_ARGUMENT,
    # UNAVAILABLE); anything else reaching here is a bug.
    code = out.error.code if isinstance(out.error, LoraplexError) else "INTERNAL"
    return code if code in grpc.StatusCode.__members__ else "INTERNAL"


def _since(start: float, end: float | None) -> float:
    return max(0.0, end - start) if end is not None and math.isfinite(end) else 0.0


def _adapter_pb(info: Any) -> pb.Adapter:
    state = getattr(pb, "ADAPTER_STATE_" + str(info.state).upper().split(".")[-1].split("(")[0], 0)
    return pb.Adapter(
        name=info.name,
        uri=info.uri,
        state=state,
        slot=info.slot if info.slot is not None else -1,
        pinned=info.pinned,
        rank=info.rank or 0,
        size_bytes=info.size_bytes or 0,
        active_requests=info.active_requests,
        version=getattr(info, "version", 0) or 0,
    )


# ---- server assembly ------------------------------------------------------------------------
def _credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert and not config.tls_key:
        if config.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (config.tls_cert and config.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    with open(config.tls_key, "rb") as f:
        key = f.read()
    with open(config.tls_cert, "rb") as f:
        cert = f.read()
    ca = None
    if config.tls_client_ca:
        with open(config.tls_client_ca, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int  # bound TCP port (0 for unix sockets)
    health: health.aio.HealthServicer

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING while in-flight calls drain
        await self.server.stop(grace_s)


async def build_server(engine: Any, config: ServerConfig, metrics: Any = None) -> RunningServer:
    """A started grpc.aio server with the Inference service, health and reflection."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_InferenceServicer_to_server(InferenceServicer(engine, config, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    creds = _credentials(config)
    if creds is None:
        port = server.add_insecure_port(config.listen)
    else:
        port = server.add_secure_port(config.listen, creds)
    if port == 0 and not config.listen.startswith("unix"):
        raise RuntimeError(f"could not bind {config.listen}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, port, health_servicer)


async def preload_adapters(engine: Any, entries: list[dict[str, Any]], uri_policy: UriPolicy) -> None:
    """Loads the --preload-file adapters (into slots) before the server reports SERVING."""
    futures = []
    for entry in entries:
        name, uri = entry["name"], entry["uri"]
        _check_name(name)
        futures.append(
            asyncio.wrap_future(
                engine.load_adapter(name, uri_policy.check(uri), sha256=entry.get("sha256") or None,
                                    pinned=bool(entry.get("pinned", False)), preload=True)
            )
        )
    for entry, result in zip(entries, await asyncio.gather(*futures, return_exceptions=True), strict=True):
        if isinstance(result, BaseException):
            raise RuntimeError(f"preloading adapter {entry['name']!r} from {entry['uri']!r} failed: {result}")
        log.info("preloaded adapter %s from %s", entry["name"], entry["uri"])


async def serve(engine: Any, config: ServerConfig, metrics: Any = None,
                stop: asyncio.Event | None = None) -> None:
    """Runs until `stop` is set (or the task is cancelled), then drains gracefully."""
    await preload_adapters(engine, config.preload, UriPolicy(config.adapter_source_allow))
    running = await build_server(engine, config, metrics)
    shown = config.listen
    if not config.listen.startswith("unix"):
        shown = f"{config.listen.rsplit(':', 1)[0]}:{running.port}"
    log.info("loraplex.v1.Inference listening on %s%s", shown, " (TLS)" if config.tls_cert else "")
    print(f"LISTENING {shown}", flush=True)
    try:
        if stop is None:
            await running.server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        await running.stop(config.shutdown_grace_s)

