"""The scheduler thread, and the in-process bridge to it.

`CoreThread` runs an `engine.core.EngineCore`: other threads talk to it only through a command
queue; it hands each step's outputs to one callback, once per step (never per token), and
publishes a stats snapshot after each step. `Engine` is the in-process front end over it (the
request streams of inference_service/engine/streams.py); `engine.process.ProcessEngine` is the same front
end over a CoreThread in a process of its own, which is what `loraplex-inference` serves with. Both
implement engine.client.EngineClient, the one interface the front ends use, and share its code
(engine.client.EngineClientBase).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from adapter_cache.errors import LoraplexError, NotFoundError
from inference_service.engine.client import (
    CoreCall,
    EngineClientBase,
    LoadAdapter,
    UnloadAdapter,
    run_call,
)
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import (
    CacheSalt,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    TenantTag,
)
from inference_service.engine.streams import StreamTable
from inference_service.engine.types import AdapterInfo, EngineStats
from inference_service.lora.source import AdapterSource
from inference_service.metrics_sink import MetricsSink

log = logging.getLogger(__name__)

T = TypeVar("T")
Command = Callable[[EngineCore], None]
OutputsCallback = Callable[[list[RequestOutput]], None]


class CoreThread:
    """The scheduler loop over one EngineCore; every method but `run` is safe from any thread."""

    def __init__(self, core: EngineCore, on_outputs: OutputsCallback,
                 on_turn_end: Callable[[EngineStats], None] | None = None) -> None:
        self.core = core
        self._on_outputs = on_outputs
        # Once per loop turn, after the step's hand-off, with the turn's stats snapshot.
        self._on_turn_end = on_turn_end or (lambda stats: None)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = core.stats()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(lambda core: None)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    # ---- commands (any thread) ----

    def add_request(self, request: Request, adapter: str | None) -> None:
        self._commands.put(lambda core: self._intake(core, request, adapter))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._commands.put(lambda core: core.abort(request_id, reason))

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """`fn(core, *args)` on the scheduler thread between steps; its result (or error) in the future."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            try:
                value = fn(core, *args)
            except Exception as exc:  # noqa: BLE001 - the caller gets it (SystemExit still ends the loop)
                if not isinstance(exc, LoraplexError):
                    what = type(args[0]).__name__ if fn is run_call else getattr(fn, "__name__", fn)
                    log.exception("engine call %s failed", what)
                result.set_exception(exc)
            else:
                result.set_result(value)

        self._commands.put(run)
        return result

    def load_adapter(self, name: str, uri: str, sha256: str | None = None, pinned: bool = False,
                     preload: bool = False, on_demand: bool = False,
                     owner: str | None = None) -> concurrent.futures.Future[AdapterInfo]:
        result: concurrent.futures.Future[AdapterInfo] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            inner = core.load_adapter(name, uri, sha256, pinned, preload, on_demand, owner)
            inner.add_done_callback(lambda f: self._resolve_adapter(f, result, name))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        result: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            core.unload_adapter(name).add_done_callback(lambda f: _copy_future(f, result))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def run_call(self, call: CoreCall) -> concurrent.futures.Future[Any]:
        """A typed call (engine.client.CoreCall) on the scheduler thread, each on a named method
        of EngineCore; its result (or error) in the future."""
        if isinstance(call, LoadAdapter):
            return self.load_adapter(call.name, call.uri, call.sha256, call.pinned, call.preload, call.on_demand,
                                     call.owner)
        if isinstance(call, UnloadAdapter):
            return self.unload_adapter(call.name)
        return self.call(run_call, call)

    # ---- the loop (the scheduler thread) ----

    def run(self) -> None:
        core = self.core
        while not self._stop.is_set():
            idle = not core.has_work()
            self._run_commands(block=idle and not core.has_pending_work())
            if self._stop.is_set():
                break
            try:
                outputs = core.step()
            except Exception:  # noqa: BLE001 - keep serving; fail the requests of this step
                log.exception("scheduler step failed")
                outputs = core.fail_running(LoraplexError("internal error in the scheduler step"))
            self._stats = core.stats()  # O(active): no per-step work for idle registered adapters
            if outputs:
                self._on_outputs(outputs)
            self._on_turn_end(self._stats)
            if not outputs and not core.step_in_flight and (core.has_work() or core.has_pending_work()):
                time.sleep(0.0005)  # waiting on loads only: leave the cores to the loaders
            plan_at = core.plan_not_before()
            if plan_at is not None:  # a step is running: take arrivals in until the next plan is due
                self._run_commands_until(plan_at)

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_commands_until(self, deadline: float) -> None:
        """Run commands as they arrive (an abort at once, as always) until `deadline` (monotonic)."""
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            try:
                command = self._commands.get(timeout=left)
            except queue.Empty:
                return
            self._run_command(command)

    def _run_command(self, command: Command) -> None:
        try:
            command(self.core)
        except Exception:  # noqa: BLE001 - a bad command must not stop the scheduler
            log.exception("engine command failed")

    def _intake(self, core: EngineCore, request: Request, adapter: str | None) -> None:
        try:
            core.add_request(request, adapter)
        except LoraplexError as exc:
            request.finish_reason, request.error = FinishReason.ERROR, exc
            self._on_outputs([RequestOutput(request.request_id, [], finished=True, finish_reason=FinishReason.ERROR,
                                            prompt_tokens=request.num_prompt_tokens, error=exc)])

    def _guarded(self, core: EngineCore, run: Command, result: concurrent.futures.Future) -> None:
        try:
            run(core)
        except LoraplexError as exc:
            result.set_exception(exc)
        self._stats = core.stats()

    def _resolve_adapter(self, inner: concurrent.futures.Future, result: concurrent.futures.Future[AdapterInfo],
                         name: str) -> None:
        if inner.exception() is not None:
            result.set_exception(inner.exception())
            return
        self._stats = self.core.stats()
        info = self.core.adapter_info(inner.result().uid)
        if info is None:
            result.set_exception(NotFoundError(f"adapter {name} was unloaded while loading"))
            return
        result.set_result(info)


def _copy_future(inner: concurrent.futures.Future, result: concurrent.futures.Future) -> None:
    if inner.exception() is not None:
        result.set_exception(inner.exception())
    else:
        result.set_result(inner.result())


class Engine(EngineClientBase):
    """EngineCore on a thread of this process, with thread-safe intake, abort and admin calls
    (the EngineClient interface: engine/client.py)."""

    def __init__(
        self, config: EngineConfig, source: AdapterSource | None = None, metrics: MetricsSink | None = None
    ) -> None:
        self.core = EngineCore(config, source, metrics, detokenize=False)
        self.config = config
        self.tokenizer = self.core.tokenizer
        self.model_info = self.core.model_info
        self.streams = StreamTable(self.tokenizer, config.max_queue + config.max_num_seqs, config.stream_interval)
        self._thread = CoreThread(self.core, self.streams.deliver)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._thread.stop()
        self.core.shutdown()

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                adapter: str | None, cache_salt: CacheSalt | None, group: str | None = None,
                tenant: TenantTag | None = None, priority: int = 0) -> None:
        request = Request(request_id, prompt_token_ids, params)
        request.cache_salt, request.group, request.tenant, request.priority = cache_salt, group, tenant, priority
        self._thread.add_request(request, adapter)

    def _run(self, call: CoreCall) -> concurrent.futures.Future[Any]:
        return self._thread.run_call(call)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._thread.abort(request_id, reason)

    def adapter_is_current(self, name: str) -> bool:
        """Whether new requests may use `name` now (a dict lookup, atomic from any thread)."""
        return self.core.adapter_is_current(name)

    @property
    def alive(self) -> bool:
        return self._thread.alive

    def stats(self) -> EngineStats:
        return self._thread.stats()
