"""Admin-RPC authentication and the adapter-source policy.

Both raise `LoraplexError` subclasses, so the servicer maps them like any engine error.
"""

from __future__ import annotations

import hmac
import ipaddress
import posixpath
from collections.abc import Iterable, Sequence
from urllib.parse import unquote, urlsplit

from inference_service.errors import InvalidArgumentError, PermissionDeniedError, UnauthenticatedError


class AdminAuth:
    """Checks `authorization: Bearer <token>` metadata; no token configured means open."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
        if self._token is None:
            return
        values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
        if not values:
            raise UnauthenticatedError("admin RPC needs 'authorization: Bearer <token>' metadata")
        value = values[0]
        raw = value.encode() if isinstance(value, str) else bytes(value)
        scheme, _, token = raw.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            raise UnauthenticatedError("authorization metadata must be 'Bearer <token>'")
        if not hmac.compare_digest(token.strip(), self._token):
            raise PermissionDeniedError("admin token rejected")


def read_token_file(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"admin token file {path} is empty")
    return token


class UriPolicy:
    """Adapter URIs must start with one of the allowed prefixes (on a path boundary).

    No prefixes configured allows any URI. Either way, a URI whose path has a '..' segment
    (also percent-encoded) is refused, and file:// URIs are compared after normalisation, so
    nothing can escape an allowed directory.
    """

    def __init__(self, allow: Sequence[str] = ()) -> None:
        self.allow = tuple(_normalise(p, what="allowed prefix") for p in allow)

    def check(self, uri: str) -> str:
        """Returns the normalised URI, or raises PermissionDeniedError / InvalidArgumentError."""
        norm = _normalise(uri, what="adapter uri")
        if not self.allow:
            return norm
        for prefix in self.allow:
            if norm == prefix or norm.startswith(prefix if prefix.endswith("/") else prefix + "/"):
                return norm
        raise PermissionDeniedError(
            f"adapter uri {uri!r} is outside the allowed sources ({', '.join(self.allow)})"
        )


def _normalise(uri: str, what: str) -> str:
    if not uri:
        raise InvalidArgumentError(f"{what} is empty")
    if any(ord(c) < 0x20 for c in uri):
        raise InvalidArgumentError(f"{what} contains control characters")
    parts = urlsplit(uri)
    if not parts.scheme:
        raise InvalidArgumentError(f"{what} {uri!r} has no scheme (file://, s3://, http(s)://)")
    path = unquote(parts.path)
    if ".." in path.split("/"):
        raise PermissionDeniedError(f"{what} {uri!r} contains a '..' path segment")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"{what} {uri!r}: file:// URIs must name a local path")
        if not path.startswith("/"):
            raise InvalidArgumentError(f"{what} {uri!r}: file:// URIs need an absolute path")
        norm = posixpath.normpath(path)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        return "file://" + norm
    return uri


def is_loopback_listen(address: str) -> bool:
    """True for unix sockets and loopback host:port addresses."""
    if address.startswith("unix:") or address.startswith("unix-abstract:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
