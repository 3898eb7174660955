"""Adapter namespaces: which engine adapter a tenant's bare name means, and back.

Every adapter belongs to one tenant or is shared (the operator's: preloads, the adapter resolver's,
an admin's LoadAdapter with `shared`). The engine knows one flat namespace of names; this module
alone maps (owner, bare name) onto it:

- a shared adapter's engine name is its bare name (as on a server without tenants);
- tenant T's adapter `foo` is `foo__<d>`, `<d>` the first 32 hex digits of SHA-256 over
  "loraplex-tenant\\0" + T (UTF-8). The suffix has a fixed length, so an engine name splits in one
  way only, and bare names that end like one (`__` + 32 hex digits) are refused: no bare name a
  tenant (or an operator) can write is another tenant's engine name. A tenant's bare names are at
  most 94 characters (128 with the suffix).

A tenant's `model=foo` is its own `foo` if it has one, else the shared `foo` (its own shadows a
shared one; nothing is refused for the clash). Another tenant's `foo` is never looked at, so the
answer for it is the answer for a name that does not exist. Admins see and address engine names.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

from adapter_cache.errors import InvalidArgumentError
from inference_service.frontend.tenants import ADMIN, ANONYMOUS, Tenant
from inference_service.limits import ADAPTER_NAME_MAX_LEN, shown

SEPARATOR = "__"
DIGEST_CHARS = 32
MAX_TENANT_NAME = ADAPTER_NAME_MAX_LEN - len(SEPARATOR) - DIGEST_CHARS  # 94
_SUFFIX = re.compile(r"__[0-9a-f]{32}\Z")


def tenant_digest(tenant: str) -> str:
    """The engine-name suffix of `tenant`'s adapters (128 bits: no tenant name can be chosen to collide)."""
    return hashlib.sha256(b"loraplex-tenant\0" + tenant.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]


def is_engine_only(name: str) -> bool:
    """Whether `name` has the form of a tenant's engine name (never a bare name)."""
    return _SUFFIX.search(name) is not None


def engine_name(owner: str | None, bare: str) -> str:
    """The engine's name for `owner`'s (None: shared) adapter `bare` (a checked adapter name)."""
    check_bare(bare)
    if owner is None:
        return bare
    if len(bare) > MAX_TENANT_NAME:
        raise InvalidArgumentError(f"a tenant's adapter names are at most {MAX_TENANT_NAME} characters")
    return f"{bare}{SEPARATOR}{tenant_digest(owner)}"


def split(engine: str) -> tuple[str | None, str]:
    """(owner digest or None for a shared adapter, bare name) of an engine name."""
    if is_engine_only(engine):
        cut = len(engine) - len(SEPARATOR) - DIGEST_CHARS
        return engine[cut + len(SEPARATOR):], engine[:cut]
    return None, engine


def check_bare(name: str) -> None:
    if is_engine_only(name):
        raise InvalidArgumentError(
            f"adapter name {shown(name)} ends like a tenant's engine name ('__' and {DIGEST_CHARS} hex digits), "
            "which is reserved")


def owner_of(tenant: Tenant) -> str | None:
    """The namespace a principal's own loads go to: None (shared) for the admin token and for the one
    implicit tenant of a server without tenant configuration; otherwise its tenant name (an anonymous
    tenant the tenants file declares is a tenant like any other)."""
    if tenant.spec is None and tenant.name in (ADMIN, ANONYMOUS):
        return None
    return tenant.name


def resolve(tenant: Tenant, name: str | None, is_registered: Callable[[str], bool]) -> str | None:
    """The engine name a request's adapter `name` means for `tenant` (None: the base model).

    `is_registered`: whether an engine name is registered now. The tenant's own adapter first, else the shared name (the
    engine then answers NOT_FOUND for the bare name, whoever else has one). Admins may also give an
    engine name; for anyone else a name of that form is INVALID_ARGUMENT, whatever exists."""
    if name is None:
        return None
    if is_engine_only(name):
        if tenant.admin:
            return name
        check_bare(name)
    owner = owner_of(tenant)
    if owner is not None and len(name) <= MAX_TENANT_NAME:
        own = engine_name(owner, name)
        if is_registered(own):
            return own
    return name


def shown_name(tenant: Tenant, engine: str, is_registered: Callable[[str], bool]) -> str | None:
    """The name `tenant` knows engine adapter `engine` by, or None when it may not see it: admins see
    engine names; a tenant sees its own by bare name and shared ones unless its own shadows them."""
    if tenant.admin:
        return engine
    digest, bare = split(engine)
    owner = owner_of(tenant)
    if digest is None:
        if owner is not None and len(bare) <= MAX_TENANT_NAME and is_registered(engine_name(owner, bare)):
            return None  # shadowed by the tenant's own
        return bare
    return bare if owner is not None and digest == tenant_digest(owner) else None


def public_message(text: str, engine: str | None, bare: str | None) -> str:
    """An engine error's text in the caller's words: its bare adapter name, not the engine name."""
    if engine and bare and engine != bare:
        return text.replace(engine, bare)
    return text


__all__ = ["MAX_TENANT_NAME", "check_bare", "engine_name", "is_engine_only", "owner_of", "public_message",
           "resolve", "shown_name", "split", "tenant_digest"]
