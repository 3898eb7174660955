"""Which adapter URIs may be loaded: one allow-list, enforced by the service (LoadAdapter, preload)
and again by the adapter-cache sidecar where it fetches, so neither relies on the other's check.

Raises `LoraplexError` subclasses, so both servers map them like any other error.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlsplit

from inference_service.errors import InvalidArgumentError, PermissionDeniedError

SCHEMES = ("file", "s3", "http", "https")


class UriPolicy:
    """Adapter URIs must be under one of the allowed prefixes (on a path boundary: a prefix
    `s3://b/team-a` allows `s3://b/team-a` and `s3://b/team-a/x`, not `s3://b/team-a-evil`).

    No prefixes allow nothing: every URI is PERMISSION_DENIED, naming `flag` (the option that
    sets them). A URI with a '..' path segment (also percent-encoded) is refused; file:// paths
    are normalised and compared with symlinks resolved, so nothing escapes an allowed directory;
    other URIs name objects, which cannot be normalised, so a '.' segment is refused there too.
    A URI carrying credentials (`user:password@`) is INVALID_ARGUMENT, and its message shows it
    with them masked: credentials come from the environment or a mounted secret, never a URI
    that is logged, listed and stored.
    """

    def __init__(self, allow: Sequence[str] = (), flag: str = "--adapter-source-allow") -> None:
        self.allow = tuple(_normalise(p, what="allowed prefix") for p in allow)
        self.flag = flag
        self.file_roots = [_real(p) for p in self.allow if p.startswith("file://")]

    def check(self, uri: str) -> str:
        """The normalised URI, or PermissionDeniedError / InvalidArgumentError."""
        norm = _normalise(uri, what="adapter uri")
        if not norm.startswith("file://"):
            norm = norm.rstrip("/")  # an adapter is a directory: one name for it, one cache entry
        if not self.allow:
            raise PermissionDeniedError(
                f"adapter uri {shown(uri)!r} refused: no adapter sources are allowed (start the server with "
                f"{self.flag} PREFIX, e.g. {self.flag} file:///srv/adapters/)"
            )
        if norm.startswith("file://"):
            if self.resolve_file(norm[len("file://"):]) is not None:
                return norm
        elif any(norm == p or norm.startswith(p if p.endswith("/") else p + "/") for p in self.allow):
            return norm
        raise PermissionDeniedError(
            f"adapter uri {shown(uri)!r} is outside the allowed sources ({', '.join(self.allow)}; see {self.flag})"
        )

    def resolve_file(self, path: str) -> Path | None:
        """`path` with symlinks resolved if that is one of the allowed directories or under one,
        else None. A reader calls it again at open time and opens what it returns: a link can
        change after the URI was checked."""
        real = Path(os.path.realpath(path))
        return real if any(real == root or root in real.parents for root in self.file_roots) else None


def _real(file_uri: str) -> Path:
    return Path(os.path.realpath(file_uri[len("file://"):]))


def _normalise(uri: str, what: str) -> str:
    if not uri:
        raise InvalidArgumentError(f"{what} is empty")
    if any(ord(c) < 0x20 for c in uri):
        raise InvalidArgumentError(f"{what} contains control characters")
    parts = urlsplit(uri)
    if "@" in parts.netloc:
        raise InvalidArgumentError(
            f"{what} {shown(uri)!r} carries credentials: give them through the environment or a secret, "
            "never in the URI"
        )
    if not parts.scheme:
        raise InvalidArgumentError(f"{what} {shown(uri)!r} has no scheme (file://, s3://, http(s)://)")
    if parts.scheme not in SCHEMES:
        raise InvalidArgumentError(f"{what} {shown(uri)!r}: unsupported scheme (file, s3, http, https)")
    if parts.query or parts.fragment:
        raise InvalidArgumentError(f"{what} {shown(uri)!r} must not have a query or fragment")
    path = unquote(parts.path)
    segments = path.split("/")
    if ".." in segments or (parts.scheme != "file" and "." in segments):
        raise PermissionDeniedError(f"{what} {shown(uri)!r} contains a '..' or '.' path segment")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"{what} {shown(uri)!r}: file:// URIs must name a local path")
        if not path.startswith("/"):
            raise InvalidArgumentError(f"{what} {shown(uri)!r}: file:// URIs need an absolute path")
        norm = posixpath.normpath(path)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        return "file://" + norm
    return uri


def shown(uri: str) -> str:
    """`uri` for a message or a log line: anything before an '@' in its authority masked, so a
    password never leaves in an error (also for URIs too malformed for urlsplit to find one)."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "", uri
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    return f"{scheme}{sep}{authority}{slash}{path}"
