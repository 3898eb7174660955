"""The one interface the front ends hold an engine by, and the code both engines share.

`EngineClient` is what the gRPC servicer, the HTTP app, health, preload, residency and the adapter
resolver may use of an engine: requests in, streams out, aborts, admin calls, a stats snapshot and
named calls to the core (the watchdog's heartbeat, the residency scrape, test faults). Two engines
implement it: `engine.in_process.Engine` (the core on a thread of this process) and
`engine.process.ProcessEngine` (the core in a process of its own). Both derive from
`EngineClientBase`, which holds what they share: the checks made before a request leaves the
caller, the stream it opens, the one message a request travels as (`EngineRequest`) and the admin
calls as typed `CoreCall`s. One engine hands these to its scheduler thread, the other sends them
down its pipe as they are; on the scheduler thread `CoreThread` (engine/in_process.py) turns the
message into the core's `Request` and runs each call from one table.

This module is the interface: it names no implementation (no core, scheduler, model or pool;
tests/test_layering.py holds it to that), so a front end that imports it imports no engine.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from adapter_cache.errors import FailedPreconditionError, NotFoundError, UnavailableError
from inference_service.engine.config import EngineConfig
from inference_service.engine.request import (
    CacheSalt,
    FinishReason,
    SamplingParams,
    TenantTag,
    sample_request_id,
    sample_seed,
)
from inference_service.engine.streams import RequestStream, StreamTable
from inference_service.engine.types import (
    TEST_FAULT_ENV,
    TEST_STEP_DELAY_ENV,
    AdapterInfo,
    EngineStats,
    ModelInfo,
    Residency,
    TestFault,
    test_faults_enabled,
    validate_request,
)
from inference_service.limits import adapter_name, check_n, check_priority, check_request_id
from inference_service.tokenizer import Tokenizer

T = TypeVar("T")


# ---- what reaches the scheduler thread (typed: it crosses the pipe as it is) --------------------------------

@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One checked request on its way to the scheduler thread, built once by EngineClientBase:
    queued as it is by the in-process engine, sent as it is down the process engine's pipe."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    cache_salt: CacheSalt | None = None  # who may share its prefix-cached KV (frontend/cache_salt.py)
    group: str | None = None  # the id a request's n samples share (Request.group)
    tenant: TenantTag | None = None  # whose request it is (frontend/tenants.py)
    priority: int = 0  # lower first (Scheduler.add)
    arrival: float = field(default_factory=time.monotonic)  # the caller's intake (monotonic): TTFT counts from it


@dataclass(frozen=True)
class LoadAdapter:
    name: str
    uri: str
    sha256: str | None = None
    pinned: bool = False
    preload: bool = False
    on_demand: bool = False  # the adapter resolver's registration (see LoRAManager.load_adapter)
    owner: str | None = None  # the tenant it belongs to (its share of the adapter pool); None: shared


@dataclass(frozen=True)
class UnloadAdapter:
    name: str


@dataclass(frozen=True)
class ListAdapters:
    limit: int | None = None
    after: tuple[str, int] | None = None


@dataclass(frozen=True)
class Heartbeat:
    """The watchdog's no-op (EngineCore.heartbeat)."""


@dataclass(frozen=True)
class ReadResidency:
    """Where each adapter's weights are (EngineCore.adapter_residency)."""


@dataclass(frozen=True)
class InjectFault:
    """A test-only fault (EngineCore.inject_fault); refused unless the test flag is set."""

    fault: TestFault


@dataclass(frozen=True)
class RunFunction:
    """`fn(core, *args)` on the scheduler thread: for tests and embedders (`call`), never the front
    ends. Across the pipe `fn` and `args` must pickle (a module-level function)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


CoreCall = LoadAdapter | UnloadAdapter | ListAdapters | Heartbeat | ReadResidency | InjectFault | RunFunction


# ---- the interface ----------------------------------------------------------------------------------------

@runtime_checkable
class EngineClient(Protocol):
    """What a front end may use of an engine (both engines implement it; tests may pass a fake)."""

    config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
                    request_id: str | None = None, cache_salt: CacheSalt | None = None,
                    group: str | None = None, tenant: TenantTag | None = None,
                    priority: int = 0) -> RequestStream:
        """`cache_salt`: who may share this request's prefix-cached KV (frontend/cache_salt.py: from
        the operator's configuration and the transport's trusted identity, never from the request).
        `group`: the id a request's n samples share (see `add_samples`). `tenant`: whose request it
        is (frontend/tenants.py, from the trusted side). `priority`: the waiting queue's order, lower
        first (vLLM's semantics; the front end checks what the tenant may ask for)."""
        ...

    def add_samples(self, prompt_token_ids: list[int], params: SamplingParams, n: int, adapter: str | None = None,
                    request_id: str | None = None, cache_salt: CacheSalt | None = None,
                    tenant: TenantTag | None = None, priority: int = 0) -> list[RequestStream]:
        """A request's `n` samples (OpenAI's `n`): one engine request each, stream i for sample i,
        sharing the prompt's prefill (engine.scheduler) with seeds of their own (request.sample_seed).
        All n are admitted or none; the caller aborts each stream's request id it has not seen end."""
        ...

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None: ...

    def load_adapter(self, name: str, uri: str, sha256: str | None = None, pinned: bool = False,
                     preload: bool = False, on_demand: bool = False,
                     owner: str | None = None) -> concurrent.futures.Future[AdapterInfo]:
        """`owner`: the tenant the adapter belongs to, whose share of the adapter pool it takes
        (None: shared, an operator's)."""
        ...

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]: ...

    def list_adapters(self, limit: int | None = None,
                      after: tuple[str, int] | None = None) -> concurrent.futures.Future[list[AdapterInfo]]: ...

    def adapter_is_current(self, name: str) -> bool: ...

    def heartbeat(self) -> concurrent.futures.Future[None]: ...

    def adapter_residency(self) -> concurrent.futures.Future[Residency]: ...

    def install_fault(self, fault: TestFault) -> concurrent.futures.Future[None]: ...

    @property
    def alive(self) -> bool: ...

    def stats(self) -> EngineStats: ...


def checked_request(model_info: ModelInfo, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None, request_id: str | None) -> str:
    """The checks both engines make before a request leaves the caller's thread; its request id."""
    if request_id is not None:
        check_request_id(request_id, model_info.limits.max_request_id_length)
    if adapter:
        adapter_name(adapter)
    validate_request(model_info, prompt_token_ids, params)
    return request_id or f"req-{uuid.uuid4().hex[:12]}"


class EngineClientBase(abc.ABC):
    """What `Engine` and `ProcessEngine` share; each supplies how a request and a `CoreCall` reach
    its scheduler thread, and what it knows of the core from here (names, liveness, stats)."""

    config: EngineConfig
    model_info: ModelInfo
    tokenizer: Tokenizer
    streams: StreamTable

    # ---- supplied by each engine ----

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    @abc.abstractmethod
    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None: ...

    @abc.abstractmethod
    def adapter_is_current(self, name: str) -> bool:
        """Whether new requests may use `name` now (atomic from any thread; intake checks again)."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool: ...

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def _submit(self, request: EngineRequest) -> None:
        """Hands a checked request to the scheduler thread; UnavailableError when there is none."""

    @abc.abstractmethod
    def _run(self, call: CoreCall) -> concurrent.futures.Future[Any]:
        """`call` on the scheduler thread between steps; its result (or error) in the future."""

    # ---- shared ----

    def _checked(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                 request_id: str | None, priority: int) -> str:
        """The checks a request passes before it leaves the caller's thread; its request id."""
        request_id = checked_request(self.model_info, prompt_token_ids, params, adapter, request_id)
        check_priority(priority)
        if adapter and not self.adapter_is_current(adapter):  # the core checks again at intake
            raise NotFoundError(f"unknown adapter {adapter!r}")
        return request_id

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
                    request_id: str | None = None, cache_salt: CacheSalt | None = None,
                    group: str | None = None, tenant: TenantTag | None = None,
                    priority: int = 0) -> RequestStream:
        request_id = self._checked(prompt_token_ids, params, adapter, request_id, priority)
        stream = self.streams.open(request_id, prompt_token_ids, params)
        try:
            self._submit(EngineRequest(request_id, list(prompt_token_ids), params, adapter, cache_salt, group,
                                       tenant, priority))
        except UnavailableError:
            self.streams.close(request_id)
            raise
        return stream

    def add_samples(self, prompt_token_ids: list[int], params: SamplingParams, n: int, adapter: str | None = None,
                    request_id: str | None = None, cache_salt: CacheSalt | None = None,
                    tenant: TenantTag | None = None, priority: int = 0) -> list[RequestStream]:
        check_n(n, self.model_info.limits.max_n)
        if n == 1:
            return [self.add_request(prompt_token_ids, params, adapter, request_id, cache_salt, tenant=tenant,
                                     priority=priority)]
        request_id = self._checked(prompt_token_ids, params, adapter, request_id, priority)
        ids = [sample_request_id(request_id, i, n) for i in range(n)]
        samples = [dataclasses.replace(params, seed=sample_seed(params.seed, i)) for i in range(n)]
        streams: list[RequestStream] = []
        try:  # every stream first (the queue's bound counts each sample), then every intake
            for sample_id, sample_params in zip(ids, samples, strict=True):
                streams.append(self.streams.open(sample_id, prompt_token_ids, sample_params))
        except Exception:
            for stream in streams:
                self.streams.close(stream.request_id)
            raise
        group = f"{request_id}#{uuid.uuid4().hex[:8]}"  # unique even when a client reuses its request id
        request = EngineRequest(request_id, list(prompt_token_ids), params, adapter, cache_salt, group, tenant,
                                priority)
        sent = 0
        try:
            for sample_id, sample_params in zip(ids, samples, strict=True):
                self._submit(dataclasses.replace(request, request_id=sample_id, params=sample_params))
                sent += 1
        except UnavailableError:
            for sample_id in ids[:sent]:
                self.abort(sample_id)
            for sample_id in ids:
                self.streams.close(sample_id)
            raise
        return streams

    def load_adapter(self, name: str, uri: str, sha256: str | None = None, pinned: bool = False,
                     preload: bool = False, on_demand: bool = False,
                     owner: str | None = None) -> concurrent.futures.Future[AdapterInfo]:
        """`on_demand`: the adapter resolver's registration; `owner`: its tenant (see
        LoRAManager.load_adapter)."""
        return self._run(LoadAdapter(adapter_name(name), uri, sha256, pinned, preload, on_demand, owner))

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        return self._run(UnloadAdapter(adapter_name(name)))

    def list_adapters(self, limit: int | None = None,
                      after: tuple[str, int] | None = None) -> concurrent.futures.Future[list[AdapterInfo]]:
        """A page of adapters by (name, version), computed between steps, never in one."""
        return self._run(ListAdapters(limit, after))

    def heartbeat(self) -> concurrent.futures.Future[None]:
        """Done once the scheduler thread has run it: the watchdog's proof of progress."""
        return self._run(Heartbeat())

    def adapter_residency(self) -> concurrent.futures.Future[Residency]:
        return self._run(ReadResidency())

    def install_fault(self, fault: TestFault) -> concurrent.futures.Future[None]:
        """The test seam: arms `fault` on the scheduler thread. Only the test flag enables it (the
        LORAPLEX_TEST_FAULT_* variables, checked here and again by the core)."""
        if not test_faults_enabled():
            raise FailedPreconditionError(f"test faults are off (set {TEST_FAULT_ENV} or {TEST_STEP_DELAY_ENV})")
        return self._run(InjectFault(fault))

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """`fn(core, *args)` on the scheduler thread between steps: for tests and embedders (not part
        of EngineClient). For ProcessEngine `fn` and `args` must pickle (a module-level function)."""
        return self._run(RunFunction(fn, args))


__all__ = [
    "CoreCall", "EngineClient", "EngineClientBase", "EngineRequest", "Heartbeat", "InjectFault", "ListAdapters",
    "LoadAdapter", "ReadResidency", "Residency", "RunFunction", "TestFault", "UnloadAdapter", "checked_request",
]
