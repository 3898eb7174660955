"""Who may share prefix-cached KV: the salt a front end gives each request, from the trusted side only.

The engine keys cached blocks by the weights and this salt (engine.prefix_cache). It is built here
from what the operator configured and what the transport authenticated, never from a request
field: `--prefix-cache-salt` (the operator's, mixed into every key), and `--prefix-cache-scope`:
- `shared` (the default without tenant configuration): one namespace per weights (base model or
  adapter version) for all clients: a prompt another client sent is a hit, which that client can
  observe as a faster first token and in `cached_tokens`.
- `listener`: the gRPC and HTTP listeners never share.
- `identity` (the default with any tenant configuration, ServerConfig.cache_scope): clients of
  different tenants never share (frontend/tenants.py: a bearer token of --tenants-file or the admin
  token, the operator's trusted tenant header, or the mTLS client certificate's subject), on either
  front end, unless the operator puts tenants in one `cache_group`. The anonymous tenant keeps its
  listener's namespace, apart from every named tenant's.
Typed (kind, value) pairs, so no listener, identity or operator salt can be spelled as another.
"""

from __future__ import annotations

from collections.abc import Iterable

from inference_service.engine.request import CacheSalt

SCOPES = ("shared", "listener", "identity")


def cache_salt(scope: str, operator_salt: str | None, listener: str, identity: str | None) -> CacheSalt | None:
    if scope not in SCOPES:
        raise ValueError(f"unknown prefix-cache scope {scope!r}")
    parts: list[tuple[str, str]] = []
    if operator_salt:
        parts.append(("operator", operator_salt))
    if scope in ("listener", "identity"):
        parts.append(("listener", listener))
    if scope == "identity" and identity is not None:
        parts.append(("identity", identity))
    return tuple(parts) or None


def grpc_identity(auth_context: dict[str, Iterable[bytes]]) -> str | None:
    """The mTLS client certificate's subject common name(s), as the TLS handshake verified them;
    None without a client certificate (the only identity gRPC has today)."""
    names = auth_context.get("x509_common_name")
    if not names:
        return None
    return "\n".join(sorted(n.decode("utf-8", "replace") for n in names))
