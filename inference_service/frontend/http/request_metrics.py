"""`loraplex_http_requests_total{route, code}`: every HTTP request the front end answers, refusals
included (400, 401, 404, 413, 429, ...), beside gRPC's `loraplex_grpc_requests_total`.

`route` is the matched route's template (`/v1/chat/completions`), never the raw path, so a client
cannot grow the label set; a path no route matches counts as `unmatched`. A request answered before
routing (a 413 for a declared body over the limit) is matched against the routes here. `code` is the
status sent (a streamed response's is its first line; 499: the client left before a non-streamed
answer; `none`: the connection ended before any).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"
NO_RESPONSE = "none"  # the connection ended before any status line was sent


class HttpRequestCounter:
    """ASGI middleware counting each HTTP request once, when it ends."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry, routes: Sequence[BaseRoute],
                 born: Sequence[str] = ()) -> None:
        self.app, self.routes = app, routes
        self.requests = Counter("loraplex_http_requests_total", "HTTP requests answered, by route template and "
                                "status code.", ["route", "code"], registry=registry)
        for path in born:  # series from the start, at 0: rate() then sees the first request too
            self.requests.labels(path, "200")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = NO_RESPONSE

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            self.requests.labels(self._template(scope), status).inc()

    def _template(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is None:  # answered before routing
            route = next((r for r in self.routes if r.matches(scope)[0] is Match.FULL), None)
        return getattr(route, "path", None) or UNMATCHED
