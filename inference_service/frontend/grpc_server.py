"""The gRPC front end: loraplex.v1.Inference over an engine, and the grpc.aio server that carries
it with health and reflection (the process around it: server.py).

The asyncio loop only does I/O. The engine's scheduler runs on its own thread; a Generate
handler admits the request (admission.py), writes its outputs as they come, and closes it in its
`finally`, whatever ended the handler (the last token, a client cancel or disconnect, a deadline,
an error): the close aborts every sample that has not finished, so its KV blocks and adapter
reference are released within one scheduler step.

Requests are parsed inside the handlers (the method handlers take raw bytes, grpc_proto.parse), so
a message that does not parse (e.g. invalid UTF-8 in a string field) is INVALID_ARGUMENT and
counted like any other outcome, not grpc-python's uncounted UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.engine.client import EngineClient
from inference_service.engine.request import FinishReason, RequestOutput
from inference_service.frontend import grpc_proto as proto
from inference_service.frontend.admission import Admission, Generation, with_adapter
from inference_service.frontend.auth import AdminAuth, admin_disabled_reason
from inference_service.frontend.cache_salt import grpc_identity
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.config import ServerConfig
from inference_service.frontend.intake import ENGINE_ENDED, Intake, adapter_name, engine_end_error
from inference_service.frontend.namespace import public_message
from inference_service.frontend.platform_info import platform_rows
from inference_service.frontend.preload import Preloader
from inference_service.frontend.tenants import QuotaExceeded, Tenant
from inference_service.limits import ADAPTER_NAME_PATTERN, shown

log = logging.getLogger("loraplex.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
LIST_PAGE_SIZE = 100  # ListAdapters default page
LIST_MAX_PAGE_SIZE = 1000

__all__ = ["SERVICE_NAME", "GrpcMetrics", "InferenceServicer", "RunningServer", "ServerConfig", "add_servicer",
           "build_server"]


class GrpcMetrics(Protocol):
    """Where each RPC's outcome is counted (frontend/metrics.py's sink)."""

    def grpc_request(self, method: str, code: str) -> None: ...


class InferenceServicer(pb_grpc.InferenceServicer):
    """loraplex.v1.Inference over an engine (engine.client.EngineClient)."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: GrpcMetrics | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        self.engine = engine
        self.chat_template = chat_template  # GenerateRequest.messages: the HTTP API's template too
        self.config = config
        self.metrics = metrics
        self.auth = AdminAuth(config.admin_token,
                              admin_disabled_reason(config.listen, config.admin_token, config.insecure_admin))
        self.intake = Intake(engine.model_info, engine.tokenizer, config.default_max_new_tokens)
        self.admission = Admission(engine, config, "grpc")
        self.preloader: Preloader | None = None  # set by server.serve(): its entries show in ListAdapters
        self.tenancy = config.tenancy
        self.adapters = config.adapters

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The caller's tenant (frontend/tenants.py); UNAUTHENTICATED for a token the tenants file lacks."""
        return self.tenancy.resolve(context.invocation_metadata(), grpc_identity(context.auth_context()))

    # ---- Generate -------------------------------------------------------------------------
    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:
        started = time.monotonic()
        request_id, adapter = "-", None
        engine_adapter: str | None = None  # what the adapter name means for this tenant (frontend/namespace.py)
        code = "OK"
        abort_reason = FinishReason.CANCELLED
        cancelled = False
        gen: Generation | None = None
        tenant_name = "-"  # until the caller's credential is read
        try:
            tenant = self._tenant(context)
            tenant_name = tenant.name
            self.admission.enter(tenant)
            request = proto.parse(pb.GenerateRequest, raw)
            request_id = request.request_id or uuid.uuid4().hex
            adapter = request.adapter or None
            intake = self.intake.from_grpc(request, request_id, self.chat_template)
            engine_adapter = self.admission.adapter(tenant, intake.adapter)  # its own, else the shared one
            self.admission.check_priority(tenant, request.priority)
            gen = await self.admission.submit(tenant, with_adapter(intake, engine_adapter), request.priority)
            engine_ended: RequestOutput | None = None
            async with contextlib.aclosing(gen.outputs()) as outputs:
                async for index, out in outputs:
                    await _write(context, proto.generate_response(request_id, out, index))
                    if out.finished and out.finish_reason in ENGINE_ENDED:
                        engine_ended = out
                        break
            if engine_ended is not None:
                # Ended by the engine, not the client: tell the client with a status, not an OK
                # (the other samples are aborted by the close).
                error = engine_end_error(engine_ended)
                code = error.code if error.code in grpc.StatusCode.__members__ else "INTERNAL"
                await context.abort(grpc.StatusCode[code], public_message(str(error), engine_adapter, adapter))
        except LoraplexError as e:
            code = e.code
            if isinstance(e, QuotaExceeded):  # the retry hint, as HTTP's Retry-After
                context.set_trailing_metadata((("retry-after-ms", str(int(e.retry_after_s * 1000) + 1)),))
            await context.abort(grpc.StatusCode[e.code], public_message(str(e), engine_adapter, adapter))
        except (asyncio.CancelledError, _ClientGone) as e:
            code = _cancel_code(context)
            if code == "DEADLINE_EXCEEDED":
                abort_reason = FinishReason.DEADLINE
            cancelled = True
            if isinstance(e, _ClientGone):
                raise asyncio.CancelledError from None  # what it is; grpc logs that at DEBUG only
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            code = "INTERNAL"
            log.exception("Generate %s failed", shown(request_id))
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in request {request_id}")
        finally:
            finish = abort_reason.value if cancelled else "-"
            tokens = 0
            if gen is not None:
                gen.close(abort_reason)  # every sample not seen ending, each once; the ticket released
                finish, tokens = gen.finish, gen.tokens
            self._count("Generate", code)
            log.info("request %s adapter=%s finish=%s code=%s tokens=%d seconds=%.3f tenant=%s", shown(request_id),
                     shown(adapter) if adapter else "-", finish, code, tokens, time.monotonic() - started,
                     tenant_name)

    # ---- admin ----------------------------------------------------------------------------
    async def LoadAdapter(self, raw: bytes, context: grpc.aio.ServicerContext):
        return await self._unary("LoadAdapter", context, self._load_adapter, pb.LoadAdapterRequest, raw, admin=True)

    async def _load_adapter(self, request: pb.LoadAdapterRequest, context: Any) -> pb.LoadAdapterResponse:
        _, info = await self.adapters.load(self.engine, self._tenant(context), request.name, request.uri,
                                           request.sha256, pinned=request.pinned, preload=request.preload,
                                           shared=request.shared, for_tenant=request.tenant)
        return pb.LoadAdapterResponse(adapter=proto.adapter_message(info, name=request.name))

    async def UnloadAdapter(self, raw: bytes, context: grpc.aio.ServicerContext):
        return await self._unary("UnloadAdapter", context, self._unload_adapter, pb.UnloadAdapterRequest, raw,
                                 admin=True)

    async def _unload_adapter(self, request: pb.UnloadAdapterRequest, context: Any) -> pb.UnloadAdapterResponse:
        await self.adapters.unload(self.engine, self._tenant(context), adapter_name(request.name))
        return pb.UnloadAdapterResponse()

    async def ListAdapters(self, raw: bytes, context: grpc.aio.ServicerContext):
        return await self._unary("ListAdapters", context, self._list_adapters, pb.ListAdaptersRequest, raw)

    async def _list_adapters(self, request: pb.ListAdaptersRequest, context: Any) -> pb.ListAdaptersResponse:
        """One page, ordered by (name, version) of the names the caller knows them by: a tenant its own
        and the shared ones, an admin every engine name. URIs only for admin callers: they can locate
        (and, with credentials or internal hosts in them, reveal) where other tenants' weights live."""
        if request.page_size > LIST_MAX_PAGE_SIZE:
            raise InvalidArgumentError(f"page_size must be at most {LIST_MAX_PAGE_SIZE}")
        size = request.page_size or LIST_PAGE_SIZE
        after = proto.page_key(request.page_token) if request.page_token else None
        admin = self.auth.is_admin(self._tenant(context), context.invocation_metadata())
        # Paged over what this caller sees, so a page token never names an adapter it may not see.
        seen = [(name, info) for name, info in await self.adapters.visible(self.engine, self._tenant(context))
                if after is None or (name, info.version) > after]
        page, more = seen[:size], len(seen) > size
        resp = pb.ListAdaptersResponse(adapters=[proto.adapter_message(info, with_uri=admin, name=name)
                                                 for name, info in page])
        if more:
            resp.next_page_token = proto.page_token(page[-1][0], page[-1][1].version)
        else:
            resp.adapters.extend(await self._unregistered_preloads(admin))
        return resp

    async def _unregistered_preloads(self, with_uri: bool) -> list[pb.Adapter]:
        """Preload entries that never registered (LOADING / FAILED), shown after the last page."""
        if self.preloader is None or not self.preloader.states():
            return []
        registered = {a.name for a in await asyncio.wrap_future(self.engine.list_adapters())}
        return [pb.Adapter(name=entry.name, uri=entry.uri if with_uri else "", slot=-1, pinned=entry.pinned,
                           state=proto.adapter_state(state))
                for entry, state in self.preloader.unregistered(registered)]

    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext):
        async def run(_: Any, __: Any) -> pb.GetModelInfoResponse:
            m = self.engine.model_info
            limits = m.limits
            return pb.GetModelInfoResponse(
                model_name=m.name,
                max_context=m.max_context,
                vocab_size=m.vocab_size,
                max_loras=m.max_loras,
                max_lora_rank=m.max_lora_rank,
                max_new_tokens_limit=m.max_new_tokens_limit,
                max_stop_strings=limits.max_stop_strings,
                max_stop_string_length=limits.max_stop_string_length,
                max_stop_token_ids=limits.max_stop_token_ids,
                max_prompt_chars=limits.max_prompt_chars,
                max_request_id_length=limits.max_request_id_length,
                adapter_name_pattern=ADAPTER_NAME_PATTERN,
                max_registered_adapters=m.max_registered_adapters,
                max_n=limits.max_n,
                lora_pool_bytes=m.lora_pool_bytes,
                lora_page_rank=m.lora_page_rank,
                kv_cache_blocks=m.kv_cache_blocks,
                kv_block_size=m.kv_block_size,
                platform=platform_rows(m),
            )

        return await self._unary("GetModelInfo", context, run, pb.GetModelInfoRequest, raw)

    async def Tokenize(self, raw: bytes, context: grpc.aio.ServicerContext):
        async def run(r: pb.TokenizeRequest, _: Any) -> pb.TokenizeResponse:
            self.intake.bounded_text(r.text, "text")
            special = r.add_special_tokens if r.HasField("add_special_tokens") else True
            return pb.TokenizeResponse(token_ids=self.engine.tokenizer.encode(r.text, add_special_tokens=special))

        return await self._unary("Tokenize", context, run, pb.TokenizeRequest, raw)

    async def Detokenize(self, raw: bytes, context: grpc.aio.ServicerContext):
        async def run(r: pb.DetokenizeRequest, _: Any) -> pb.DetokenizeResponse:
            ids = self.intake.decodable_ids(r.token_ids)  # counted first: the range check and decode grow with it
            skip = r.skip_special_tokens if r.HasField("skip_special_tokens") else True
            # Off the loop: decoding a context's worth of ids would pause every other stream meanwhile.
            text = await asyncio.to_thread(self.engine.tokenizer.decode, ids, skip)
            return pb.DetokenizeResponse(text=text)

        return await self._unary("Detokenize", context, run, pb.DetokenizeRequest, raw)

    async def _unary(
        self,
        method: str,
        context: grpc.aio.ServicerContext,
        fn: Callable[[Any, Any], Awaitable[Any]],
        message: type[Message],
        raw: bytes,
        admin: bool = False,
    ) -> Any:
        code = "OK"
        try:
            tenant = self._tenant(context)  # an unknown token is UNAUTHENTICATED on every method
            if admin:
                self.auth.require_admin(tenant, context.invocation_metadata())
            return await fn(proto.parse(message, raw), context)
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


class _DepartedClientFilter(logging.Filter):
    """grpc logs a write or final status that races a departing client (cancel, deadline) as an
    error with a traceback from its own handler, after ours has returned: that is no fault of the
    server, so it becomes one DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__name__ == "ExecuteBatchError":
            log.debug("dropped a response to a departed client: %s", exc)
            return False
        return True


class _ClientGone(Exception):
    """A response could not be written: the client cancelled or its deadline passed meanwhile."""


async def _write(context: grpc.aio.ServicerContext, response: pb.GenerateResponse) -> None:
    # Streaming by context.write rather than yield: a write that races a cancel then fails here,
    # where it is counted as the cancel it is, instead of in grpc's own handler (which logs it
    # with a traceback and leaves the call counted OK).
    # The call's state may not show the cancel yet when the write fails (grpc's ExecuteBatchError),
    # and the response is built already, so any failure here means the call can take no more.
    try:
        await context.write(response)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - see above
        raise _ClientGone(type(e).__name__) from None


def add_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """`add_InferenceServicer_to_server`, but the handlers get the raw request bytes (see grpc_proto.parse)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        response = getattr(pb, method.output_type.name)
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=None,
                                     response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# A client whose deadline passes cancels the call (HTTP/2 RST_STREAM, as a plain cancel) by its own
# clock, which started before the request reached us: our copy of the deadline ends later by the
# request's transit and hand-off, tens of milliseconds on a loaded host (a 0.3 s deadline was seen
# cancelled with more than 1 ms left here). A cancel this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.1


def _cancel_code(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


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
    servicer: InferenceServicer

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING while in-flight calls drain
        await self.server.stop(grace_s)


async def build_server(engine: EngineClient, config: ServerConfig, metrics: GrpcMetrics | None = None,
                       serving: bool = True, chat_template: ChatTemplate | None = None) -> RunningServer:
    """A started grpc.aio server with the Inference service, health and reflection; health starts
    SERVING unless `serving` is False (then the caller's HealthReporter decides). `chat_template`:
    the one Generate's messages are rendered with (None: such requests are INVALID_ARGUMENT)."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    cygrpc_log = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _DepartedClientFilter) for f in cygrpc_log.filters):
        cygrpc_log.addFilter(_DepartedClientFilter())
    servicer = InferenceServicer(engine, config, metrics, chat_template)
    add_servicer(servicer, server)
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
    if serving:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, port, health_servicer, servicer)
