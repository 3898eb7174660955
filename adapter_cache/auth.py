"""Who may call the sidecar, and as whom.

Two layers, both documented in docs/sidecar.md:
- The socket. On a unix socket (the default) the kernel checks the caller's uid against the
  socket file's mode when it connects: 0600, the sidecar's own user only, or 0660 with --group.
  gRPC Python does not expose a connection's SO_PEERCRED to handlers, so the file mode is the
  uid check. A TCP listener has no such check and needs a token file (see cli.py).
- Bearer tokens in `authorization: Bearer <token>` metadata. With --token-file, Stage, Read and
  Release need one of its tokens (one per line; each is a separate caller for the lease cap).
  List and Evict are admin calls: they need a token from --admin-token-file and are refused
  when there is none. An admin token is accepted for the other calls too.

Raises `LoraplexError` subclasses, so the servicer maps them like any other error.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from inference_service.errors import PermissionDeniedError, UnauthenticatedError

LOCAL = "local"  # the caller name when no token is configured: whoever the socket mode lets in


@dataclass(frozen=True)
class Caller:
    name: str  # owner of the leases it takes: LOCAL, or "token:<first 8 hex of the token's sha256>"
    admin: bool


def read_tokens(path: str) -> list[str]:
    """The non-empty lines of a token file (several allow rotation, or one per client)."""
    with open(path, encoding="utf-8") as f:
        tokens = [line.strip() for line in f if line.strip()]
    if not tokens:
        raise ValueError(f"token file {path} holds no token")
    return tokens


class CacheAuth:
    def __init__(self, client_tokens: Sequence[str] = (), admin_tokens: Sequence[str] = ()) -> None:
        self._client = [(t.encode(), _name(t)) for t in client_tokens]
        self._admin = [(t.encode(), _name(t)) for t in admin_tokens]

    @classmethod
    def from_files(cls, token_file: str | None, admin_token_file: str | None) -> CacheAuth:
        return cls(read_tokens(token_file) if token_file else (),
                   read_tokens(admin_token_file) if admin_token_file else ())

    @property
    def tokens_required(self) -> bool:
        return bool(self._client)

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None, admin: bool = False) -> Caller:
        """The caller of an RPC (`admin`: List or Evict), or UNAUTHENTICATED / PERMISSION_DENIED."""
        if admin and not self._admin:
            raise PermissionDeniedError("List and Evict are admin calls, and the sidecar has no --admin-token-file")
        token = _bearer(metadata)
        if token is None:
            if admin or self._client:
                raise UnauthenticatedError("this call needs 'authorization: Bearer <token>' metadata")
            return Caller(LOCAL, admin=False)
        # Every configured token is compared (in constant time), so timing does not tell which matched.
        admin_name = _match(token, self._admin)
        client_name = _match(token, self._client)
        if admin_name is None and client_name is None:
            raise UnauthenticatedError("token rejected")
        if admin and admin_name is None:
            raise PermissionDeniedError("List and Evict need an admin token (--admin-token-file)")
        return Caller(admin_name, True) if admin_name is not None else Caller(client_name, False)


def _name(token: str) -> str:
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:8]


def _match(token: bytes, known: list[tuple[bytes, str]]) -> str | None:
    found = None
    for value, name in known:
        if hmac.compare_digest(token, value):
            found = name
    return found


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if not values:
        return None
    raw = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
    scheme, _, token = raw.partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        raise UnauthenticatedError("authorization metadata must be 'Bearer <token>'")
    return token.strip()
