"""The front door: the one path a generation request takes into the engine, whichever front end
(gRPC `grpc_server`, HTTP `http/`) it came through.

A request passes these steps in this order; each refuses before the next costs anything:

1. `enter`: its tenant's in-flight cap, before the request is even parsed.
2. (the front end parses its API's request and maps it to an `EngineRequest`: intake.py, sizes
   before the work that grows with them, then the whole request checked once against the model.
   HTTP maps after steps 3 and 4, so that an unknown `model` costs no tokenizing.)
3. `adapter`: the adapter name the tenant uses becomes the engine's (its own, else the shared
   one); NOT_FOUND for one it may not see.
4. `check_priority`: at or above its tenant's floor.
5. `submit`: the tenant's quota ticket; the grammar compiled once, bounded; the adapter resolved
   (loaded on first use); the prefix-cache salt; the request's n samples into the engine. It
   returns the `Generation`, or releases the ticket and raises.
6. `Generation.close`, exactly once whatever ended the request (its last token, a cancel or a
   disconnect, a deadline, an error): every sample not seen ending is aborted in the engine (its KV
   blocks and adapter reference are released within one scheduler step) and the ticket released.

Errors are LoraplexError subclasses whose `code` each front end answers in its own terms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from adapter_cache.errors import InvalidArgumentError
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.engine.request import FinishReason, RequestOutput
from inference_service.engine.streams import RequestStream, merged
from inference_service.frontend.adapter_resolver import resolve_adapter
from inference_service.frontend.cache_salt import cache_salt
from inference_service.frontend.config import ServerConfig
from inference_service.frontend.grammar_check import shared_checker
from inference_service.frontend.intake import EngineRequest
from inference_service.frontend.tenants import Tenant, Ticket, tenant_identity


class GrammarRefused(InvalidArgumentError):
    """The request's structured-output constraint did not compile within its bounds (HTTP names the
    request field it came from)."""


@dataclass
class Generation:
    """One admitted request: its n samples' engine streams, and the bookkeeping that ends each
    sample exactly once."""

    engine: EngineClient
    request_id: str  # the client's name for it; sample i runs in the engine as streams[i].request_id
    adapter: str | None  # the engine's name of its adapter
    prompt_tokens: int
    streams: list[RequestStream]
    ticket: Ticket  # its hold on its tenant's quotas (frontend/tenants.py), released by close
    started: float = field(default_factory=time.monotonic)
    closed: bool = False
    finished: list[bool] = field(init=False)
    reasons: list[FinishReason | None] = field(init=False)
    generated: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.streams)
        self.finished, self.reasons, self.generated = [False] * n, [None] * n, [0] * n

    @property
    def tenant(self) -> str:
        """The name of the tenant it runs for (what its outcome's log line names)."""
        return self.ticket.tenant.name

    @property
    def n(self) -> int:
        return len(self.streams)

    @property
    def tokens(self) -> int:
        """Tokens generated so far, every sample together."""
        return sum(self.generated)

    @property
    def finish(self) -> str:
        """How its samples ended, for the log line ("-" while none has)."""
        return ",".join(sorted({r.value for r in self.reasons if r is not None})) or "-"

    def observe(self, index: int, out: RequestOutput) -> None:
        self.ticket.running()
        self.generated[index] = out.generated_tokens or self.generated[index] + len(out.new_token_ids)
        if out.finished:
            self.finished[index], self.reasons[index] = True, out.finish_reason

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sample index, output) as the samples produce them, each observed."""
        async with contextlib.aclosing(merged(self.streams)) as outputs:
            async for index, out in outputs:
                self.observe(index, out)
                yield index, out

    def close(self, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """Aborts every sample that has not ended (with `reason`) and releases the ticket, the first
        time only; whether any sample was aborted."""
        if self.closed:
            return False
        self.closed = True
        aborted = False
        for index, stream in enumerate(self.streams):
            if not self.finished[index]:
                self.engine.abort(stream.request_id, reason=reason)
                self.reasons[index] = reason
                aborted = True
        self.ticket.release(self.tokens)
        return aborted


class Admission:
    """The admission steps of one front end (`listener`: its name in the prefix-cache salt) over the
    state both front ends of a server share (tenancy, adapter namespaces, the grammar checker)."""

    def __init__(self, engine: EngineClient, config: ServerConfig, listener: str) -> None:
        self.engine = engine
        self.config = config
        self.listener = listener
        self.tenancy = config.tenancy
        self.adapters = config.adapters
        self.uri_policy = UriPolicy(config.adapter_source_allow)
        self.grammars = shared_checker(engine.tokenizer, engine.model_info.vocab_size, config.grammar_compile_cpu_s,
                                       config.grammar_compile_wall_s, config.grammar_check_processes)

    def enter(self, tenant: Tenant) -> None:
        """At its cap: refused before any parsing."""
        self.tenancy.check_in_flight(tenant)

    def adapter(self, tenant: Tenant, name: str | None) -> str | None:
        """The engine's name of the adapter the request names (`name`: checked by intake.optional_adapter;
        None: the base model)."""
        return self.adapters.resolve(self.engine, tenant, name)

    def check_priority(self, tenant: Tenant, priority: int) -> None:
        self.tenancy.check_priority(tenant, priority)

    async def submit(self, tenant: Tenant, request: EngineRequest, priority: int) -> Generation:
        """`request`: mapped and checked, its adapter the engine's name (`adapter`), its request id set."""
        assert request.request_id is not None
        # The quotas first: a tenant over them costs no grammar compile and no adapter load.
        ticket = self.tenancy.admit(tenant, request.n, len(request.prompt_token_ids), request.params.max_new_tokens)
        try:
            grammar = request.params.grammar
            if grammar is not None:  # compiled once, bounded, before anything is submitted
                try:
                    await self.grammars.check(grammar)
                except InvalidArgumentError as e:
                    raise GrammarRefused(str(e)) from None
            await resolve_adapter(self.engine, self.config.adapter_resolver, self.uri_policy, request.adapter)
            salt = cache_salt(self.config.cache_scope, self.config.prefix_cache_salt, self.listener,
                              tenant_identity(tenant))
            if request.n == 1:
                streams = [self.engine.add_request(request.prompt_token_ids, request.params, adapter=request.adapter,
                                                   request_id=request.request_id, cache_salt=salt,
                                                   tenant=tenant.tag, priority=priority)]
            else:  # n samples sharing the prompt's prefill, each its own engine request and seed
                streams = self.engine.add_samples(request.prompt_token_ids, request.params, request.n,
                                                  adapter=request.adapter, request_id=request.request_id,
                                                  cache_salt=salt, tenant=tenant.tag, priority=priority)
        except BaseException:
            ticket.release(0)
            raise
        return Generation(self.engine, request.request_id, request.adapter, len(request.prompt_token_ids), streams,
                          ticket)


def with_adapter(request: EngineRequest, engine_adapter: str | None) -> EngineRequest:
    """`request` naming its adapter as the engine knows it (after `Admission.adapter`)."""
    return dataclasses.replace(request, adapter=engine_adapter)


__all__ = ["Admission", "Generation", "GrammarRefused", "with_adapter"]
