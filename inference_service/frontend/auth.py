"""Admin-RPC authentication (the adapter-source policy is `uri_policy`).

Raises `LoraplexError` subclasses, so the servicer maps them like any engine error.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from typing import TYPE_CHECKING

from adapter_cache.errors import LoraplexError, PermissionDeniedError, UnauthenticatedError

if TYPE_CHECKING:
    from inference_service.frontend.tenants import Tenant

Metadata = Iterable[tuple[str, str | bytes]] | None  # gRPC invocation metadata or HTTP headers


class AdminAuth:
    """Checks `authorization: Bearer <token>` metadata; no token configured means open, unless
    `disabled_reason` is set: then every admin RPC is PERMISSION_DENIED with that message."""

    def __init__(self, token: str | None, disabled_reason: str | None = None) -> None:
        self._token = token.encode() if token else None
        self.disabled_reason = None if token else disabled_reason

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def is_admin(self, tenant: Tenant, metadata: Metadata) -> bool:
        """Whether the caller may see what only admins see (adapter URIs): an admin tenant, or the
        admin token rules (`check`) pass."""
        if tenant.admin:
            return True
        try:
            self.check(metadata)
        except LoraplexError:
            return False
        return True

    def require_admin(self, tenant: Tenant, metadata: Metadata) -> None:
        """Admin RPCs and routes: an admin or a tenant of the tenants file (which acts on its own
        adapters) passes; anyone else needs the admin token (`check`)."""
        if not (tenant.admin or tenant.from_token):
            self.check(metadata)

    def check(self, metadata: Metadata) -> None:
        if self.disabled_reason is not None:
            raise PermissionDeniedError(self.disabled_reason)
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


def admin_disabled_reason(listen: str, token: str | None, insecure_admin: bool) -> str | None:
    """Why admin RPCs are off: a non-loopback listener with no token (and no --insecure-admin).
    The server still serves Generate there; only LoadAdapter/UnloadAdapter are refused."""
    if token is not None or insecure_admin or is_loopback_listen(listen):
        return None
    return (f"admin RPCs are disabled: the server listens on {listen} without an admin token. "
            "Enable them with --admin-token-file or LORAPLEX_ADMIN_TOKEN (Helm: "
            "inference.adminToken.existingSecret), then send 'authorization: Bearer <token>'")
