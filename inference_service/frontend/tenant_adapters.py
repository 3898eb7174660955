"""What a caller may do with adapters, on both front ends: load, unload, list and name them.

Names go through frontend/namespace.py (a tenant's own namespace, then the shared one). A load is
checked, in order, against: who may own it (only admins load shared adapters or load for a
tenant), the operator's allow-list (the ceiling, PERMISSION_DENIED), the tenant's own `sources`
from the tenants file (PERMISSION_DENIED; a tenant without `sources` may load nothing) and the
tenant's `max_adapters` (FAILED_PRECONDITION: the tenant frees a place by unloading one of its own,
so a retry without that cannot pass and 429 would invite one). Refusals of the last two are counted
per tenant (`loraplex_tenant_adapter_refusals_total`, top-K tenants by name, the rest `other`).
A tenant's loads run one at a time, so its count cannot be raced past its limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from adapter_cache.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    PermissionDeniedError,
)
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.frontend import namespace
from inference_service.frontend.adapter_store import Registration, RegistrationStore
from inference_service.frontend.intake import AdapterLoad, adapter_load
from inference_service.frontend.tenants import OTHER, Tenant, TenantSpec
from inference_service.limits import shown

log = logging.getLogger("loraplex.adapters")

SOURCES_FLAG = "the tenants file's `sources`"


class TenantAdapters:
    """The adapter operations of both front ends of one server (event-loop thread only)."""

    def __init__(self, specs: tuple[TenantSpec, ...], policy: UriPolicy, state_dir: str | None = None,
                 metrics_top_k: int = 10) -> None:
        self.policy = policy  # the operator's ceiling
        self._specs = {s.name: s for s in specs}
        self._scopes: dict[str, UriPolicy] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.store = RegistrationStore(state_dir) if state_dir else None
        self.top_k = max(0, metrics_top_k)
        self.refusals: dict[tuple[str, str], int] = {}  # (tenant, reason) → count

    # ---- names -------------------------------------------------------------------------------

    @staticmethod
    def resolve(engine: EngineClient, tenant: Tenant, name: str | None) -> str | None:
        """The engine name of a request's adapter (see namespace.resolve)."""
        return namespace.resolve(tenant, name, engine.adapter_is_current)

    async def visible(self, engine: EngineClient, tenant: Tenant) -> list[tuple[str, Any]]:
        """(the name `tenant` knows it by, AdapterInfo) of every adapter version it may see, by (name, version)."""
        infos = await asyncio.wrap_future(engine.list_adapters())
        shown_infos = []
        for info in infos:
            name = namespace.shown_name(tenant, info.name, engine.adapter_is_current)
            if name is not None:
                shown_infos.append((name, info))
        shown_infos.sort(key=lambda item: (item[0], getattr(item[1], "version", 0) or 0))
        return shown_infos

    # ---- load / unload -----------------------------------------------------------------------

    def load_owner(self, tenant: Tenant, shared: bool, for_tenant: str) -> str | None:
        """Who a load's adapter belongs to: the caller's own namespace unless an admin says `shared`
        or names a tenant."""
        if shared and for_tenant:
            raise InvalidArgumentError("give shared or tenant, not both")
        if (shared or for_tenant) and not tenant.admin:
            raise PermissionDeniedError("only an admin may load a shared adapter or load for another tenant")
        if shared:
            return None
        if for_tenant:
            return for_tenant
        return namespace.owner_of(tenant)

    def checked_load(self, tenant: Tenant, owner: str | None, name: str, uri: str, sha256: str | None) -> AdapterLoad:
        """The load with its URI checked against the operator's allow-list and then, for a tenant's
        load, the tenant's own sources: a file:// URI comes back with its links resolved, so what is
        read is what was checked. Admins answer to the allow-list alone; a tenant without `sources`
        may load nothing. A tenant's refusal is counted and names its own sources only (the
        allow-list may name other tenants' prefixes)."""
        if tenant.admin or owner is None:
            return adapter_load(name, uri, sha256, self.policy)
        spec = self._specs.get(owner)
        sources = spec.sources if spec is not None else ()
        scope = self._scopes.get(owner)
        if scope is None:
            scope = self._scopes[owner] = UriPolicy(sources, flag=SOURCES_FLAG)
        try:
            load = adapter_load(name, uri, sha256, self.policy)
            checked = scope.check(load.uri)
        except PermissionDeniedError:
            self._refuse(owner, "source")
            raise PermissionDeniedError(
                f"adapter uri {shown(uri)!r} is outside this tenant's sources "
                f"({', '.join(sources) or 'none'}; {SOURCES_FLAG})") from None
        if checked.startswith("file://"):
            real = scope.resolve_file(checked[len("file://"):])
            assert real is not None  # check() passed on the same path
            checked = Path(real).as_uri()
        return AdapterLoad(load.name, checked, load.sha256)

    async def load(self, engine: EngineClient, tenant: Tenant, name: str, uri: str, sha256: str | None = None,
                   pinned: bool = False, preload: bool = False, shared: bool = False, for_tenant: str = "",
                   replace: bool = True) -> tuple[str, Any]:
        """Registers adapter `name` from `uri` for its owner; (engine name, AdapterInfo). `replace=False`:
        an adapter of that name is INVALID_ARGUMENT (HTTP's load_inplace)."""
        owner = self.load_owner(tenant, shared, for_tenant)
        load = self.checked_load(tenant, owner, name, uri, sha256)
        engine_name = namespace.engine_name(owner, load.name)
        uri = load.uri
        lock = self._locks.setdefault(owner, asyncio.Lock()) if owner is not None else None
        async with lock or contextlib.nullcontext():
            registered = engine.adapter_is_current(engine_name)
            if not replace and registered:
                raise InvalidArgumentError(f"adapter {load.name!r} is already loaded (set load_inplace to replace it)")
            if not registered and not tenant.admin and owner is not None:
                await self._check_room(engine, owner)
            info = await asyncio.wrap_future(engine.load_adapter(
                engine_name, uri, sha256=load.sha256, pinned=pinned, preload=preload, owner=owner))
        if self.store is not None:
            self.store.put(Registration(engine_name, owner, uri, load.sha256, pinned))
        log.info("adapter %s of %s loaded as %s from %s (pinned=%s preload=%s)", load.name,
                 shown(owner) if owner else "shared", engine_name, shown(uri), pinned, preload)
        return engine_name, info

    async def _check_room(self, engine: EngineClient, owner: str) -> None:
        spec = self._specs.get(owner)
        cap = spec.max_adapters if spec is not None else None
        if cap is None:
            return
        digest = namespace.tenant_digest(owner)
        own = {i.name for i in await asyncio.wrap_future(engine.list_adapters())
               if namespace.split(i.name)[0] == digest and engine.adapter_is_current(i.name)}
        if len(own) >= cap:
            self._refuse(owner, "max_adapters")
            raise FailedPreconditionError(
                f"this tenant has {len(own)} adapters registered, its limit (max_adapters {cap}): unload one "
                "of them first")

    async def unload(self, engine: EngineClient, tenant: Tenant, name: str) -> str:
        """Unloads what `name` means for `tenant` (its own, or for admins any engine name); the engine
        name. A shared adapter is the operator's (PERMISSION_DENIED for a tenant); a name the tenant
        cannot see is NOT_FOUND, in the words of one that does not exist."""
        engine_name = namespace.resolve(tenant, name, engine.adapter_is_current)
        assert engine_name is not None
        if not engine.adapter_is_current(engine_name):
            raise NotFoundError(f"unknown adapter {name!r}")
        if namespace.split(engine_name)[0] is None and not tenant.admin and namespace.owner_of(tenant) is not None:
            raise PermissionDeniedError(f"adapter {name!r} is shared: only an operator may unload it")
        try:
            await asyncio.wrap_future(engine.unload_adapter(engine_name))
        except NotFoundError:
            raise NotFoundError(f"unknown adapter {name!r}") from None
        if self.store is not None:
            self.store.remove(engine_name)
        log.info("adapter %s of %s unloaded (%s)", name, shown(tenant.name), engine_name)
        return engine_name

    async def restore(self, engine: EngineClient) -> None:
        """Registers the stored adapters again with their owners (their weights load on first use). One
        that no longer passes the allow-list is dropped; one that fails to register is logged and kept
        (a source down at start-up must not lose a tenant's binding)."""
        if self.store is None:
            return
        entries = self.store.entries()

        async def one(entry: Registration) -> None:
            try:
                self.policy.check(entry.uri)
                await asyncio.wrap_future(engine.load_adapter(entry.engine_name, entry.uri, sha256=entry.sha256,
                                                              pinned=entry.pinned, owner=entry.owner))
                log.info("adapter %s registered again from %s", entry.engine_name, shown(entry.uri))
            except PermissionDeniedError as e:
                log.warning("adapter %s is no longer allowed (%s): dropped", entry.engine_name, e)
                assert self.store is not None
                self.store.remove(entry.engine_name)
            except LoraplexError as e:
                log.warning("adapter %s could not be registered again: %s %s", entry.engine_name, e.code, e)

        await asyncio.gather(*(one(e) for e in entries))
        if entries:
            log.info("%d stored adapter registrations restored from %s", len(entries), self.store.path)

    # ---- metrics -----------------------------------------------------------------------------

    def _refuse(self, tenant: str, reason: str) -> None:
        log.info("tenant %s: adapter load refused (%s)", shown(tenant), reason)
        self.refusals[(tenant, reason)] = self.refusals.get((tenant, reason), 0) + 1

    def collector(self) -> RefusalCollector:
        return RefusalCollector(self)


class RefusalCollector:
    """loraplex_tenant_adapter_refusals_total{tenant, reason}: the top-K tenants by refusals under their
    names, the rest summed as `other` (bounded cardinality, as the other per-tenant series)."""

    def __init__(self, adapters: TenantAdapters) -> None:
        self.adapters = adapters

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        totals: dict[str, int] = {}
        counts = dict(self.adapters.refusals)
        for (tenant, _), count in counts.items():
            totals[tenant] = totals.get(tenant, 0) + count
        top = set(sorted(totals, key=lambda t: (-totals[t], t))[: self.adapters.top_k])
        rows: dict[tuple[str, str], int] = {}
        for (tenant, reason), count in counts.items():
            key = (tenant if tenant in top else OTHER, reason)
            rows[key] = rows.get(key, 0) + count
        family = CounterMetricFamily("loraplex_tenant_adapter_refusals",
                                     "Adapter loads refused for a tenant: source outside its sources, or "
                                     "max_adapters reached", labels=["tenant", "reason"])
        for (tenant, reason), count in sorted(rows.items()):
            family.add_metric([tenant, reason], count)
        yield family

