"""The ASGI app: OpenAI routes, vLLM's adapter routes, tokenize, health and /metrics.

Errors take one shape (OpenAI's `{"error": {...}}`) with the HTTP status mapped from the
LoraplexError class (http/errors.py), so a bad input means the same on both front ends; so do
unknown routes, wrong methods and bodies that are not JSON. Bodies are parsed, and prompts built
and tokenized, off the event loop that gRPC shares (http/body.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from adapter_cache.errors import InvalidArgumentError, LoraplexError, NotFoundError, PermissionDeniedError
from inference_service.engine.client import EngineClient
from inference_service.frontend.admission import Admission, GrammarRefused, with_adapter
from inference_service.frontend.auth import AdminAuth, admin_disabled_reason
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.config import ServerConfig
from inference_service.frontend.http.body import BodyLimit, BodyTooLarge, Offload, max_values, too_large
from inference_service.frontend.http.errors import (
    HTTP_STATUS,
    BadField,
    error_response,
    loraplex_error_response,
    status_of,
)
from inference_service.frontend.http.exchange import Exchange
from inference_service.frontend.http.mapping import OpenAIMapping
from inference_service.frontend.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from inference_service.frontend.http.rendering import OpenAIRendering
from inference_service.frontend.http.request_metrics import HttpRequestCounter
from inference_service.frontend.intake import adapter_name, optional_adapter
from inference_service.frontend.tenant_adapters import TenantAdapters
from inference_service.frontend.tenants import QuotaExceeded, Tenant
from inference_service.limits import shown

log = logging.getLogger("loraplex.http")
# The gRPC status name (`error.code`) of the errors Starlette raises itself: 404 and 405 routes.
ROUTE_CODES = {**{status: code for code, status in HTTP_STATUS.items()}, 405: "UNIMPLEMENTED"}


class _ExchangeResponse(StreamingResponse):
    """An SSE response that closes its Exchange exactly once, however the response ends."""

    def __init__(self, exchange: Exchange, content: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.exchange.close()


def build_app(engine: EngineClient, config: ServerConfig, served_model_names: tuple[str, ...],
              chat_template: ChatTemplate | None, registry: CollectorRegistry | None, listen: str,
              tool_call_parser: str = "auto") -> ASGIApp:
    """The HTTP front end over `engine` on `listen` (host:port); `registry` is the one the gRPC
    process exposes. Admin routes follow the gRPC rules for that address (auth.admin_disabled_reason).
    `tool_call_parser`: how tool_choice `auto` finds calls in the model's text (frontend/tool_parsers.py)."""
    app = FastAPI(title="loraplex", docs_url=None, redoc_url=None, openapi_url=None)
    openai = OpenAIMapping(engine, served_model_names, config.default_max_new_tokens, chat_template,
                           tool_call_parser)
    render = OpenAIRendering(engine.tokenizer)
    admission = Admission(engine, config, "http")
    tenancy = config.tenancy
    adapters_of = config.adapters  # names, sources and limits of tenants' adapters (frontend/tenant_adapters.py)
    auth = AdminAuth(config.admin_token, admin_disabled_reason(listen, config.admin_token, config.insecure_admin))
    started = int(time.time())
    base = served_model_names[0]
    offload = Offload(max_values(engine.model_info.max_context))

    @app.exception_handler(LoraplexError)
    async def _loraplex_error(http: HttpRequest, exc: LoraplexError) -> JSONResponse:
        log.info("%s %s refused: %s %s", http.method, http.url.path, exc.code, exc)  # as gRPC logs each outcome
        response = loraplex_error_response(exc)
        if isinstance(exc, QuotaExceeded):
            response.headers["Retry-After"] = exc.retry_after_header
        elif exc.code == "UNAUTHENTICATED":
            response.headers["WWW-Authenticate"] = "Bearer"
        return response

    def tenant_of(http: HttpRequest) -> Tenant:
        """The caller's tenant (frontend/tenants.py); UNAUTHENTICATED (401) for a token the tenants file lacks."""
        return tenancy.resolve(http.headers.items(), None)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(http: HttpRequest, exc: BodyTooLarge) -> JSONResponse:
        log.info("%s %s refused: %s", http.method, http.url.path, exc)
        return too_large(config.max_message_bytes)

    @app.exception_handler(HTTPException)
    async def _route_error(http: HttpRequest, exc: HTTPException) -> JSONResponse:
        """Starlette's own answers (no such route, a wrong method) in OpenAI's shape, not `{"detail"}`."""
        response = error_response(f"{http.method} {shown(http.url.path)}: {exc.detail}", exc.status_code,
                                  ROUTE_CODES.get(exc.status_code))
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(ClientDisconnect)
    async def _client_left(http: HttpRequest, _: ClientDisconnect) -> Response:
        """A client that leaves (or is closed by the body timeout) before its body arrived is no server fault."""
        log.info("%s %s: the client left before its request body arrived", http.method, shown(http.url.path))
        return Response(status_code=400)  # never read: the connection is gone

    @app.exception_handler(Exception)
    async def _bug(_: HttpRequest, exc: Exception) -> JSONResponse:
        log.error("HTTP request failed", exc_info=exc)
        return error_response("internal error", 500, "INTERNAL")

    async def generate(http: HttpRequest, chat: bool) -> Response:
        tenant = tenant_of(http)
        admission.enter(tenant)  # at its cap: refused before the body is read
        body = await offload.parse(http, ChatCompletionRequest if chat else CompletionRequest)
        with _model_named(body.model):  # its own adapter, else the shared one
            adapter = admission.adapter(tenant, optional_adapter(openai.adapter_of(body.model)))
        try:
            admission.check_priority(tenant, body.priority)
        except InvalidArgumentError as e:
            raise BadField(str(e), "priority") from None
        request = await offload.run(openai.prepare, body, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}")
        try:
            with _model_named(body.model):
                gen = await admission.submit(tenant, with_adapter(request, adapter), body.priority)
        except GrammarRefused as e:
            raise BadField(str(e), _grammar_field(body)) from None
        exchange = Exchange(gen)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ExchangeResponse(exchange, render.sse(exchange, body.model, chat, include_usage,
                                                          openai.tool_mode(body)))
        try:
            result = await render.collect(exchange, http)
        except LoraplexError as e:
            exchange.status = status_of(e)
            raise
        finally:
            exchange.close()
        if result is None:
            return Response(status_code=499)  # nobody is listening: nginx's "client closed request"
        if chat:
            return JSONResponse(render.chat_body(exchange, body.model, result, openai.tool_mode(body)))
        return JSONResponse(render.completion_body(exchange, body.model, result))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest) -> Response:
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest) -> Response:
        return await generate(http, chat=True)

    @app.get("/v1/models")
    async def models(http: HttpRequest) -> JSONResponse:
        info = engine.model_info
        card = {"object": "model", "created": started, "owned_by": "loraplex", "max_model_len": info.max_context}
        # root: the model's name, never where the server keeps its files
        data = [{**card, "id": name, "root": info.name, "parent": None} for name in served_model_names]
        tenant = tenant_of(http)
        # listed by (name, version): the last one wins; a tenant sees its own adapters and the shared ones
        latest = dict(await adapters_of.visible(engine, tenant))
        # URIs only for admins, as ListAdapters: they say where tenants' weights live
        admin = auth.is_admin(tenant, http.headers.items())
        data += [{**card, "id": name, "root": a.uri if admin else name, "parent": base} for name, a in latest.items()]
        return JSONResponse({"object": "list", "data": data})

    def admin_check(http: HttpRequest) -> Tenant:
        """Admin routes: an admin or a tenant of the tenants file (which acts on its own adapters), or
        the admin token rules of gRPC (auth.admin_disabled_reason)."""
        tenant = tenant_of(http)
        auth.require_admin(tenant, http.headers.items())
        return tenant

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(http: HttpRequest) -> Response:
        tenant = admin_check(http)
        body = await offload.parse(http, LoadLoraAdapterRequest)
        if adapter_name(body.lora_name) in served_model_names:
            raise InvalidArgumentError(f"{body.lora_name!r} is the base model's name")
        path = body.lora_path
        uri = Path(path).absolute().as_uri() if path.startswith("/") else path
        await adapters_of.load(engine, tenant, body.lora_name, uri, body.sha256, preload=True, shared=body.shared,
                               for_tenant=body.tenant, replace=body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(http: HttpRequest) -> Response:
        tenant = admin_check(http)
        body = await offload.parse(http, UnloadLoraAdapterRequest)
        await adapters_of.unload(engine, tenant, adapter_name(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest) -> JSONResponse:
        tenant = tenant_of(http)
        body = await offload.parse(http, TokenizeRequest)
        if body.model is not None and body.model not in served_model_names:
            await _known_adapter(engine, body.model, adapters_of, tenant)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidArgumentError("give exactly one of prompt and messages")
        ids = await offload.run(openai.tokenize, body)
        return JSONResponse({"count": len(ids), "max_model_len": engine.model_info.max_context, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest) -> JSONResponse:
        tenant = tenant_of(http)
        body = await offload.parse(http, DetokenizeRequest)
        if body.model is not None and body.model not in served_model_names:
            await _known_adapter(engine, body.model, adapters_of, tenant)
        return JSONResponse({"prompt": await offload.run(openai.detokenize, body.tokens)})

    @app.get("/health")
    async def health() -> Response:
        # The scheduler thread is the engine: when it has died nothing will be served.
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics(http: HttpRequest) -> Response:
        if registry is None:
            return error_response("metrics are not enabled", 404, "NOT_FOUND")
        # Per-adapter and per-tenant series name every tenant's adapters: with tenants configured they
        # are the admin's on this port (401 without a credential, 403 for a tenant's); Prometheus inside
        # the cluster scrapes --metrics-port, which stays open.
        if tenancy.enabled and not tenant_of(http).admin:
            raise PermissionDeniedError("/metrics on this port needs an admin credential when tenants are configured")
        # Off the event loop: the residency collector waits for the scheduler thread (residency.py).
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    limited = BodyLimit(app, config.max_message_bytes)
    if registry is None:
        return limited
    born = ("/v1/completions", "/v1/chat/completions", "/v1/models")
    return HttpRequestCounter(limited, registry, app.router.routes, born)  # outermost: a 413 is counted too


@contextlib.contextmanager
def _model_named(model: str) -> Iterator[None]:
    """On the OpenAI API an adapter is a model: an unknown one (or another tenant's) is a `model` that
    does not exist, in OpenAI's words, whatever the engine called it."""
    try:
        yield
    except NotFoundError:
        error = NotFoundError(f"model {model!r} does not exist (GET /v1/models lists the models served here)")
        error.param = "model"  # type: ignore[attr-defined]  # OpenAI's error.param (http/errors.py)
        raise error from None


async def _known_adapter(engine: EngineClient, name: str, adapters_of: TenantAdapters, tenant: Tenant) -> None:
    try:
        engine_name = adapters_of.resolve(engine, tenant, adapter_name(name))
    except InvalidArgumentError:
        engine_name = None
    if engine_name is None or not engine.adapter_is_current(engine_name):
        raise NotFoundError(f"model {name!r} does not exist")


def _grammar_field(body: CompletionRequest | ChatCompletionRequest) -> str:
    if isinstance(body, ChatCompletionRequest) and body.tools and body.tool_choice not in (None, "none", "auto"):
        return "tools"
    return "structured_outputs" if body.structured_outputs is not None else "response_format"
