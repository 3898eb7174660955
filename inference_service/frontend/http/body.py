"""Request bodies: bounded while they arrive, then parsed and validated off the event loop.

The loop is shared with gRPC. A body's size is bounded as it arrives (BodyLimit, 413), and the
number of JSON values in it before it is parsed (`Offload.parse`): a parse takes time in
proportion to that number, and pydantic-core holds the GIL throughout (as the stdlib json does), so
moving it to a thread does not free the loop (measured: a 4 MB body of 2M ids stopped every stream
for 0.3-0.8 s). A body with more commas than MAX_VALUES is counted first in a process of its own
(http/value_count.py) and refused when it holds more values than any request can use. What a
body within that bound costs (parsing, validation, tokenizing, chat templates) runs in worker
threads: milliseconds of GIL at a time, and Python code there yields to the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request as HttpRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from inference_service.frontend.http.errors import BadField, error_response
from inference_service.frontend.http.value_count import ValueCounter

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
WORKERS = 2
# Values a request may hold beyond its prompt ids (at most the context) or chat messages (fewer than
# the context's tokens): logit_bias (300 entries), stop strings and ids, content parts, tool calls.
EXTRA_VALUES = 4096


def max_values(max_context: int) -> int:
    """The most JSON values a request body may hold, for a model of this context (docs/http.md)."""
    return 2 * max_context + EXTRA_VALUES


class BodyTooLarge(LoraplexError):
    code = "RESOURCE_EXHAUSTED"


class BodyLimit:
    """Refuses request bodies over `limit` bytes with a 413 before the app reads them whole: a
    declared length at once, a chunked body as soon as it passes the limit (BodyTooLarge, raised
    in the reader and answered by the app's handler)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_large(self.limit)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(f"request body over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def too_large(limit: int) -> Any:
    return error_response(f"request body over {limit} bytes", 413, "RESOURCE_EXHAUSTED")


class Offload:
    """The worker threads for request-sized work, and the value counter (one of each per app)."""

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="loraplex-http")
        # Its own thread: requests that wait on the counter (one at a time) hold no worker of the pool.
        self._counting = ThreadPoolExecutor(1, thread_name_prefix="loraplex-http-count")
        self._counter = ValueCounter()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, http: HttpRequest, model: type[M]) -> M:
        """The body as `model`; a malformed or oversized one is INVALID_ARGUMENT naming the field
        (BadField)."""
        raw = await http.body()
        if not raw:
            raise InvalidArgumentError("the request body is empty: send a JSON object")
        if raw.count(b",") > self.max_values:  # C speed: ~2 ms a MB; every value but one follows a comma
            loop = asyncio.get_running_loop()
            values, field = await loop.run_in_executor(self._counting, self._counter.count, raw)
            if values > self.max_values:
                raise BadField(f"the request body holds {values} JSON values, more than a request can use "
                               f"(at most {self.max_values} for this model's context)", field)
        try:
            return await self.run(model.model_validate_json, raw)
        except ValidationError as e:
            raise bad_field(e) from None


def bad_field(error: ValidationError) -> BadField:
    first = error.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"])
    kind, message = first["type"], first["msg"]
    if kind == "extra_forbidden":
        return BadField(f"unsupported field {where!r}: this server does not implement it (docs/http.md)", where)
    if kind == "json_invalid":
        return BadField(f"the request body is not valid JSON: {message}", None)  # UTF-8, depth, syntax
    if not where:
        return BadField(f"the request body must be a JSON object: {message}", None)
    return BadField(f"{where}: {message}", where)
