"""Load an adapter on first use: a request naming an unregistered adapter has it registered from a
URI template (`--adapter-resolver 's3://bucket/adapters/{name}'`), as vLLM's LoRA resolver plugins
and LoRAX do, so any replica behind a gateway can serve any adapter and the gateway only decides
where it is cheapest. Off by default; the expanded URI goes through the same allow-list as
LoadAdapter (PERMISSION_DENIED outside it). LoadAdapter with `preload` stays the explicit prefetch.

Concurrent first requests for one name share one load (single-flight per name, on the event loop
both front ends run on); a failed load leaves nothing registered, so the next request tries again.
Its registrations are a cache: at --max-registered-adapters the least recently used idle one makes
room for a new name (LoRAManager; docs/adapters.md), so no client can fill the registry for good.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from adapter_cache.uri_policy import SCHEMES, UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.frontend.intake import adapter_name

log = logging.getLogger(__name__)

PLACEHOLDER = "{name}"


def check_template(template: str) -> str:
    """The template, or ValueError: one `{name}`, a known scheme, no other braces."""
    scheme = template.split("://", 1)[0] if "://" in template else ""
    if template.count(PLACEHOLDER) != 1 or template.replace(PLACEHOLDER, "").count("{") \
            or template.replace(PLACEHOLDER, "").count("}"):
        raise ValueError(f"--adapter-resolver {template!r} must hold {PLACEHOLDER} exactly once (and no other braces)")
    if scheme not in SCHEMES:
        raise ValueError(f"--adapter-resolver {template!r} must be a URI with a scheme in {', '.join(SCHEMES)}")
    return template


class AdapterResolver:
    def __init__(self, engine: EngineClient, template: str, policy: UriPolicy) -> None:
        self.engine = engine
        self.template = check_template(template)
        self.policy = policy
        self._inflight: dict[str, asyncio.Future[None]] = {}

    def registered(self, name: str) -> bool:
        return self.engine.adapter_is_current(name)

    async def ensure(self, name: str) -> None:
        """Returns once `name` is registered (loaded here if needed); raises the load's LoraplexError
        (PERMISSION_DENIED outside the allow-list, NOT_FOUND when nothing is at the URI...)."""
        if self.registered(name):
            return
        pending = self._inflight.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._load(name))
            self._inflight[name] = pending
            pending.add_done_callback(lambda _: self._inflight.pop(name, None))
        await asyncio.shield(pending)  # one caller's cancellation must not cancel the others' load

    async def _load(self, name: str) -> None:
        adapter_name(name)  # the front ends' intake checked it; this expands it into a URI
        uri = self.policy.check(self.template.replace(PLACEHOLDER, name))
        log.info("resolving adapter %s from %s", name, uri)
        await asyncio.wrap_future(self.engine.load_adapter(name, uri, preload=True, on_demand=True))


_resolvers: weakref.WeakKeyDictionary[EngineClient, AdapterResolver] = weakref.WeakKeyDictionary()


async def resolve_adapter(engine: EngineClient, template: str, policy: UriPolicy, name: str | None) -> None:
    """For the front ends, before `engine.add_request`: a no-op without a template or adapter.
    One resolver per engine, so gRPC and HTTP requests share their loads."""
    if not template or name is None:
        return
    resolver = _resolvers.get(engine)
    if resolver is None:
        resolver = _resolvers[engine] = AdapterResolver(engine, template, policy)
    await resolver.ensure(name)


__all__ = ["AdapterResolver", "check_template", "resolve_adapter"]
