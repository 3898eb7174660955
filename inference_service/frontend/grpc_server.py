"""gRPC servicer around the Engine: validate, submit, stream, abort in `finally`.

The asyncio loop only does I/O. The engine's scheduler runs on its own thread; a Generate
handler submits the request and awaits its output stream. Whatever ends the handler (the
last token, a client cancel or disconnect, a deadline, an error) passes through its
`finally`, which aborts the request in the engine unless it already finished, so its KV
blocks and adapter reference are released within one scheduler step.

Requests are parsed inside the handlers (the method handlers take raw bytes), so a message that
does not parse (e.g. invalid UTF-8 in a string field) is INVALID_ARGUMENT and counted like any
other outcome, not grpc-python's uncounted UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.engine.client import EngineClient
from inference_service.engine.request import FinishReason, RequestOutput
from inference_service.engine.streams import merged
from inference_service.frontend.adapter_resolver import resolve_adapter
from inference_service.frontend.auth import AdminAuth, admin_disabled_reason
from inference_service.frontend.cache_salt import cache_salt, grpc_identity
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.grammar_check import COMPILE_CPU_S, COMPILE_PROCESSES, shared_checker
from inference_service.frontend.health import HealthReporter, install_test_fault, start_health_listener, watch_engine
from inference_service.frontend.intake import ENGINE_ENDED, Intake, adapter_name, engine_end_error
from inference_service.frontend.namespace import public_message
from inference_service.frontend.platform_info import platform_rows
from inference_service.frontend.preload import PreloadEntry, Preloader
from inference_service.frontend.tenant_adapters import TenantAdapters
from inference_service.frontend.tenants import QuotaExceeded, Tenancy, Tenant, TenantSpec, Ticket, tenant_identity
from inference_service.limits import ADAPTER_NAME_PATTERN, shown

log = logging.getLogger("loraplex.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
LIST_PAGE_SIZE = 100  # ListAdapters default page
LIST_MAX_PAGE_SIZE = 1000

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
    default_max_new_tokens: int | None = None  # None: the rest of the context after the prompt
    grammar_compile_cpu_s: float = COMPILE_CPU_S  # structured output: a new constraint's compile bound
    grammar_compile_wall_s: float = 0.0  # and its wall-clock bound (0: grammar_check.default_wall_s)
    grammar_check_processes: int = COMPILE_PROCESSES  # compile children checking new constraints side by side
    adapter_metrics_top_k: int = 20
    preload: list[PreloadEntry] = field(default_factory=list)
    preload_file: str | None = None  # re-read every preload_reload_s (0: read once)
    preload_reload_s: float = 10.0
    lora_modules: list[PreloadEntry] = field(default_factory=list)  # --lora-modules: kept loaded, never reloaded
    # SIGTERM: health NOT_SERVING at once; new RPCs still served for drain_delay_s (clients and
    # load balancers see NOT_SERVING and move away); then new RPCs are refused and in-flight ones
    # get what is left of shutdown_grace_s before they are cancelled.
    shutdown_grace_s: float = 30.0
    drain_delay_s: float = 0.0
    watchdog_stall_s: float = 60.0  # a scheduler step this long: NOT_SERVING, liveness fails (0: no stall check)
    adapter_resolver: str = ""  # URI template with {name}: unregistered adapters load on first use
    health_listen: str = ""  # HOST:PORT: grpc.health.v1 alone, plaintext (kubelet probes when --listen has TLS)
    # Who may share prefix-cached KV (frontend/cache_salt.py): shared | listener | identity (None:
    # identity with any tenant configuration, else shared; see cache_scope), and the operator's salt
    # mixed into every key
    prefix_cache_scope: str | None = None
    prefix_cache_salt: str | None = None
    # Tenants (frontend/tenants.py): --tenants-file's entries, the operator's trusted header, and the
    # tenants with their own label in the per-tenant metrics
    tenants: tuple[TenantSpec, ...] = ()
    trusted_tenant_header: str | None = None
    tenant_metrics_top_k: int = 10
    state_dir: str | None = None  # adapters loaded through the API are kept here across restarts
    _tenancy: Tenancy | None = field(default=None, init=False, repr=False, compare=False)
    _adapters: TenantAdapters | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def tenancy(self) -> Tenancy:
        """The tenant state both front ends of this server share (bindings, quotas, metrics)."""
        if self._tenancy is None:
            self._tenancy = Tenancy(self.tenants, self.admin_token, self.trusted_tenant_header,
                                    self.tenant_metrics_top_k, mtls=self.tls_client_ca is not None)
        return self._tenancy

    @property
    def adapters(self) -> TenantAdapters:
        """The adapter namespaces, sources and limits both front ends of this server share."""
        if self._adapters is None:
            self._adapters = TenantAdapters(self.tenants, UriPolicy(self.adapter_source_allow), self.state_dir,
                                            self.tenant_metrics_top_k)
        return self._adapters

    @property
    def cache_scope(self) -> str:
        """The prefix-cache scope in force: the operator's, else per tenant whenever tenants are
        configured (a prompt's cache hit must not tell one tenant what another sent)."""
        if self.prefix_cache_scope is not None:
            return self.prefix_cache_scope
        return "identity" if self.tenancy.enabled else "shared"


class InferenceServicer(pb_grpc.InferenceServicer):
    """loraplex.v1.Inference over an engine (engine.client.EngineClient)."""

    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: Any = None,
                 chat_template: ChatTemplate | None = None) -> None:
        self.engine = engine
        self.chat_template = chat_template  # GenerateRequest.messages: the HTTP API's template too
        self.config = config
        self.metrics = metrics  # PrometheusMetrics or None
        self.auth = AdminAuth(config.admin_token,
                              admin_disabled_reason(config.listen, config.admin_token, config.insecure_admin))
        self.uri_policy = UriPolicy(config.adapter_source_allow)
        self.intake = Intake(engine.model_info, engine.tokenizer, config.default_max_new_tokens)
        self.grammars = shared_checker(engine.tokenizer, engine.model_info.vocab_size, config.grammar_compile_cpu_s,
                                       config.grammar_compile_wall_s, config.grammar_check_processes)
        self.preloader: Preloader | None = None  # set by serve(): its entries show in ListAdapters
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
        reason: FinishReason | None = None
        generated = 0
        sample_ids: list[str] = []  # the engine's request id of each sample, once submitted
        ended: set[int] = set()  # samples whose final output was seen
        abort_reason = FinishReason.CANCELLED
        ticket: Ticket | None = None
        try:
            tenant = self._tenant(context)
            self.tenancy.check_in_flight(tenant)  # at its cap: refused before any parsing
            request = _parse(pb.GenerateRequest, raw)
            request_id = request.request_id or uuid.uuid4().hex
            adapter = request.adapter or None
            intake = self.intake.from_grpc(request, request_id, self.chat_template)
            engine_adapter = self.adapters.resolve(self.engine, tenant, intake.adapter)  # its own, else shared
            self.tenancy.check_priority(tenant, request.priority)
            # The quotas first: a tenant over them costs no grammar compile and no adapter load.
            ticket = self.tenancy.admit(tenant, intake.n, len(intake.prompt_token_ids), intake.params.max_new_tokens)
            if intake.params.grammar is not None:  # compiled once, bounded, before anything is submitted
                await self.grammars.check(intake.params.grammar)
            await resolve_adapter(self.engine, self.config.adapter_resolver, self.uri_policy, engine_adapter)
            salt = cache_salt(self.config.cache_scope, self.config.prefix_cache_salt, "grpc",
                              tenant_identity(tenant))
            if intake.n == 1:
                streams = [self.engine.add_request(intake.prompt_token_ids, intake.params, adapter=engine_adapter,
                                                   request_id=intake.request_id, cache_salt=salt, tenant=tenant.tag,
                                                   priority=request.priority)]
            else:  # n samples sharing the prompt's prefill, each its own engine request
                streams = self.engine.add_samples(intake.prompt_token_ids, intake.params, intake.n,
                                                  adapter=engine_adapter, request_id=intake.request_id,
                                                  cache_salt=salt, tenant=tenant.tag, priority=request.priority)
            sample_ids = [stream.request_id for stream in streams]
            counts = [0] * len(streams)
            engine_ended: RequestOutput | None = None
            async with contextlib.aclosing(merged(streams)) as outputs:
                async for index, out in outputs:
                    ticket.running()
                    counts[index] = out.generated_tokens or counts[index] + len(out.new_token_ids)
                    generated = sum(counts)
                    if out.finished:
                        ended.add(index)
                        reason = out.finish_reason
                    await _write(context, self._response(request_id, out, index))
                    if out.finished and out.finish_reason in ENGINE_ENDED:
                        engine_ended = out
                        break
            if engine_ended is not None:
                # Ended by the engine, not the client: tell the client with a status, not an OK
                # (the other samples are aborted below).
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
            reason = abort_reason
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
            if ticket is not None:
                ticket.release(generated)
            unfinished = [sample_id for index, sample_id in enumerate(sample_ids) if index not in ended]
            for sample_id in unfinished:  # every sample not seen ending, each once
                self.engine.abort(sample_id, reason=abort_reason)
            if unfinished and reason is None:  # the handler left early for a reason other than a cancel
                reason = abort_reason
            self._count("Generate", code)
            log.info(
                "request %s adapter=%s finish=%s code=%s tokens=%d seconds=%.3f",
                shown(request_id),
                shown(adapter) if adapter else "-",
                reason.value if reason else "-",
                code,
                generated,
                time.monotonic() - started,
            )

    @staticmethod
    def _response(request_id: str, out: RequestOutput, index: int = 0) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=request_id, token_ids=out.new_token_ids, text=out.text, index=index)
        for lp in out.logprobs or ():
            resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                              top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        if isinstance(out.stop_reason, str):
            resp.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            resp.stop_token_id = out.stop_reason
        if out.finished:
            resp.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
            resp.usage.prompt_tokens = out.prompt_tokens
            resp.usage.generated_tokens = out.generated_tokens
            resp.usage.cached_tokens = out.cached_tokens
            t = out.timings
            if t is not None:
                end = t.finished or time.monotonic()
                resp.timings.queue_seconds = _since(t.arrival, t.first_scheduled)
                resp.timings.adapter_wait_seconds = _since(t.arrival, t.adapter_ready)
                resp.timings.time_to_first_token_seconds = _since(t.arrival, t.first_token)
                resp.timings.total_seconds = _since(t.arrival, end)
        return resp

    # ---- admin ----------------------------------------------------------------------------
    async def LoadAdapter(self, raw: bytes, context: grpc.aio.ServicerContext):
        return await self._unary("LoadAdapter", context, self._load_adapter, pb.LoadAdapterRequest, raw, admin=True)

    async def _load_adapter(self, request: pb.LoadAdapterRequest, context: Any) -> pb.LoadAdapterResponse:
        _, info = await self.adapters.load(self.engine, self._tenant(context), request.name, request.uri,
                                           request.sha256, pinned=request.pinned, preload=request.preload,
                                           shared=request.shared, for_tenant=request.tenant)
        return pb.LoadAdapterResponse(adapter=_adapter_pb(info, name=request.name))

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
        after = _page_key(request.page_token) if request.page_token else None
        admin = self._is_admin(context)
        # Paged over what this caller sees, so a page token never names an adapter it may not see.
        seen = [(name, info) for name, info in await self.adapters.visible(self.engine, self._tenant(context))
                if after is None or (name, info.version) > after]
        page, more = seen[:size], len(seen) > size
        resp = pb.ListAdaptersResponse(adapters=[_adapter_pb(info, with_uri=admin, name=name) for name, info in page])
        if more:
            resp.next_page_token = f"{page[-1][0]}@{page[-1][1].version}"
        else:
            resp.adapters.extend(await self._unregistered_preloads(admin))
        return resp

    async def _unregistered_preloads(self, with_uri: bool) -> list[pb.Adapter]:
        """Preload entries that never registered (LOADING / FAILED), shown after the last page."""
        if self.preloader is None or not self.preloader.states():
            return []
        registered = {a.name for a in await asyncio.wrap_future(self.engine.list_adapters())}
        return [pb.Adapter(name=entry.name, uri=entry.uri if with_uri else "", slot=-1, pinned=entry.pinned,
                           state=pb.AdapterState.Value("ADAPTER_STATE_" + state))
                for entry, state in self.preloader.unregistered(registered)]

    def _is_admin(self, context: grpc.aio.ServicerContext) -> bool:
        if self._tenant(context).admin:
            return True
        try:
            self.auth.check(context.invocation_metadata())
        except LoraplexError:
            return False
        return True

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
            if admin and not (tenant.admin or tenant.from_token):
                self.auth.check(context.invocation_metadata())
            return await fn(_parse(message, raw), context)
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


def _parse(message: type[Message], raw: bytes) -> Any:
    try:
        parsed = message.FromString(raw)
    except DecodeError as e:
        raise InvalidArgumentError(
            f"malformed {message.DESCRIPTOR.name} (e.g. invalid UTF-8 in a string): {e}") from None
    unknown = _unknown_field(parsed)
    if unknown is not None:
        # protobuf keeps fields it does not know and parses on: a client built from a newer proto
        # (or a typo'd field number) would get an answer that silently ignored what it asked for.
        raise InvalidArgumentError(
            f"{message.DESCRIPTOR.name} has field number {unknown} that this server does not implement "
            "(a client built from a newer loraplex.v1 proto?)")
    return parsed


def _unknown_field(msg: Message, prefix: str = "") -> str | None:
    """The first field, as `path.number`, that `msg` (or a message inside it) carried but its type lacks."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        return f"{prefix}{unknown[0].field_number}"
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            inner = fd.message_type.fields_by_name["value"]
            children = list(value.values()) if inner.message_type is not None else []
        else:
            children = list(value) if _is_repeated(fd) else [value]
        for child in children:
            found = _unknown_field(child, f"{prefix}{fd.name}.")
            if found is not None:
                return found
    return None


def _is_repeated(fd: Any) -> bool:
    return bool(getattr(fd, "is_repeated", False) or getattr(fd, "label", None) == fd.LABEL_REPEATED)


def _page_key(token: str) -> tuple[str, int]:
    name, _, version = token.rpartition("@")
    if not name or not version.isdigit() or len(token) > 160:
        raise InvalidArgumentError("page_token is not one this server returned")
    return name, int(version)


def add_servicer(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """`add_InferenceServicer_to_server`, but the handlers get the raw request bytes (see `_parse`)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        response = getattr(pb, method.output_type.name)
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=None,
                                     response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _cancel_code(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0.001 else "CANCELLED"


def _since(start: float, end: float | None) -> float:
    return max(0.0, end - start) if end is not None and math.isfinite(end) else 0.0


def _adapter_pb(info: Any, with_uri: bool = True, name: str | None = None) -> pb.Adapter:
    """`name`: what the caller knows it by (namespace.shown_name), the engine name by default."""
    state = getattr(pb, "ADAPTER_STATE_" + str(info.state).upper().split(".")[-1].split("(")[0], 0)
    return pb.Adapter(
        name=info.name if name is None else name,
        uri=info.uri if with_uri else "",
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
    servicer: InferenceServicer

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING while in-flight calls drain
        await self.server.stop(grace_s)


async def build_server(engine: EngineClient, config: ServerConfig, metrics: Any = None,
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


class FrontEnd(Protocol):
    """A front end served beside gRPC (the HTTP API): it starts once gRPC listens, reports the
    same readiness, and drains with it (see `drain`)."""

    async def start(self, ready: Callable[[], bool]) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


async def serve(engine: EngineClient, config: ServerConfig, metrics: Any = None,
                stop: asyncio.Event | None = None, collectors: Any = None, front_ends: Sequence[FrontEnd] = (),
                chat_template: ChatTemplate | None = None) -> None:
    """Serves until `stop` is set (or the task is cancelled), then drains (see ServerConfig).

    Health: the liveness service is SERVING from the start; readiness once the required preloads
    are in. Other preloads load (and retry) in the background. `collectors`: a prometheus registry
    to register the health and preload metrics on."""
    running = await build_server(engine, config, metrics, serving=False, chat_template=chat_template)
    await config.adapters.restore(engine)  # the tenants' adapters of the last run, before readiness
    reporter = HealthReporter(running.health, ("", SERVICE_NAME))
    try:  # before the preloads can make readiness SERVING: a ready server serves on every port
        for front_end in front_ends:
            await front_end.start(lambda: reporter.ready)
    except BaseException:
        await running.server.stop(0)
        raise
    health_only = await start_health_listener(running.health, config.health_listen) if config.health_listen else None
    preloader = Preloader(engine, running.servicer.uri_policy, adapter_name, config.preload_file,
                          config.preload + config.lora_modules, config.preload_reload_s,
                          on_change=lambda: _preloads_changed(reporter, preloader), fixed=config.lora_modules)
    running.servicer.preloader = preloader
    await reporter.update()  # liveness SERVING, readiness NOT_SERVING until the preloads say otherwise
    if collectors is not None:
        collectors.register(reporter.collector())
        collectors.register(preloader.collector())
    install_test_fault(engine)
    # The watcher runs whatever --watchdog-stall-s says: 0 turns off the stall check, not the
    # check that the engine is alive at all.
    tasks = [asyncio.create_task(preloader.run()),
             asyncio.create_task(watch_engine(engine, reporter, config.watchdog_stall_s))]
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
        await drain(running, reporter, engine, config, front_ends)
        preloader.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if health_only is not None:  # last: the probes saw readiness NOT_SERVING through the drain
            await health_only.stop(None)


async def _preloads_changed(reporter: HealthReporter, preloader: Preloader) -> None:
    reporter.preloads_ready = preloader.required_ready
    await reporter.update()


async def drain(running: RunningServer, reporter: HealthReporter, engine: EngineClient, config: ServerConfig,
                front_ends: Sequence[FrontEnd] = ()) -> None:
    """Readiness NOT_SERVING first (on every front end); after drain_delay_s new requests are
    refused on every port at once; in-flight ones finish within what is left of shutdown_grace_s;
    the rest are cancelled and counted."""
    started = time.monotonic()
    reporter.draining = True
    await reporter.update()
    log.info("draining: NOT_SERVING now, new RPCs refused in %.1fs, in-flight ones have %.1fs",
             config.drain_delay_s, config.shutdown_grace_s)
    await asyncio.sleep(max(0.0, min(config.drain_delay_s, config.shutdown_grace_s)))
    left = max(0.0, config.shutdown_grace_s - (time.monotonic() - started))
    stopping = asyncio.ensure_future(asyncio.gather(running.server.stop(left),
                                                    *(front_end.stop(left) for front_end in front_ends)))
    done, _ = await asyncio.wait({stopping}, timeout=max(0.0, left - 0.1))
    cancelled = 0
    if not done:
        stats = engine.stats()
        cancelled = stats.requests_running + sum(stats.requests_waiting.values())
    await stopping
    if cancelled:
        reporter.drain_cancelled += cancelled
        log.warning("drain: %d request(s) still running after %.1fs were cancelled", cancelled,
                    config.shutdown_grace_s)
    log.info("drained in %.1fs", time.monotonic() - started)
