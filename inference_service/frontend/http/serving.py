"""Runs the HTTP app with uvicorn inside the gRPC server's asyncio loop (one process, one
engine): uvicorn's own signal handling is off; `serve()` starts this front end once gRPC listens
and drains it beside gRPC (same readiness, same drain delay, same grace).

What uvicorn lacks against slow or idle clients is added here: each request's headers must arrive
within `header_timeout_s` and its body within `body_timeout_s` after them (a connection that sends
nothing, or dribbles its request, is closed), and connections past `max_connections` are closed as
they are accepted, so a flood of them cannot take every file descriptor or hold the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from inference_service.frontend.http.config import HttpConfig

log = logging.getLogger("loraplex.http")
BACKLOG = 2048  # uvicorn's default
REFUSAL_LOG_EVERY_S = 10.0  # connections refused at the cap: one warning per this long, with the count


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gRPC side owns SIGINT/SIGTERM and stops us


class _Refusals:
    """Counts connections closed at the cap and says so at most every REFUSAL_LOG_EVERY_S: a flood
    must not turn into a log line per connection."""

    def __init__(self) -> None:
        self.count, self._logged_at = 0, -REFUSAL_LOG_EVERY_S

    def add(self, cap: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_EVERY_S:
            log.warning("HTTP connections closed at the cap of %d open (--http-max-connections): %d so far",
                        cap, self.count)
            self._logged_at = now


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on each request's headers and body, and a
    connection cap.

    The header clock starts when the connection opens (its first request) or at the first byte
    after a keep-alive pause (the pause itself is uvicorn's keep-alive timeout) and stops when the
    headers are complete; the body clock runs from there to the request's end. uvicorn cancels its
    keep-alive timer on any byte and arms nothing until a response is done, so without these a
    client sending a byte a second holds the connection forever."""

    def __init__(self, *args: Any, header_timeout_s: float, body_timeout_s: float, max_connections: int,
                 refusals: _Refusals, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._body_timeout_s = body_timeout_s
        self._max_connections = max_connections
        self._refusals = refusals
        self._timer: asyncio.TimerHandle | None = None  # the header or the body clock

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            self._refusals.add(self._max_connections)
            transport.close()
            return
        self._start_clock(self._header_timeout_s, "request headers")

    def data_received(self, data: bytes) -> None:
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            # The next request's first bytes (the clock stops below if they complete it).
            self._start_clock(self._header_timeout_s, "request headers")
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._stop_clock()
        super().on_headers_complete()
        self._start_clock(self._body_timeout_s, "request body")

    def on_message_complete(self) -> None:
        self._stop_clock()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self, seconds: float, what: str) -> None:
        self._timer = self.loop.call_later(seconds, self._late, seconds, what)

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self, seconds: float, what: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.debug("HTTP connection from %s closed: %s not complete within %gs", _peer(self.client), what,
                      seconds)
            self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


class _ReadinessGate:
    """`GET /health` answers 503 while the server should get no traffic (draining, required preloads
    missing, engine stuck or dead: what gRPC readiness says), so a gateway routing this port moves
    away when gRPC clients do; otherwise the app answers it.

    Meanwhile every response says `Connection: close`: a gateway's keep-alive connections would
    otherwise go on carrying new requests here until the drain closes them, and a request sent on
    one just as it closes is reset; a new connection goes where the gateway's routing now says."""

    def __init__(self, app: ASGIApp, ready: Callable[[], bool]) -> None:
        self.app, self.ready = app, ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.ready():
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/health":
            await Response(status_code=503, headers={"connection": "close"})(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def _listen(config: HttpConfig) -> socket.socket:
    """The listening socket, bound here so that a bind error is one clear RuntimeError (uvicorn
    would log it and raise SystemExit from inside its task)."""
    family = socket.AF_INET6 if ":" in config.addr else socket.AF_INET
    # IPPROTO_TCP, not the default 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY only
    # on sockets that say TCP. Without it a stream's first chunk, written right after the response
    # headers, waited for the client's delayed ACK on a keep-alive connection: +40 ms on every
    # streamed request's TTFT (44-52 ms for a 5-token prompt on the tiny model, gRPC 5-6 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and asyncio do
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((config.addr, config.port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"HTTP front end could not listen on {config.addr}:{config.port}: "
                           f"{e.strerror or e}") from None
    return sock


class HttpFrontEnd:
    """The OpenAI-compatible API as one of `serve()`'s front ends (server.FrontEnd)."""

    def __init__(self, app: ASGIApp, config: HttpConfig) -> None:
        self.app, self.config = app, config
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self, ready: Callable[[], bool]) -> None:
        """Serving once this returns; raises RuntimeError when the port cannot be bound."""
        sock = _listen(self.config)
        protocol = functools.partial(_GuardedProtocol, header_timeout_s=self.config.header_timeout_s,
                                     body_timeout_s=self.config.body_timeout_s,
                                     max_connections=self.config.max_connections, refusals=_Refusals())
        self._server = _EmbeddedServer(uvicorn.Config(
            _ReadinessGate(self.app, ready), log_level="warning", access_log=False, lifespan="off", ws="none",
            http=protocol,  # type: ignore[arg-type]  # httptools, chosen by measurement over h11: docs/http.md
            backlog=BACKLOG,
        ))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # its exception
                raise RuntimeError("HTTP front end stopped while starting")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API listening on %s:%d", self.config.addr, self.config.port)
        print(f"HTTP http://{self.config.addr}:{self.config.port}", flush=True)

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, closes idle connections, gives requests in flight `grace_s`, cancels the rest."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]  # a float works
        self._server.should_exit = True
        await self._task
