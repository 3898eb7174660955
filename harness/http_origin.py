"""A file origin for the sidecar's http(s):// store tests: a GET of one file, whole or by Range."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler


def send_file(handler: BaseHTTPRequestHandler, body: bytes | None, ranges: list[str]) -> None:
    """Answers `handler`'s GET with `body` (404 when None), honouring a `Range: bytes=a-b` header
    (recorded in `ranges`, in the order served) with a 206 and its Content-Range."""
    if body is None:
        handler.send_error(404)
        return
    first, last = 0, len(body) - 1
    if rng := handler.headers.get("Range"):
        ranges.append(rng)
        start, _, end = rng.removeprefix("bytes=").partition("-")
        first, last = int(start), min(int(end or last), len(body) - 1)
        handler.send_response(206)
        handler.send_header("Content-Range", f"bytes {first}-{last}/{len(body)}")
    else:
        handler.send_response(200)
    handler.send_header("Content-Length", str(last - first + 1))
    handler.end_headers()
    handler.wfile.write(body[first : last + 1])
