"""The scheduler thread, and the in-process bridge to it.

`CoreThread` runs an `engine.core.EngineCore`: other threads talk to it only through a command
queue; it hands each step's outputs to one callback, once per step (never per token), and
publishes a stats snapshot after each step. What reaches it is typed (engine/client.py): a request
as an `EngineRequest`, which it turns into the core's `Request`, and an admin call as a
`CoreCall`, which it runs from one table (`CORE_CALLS`) for both engines.

`Engine` is the in-process front end over it (the request streams of engine/streams.py);
`engine.process.ProcessEngine` is the same front end over a CoreThread in a process of its own,
which is what `loraplex-inference` serves with. Both implement engine.client.EngineClient, the one
interface the front ends use, and share its code (engine.client.EngineClientBase).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from adapter_cache.errors import LoraplexError, NotFoundError
from inference_service.engine.client import (
    CoreCall,
    EngineClientBase,
    EngineRequest,
    Heartbeat,
    InjectFault,
    ListAdapters,
    LoadAdapter,
    ReadResidency,
    RunFunction,
    UnloadAdapter,
)
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, RequestOutput
from inference_service.engine.streams import StreamTable
from inference_service.engine.types import AdapterInfo, EngineStats
from inference_service.lora.source import AdapterSource
from inference_service.metrics_sink import MetricsSink

log = logging.getLogger(__name__)

Command = Callable[[EngineCore], None]
OutputsCallback = Callable[[list[RequestOutput]], None]


# ---- each CoreCall and what runs it on the scheduler thread: the one dispatch of both engines ----

def _load_adapter(core: EngineCore, call: LoadAdapter) -> concurrent.futures.Future[AdapterInfo]:
    """Registers the adapter now; the future resolves once it is loaded, with what it became."""
    info: concurrent.futures.Future[AdapterInfo] = concurrent.futures.Future()

    def loaded(version: concurrent.futures.Future) -> None:
        if version.exception() is not None:
            info.set_exception(version.exception())
            return
        found = core.adapter_info(version.result().uid)
        if found is None:
            info.set_exception(NotFoundError(f"adapter {call.name} was unloaded while loading"))
        else:
            info.set_result(found)

    core.load_adapter(call.name, call.uri, call.sha256, call.pinned, call.preload, call.on_demand,
                      call.owner).add_done_callback(loaded)
    return info


# A call's runner returns its value, or a future when the call completes later (the adapter loads):
# CoreThread.run_call then settles the caller's future from it.
CORE_CALLS: dict[type, Callable[[EngineCore, Any], Any]] = {
    LoadAdapter: _load_adapter,
    UnloadAdapter: lambda core, call: core.unload_adapter(call.name),
    ListAdapters: lambda core, call: core.list_adapters(call.limit, call.after),
    Heartbeat: lambda core, call: core.heartbeat(),
    ReadResidency: lambda core, call: core.adapter_residency(),
    InjectFault: lambda core, call: core.inject_fault(call.fault),
    RunFunction: lambda core, call: call.fn(core, *call.args),
}


def core_request(message: EngineRequest) -> Request:
    """The core's Request for a request message (the one place either engine makes one)."""
    request = Request(message.request_id, message.prompt_token_ids, message.params)
    request.timings.arrival = message.arrival  # TTFT counts from the caller's intake
    request.cache_salt, request.group, request.tenant = message.cache_salt, message.group, message.tenant
    request.priority = message.priority
    return request


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

    def add_request(self, message: EngineRequest) -> None:
        request = core_request(message)
        self._commands.put(lambda core: self._intake(core, request, message.adapter))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._commands.put(lambda core: core.abort(request_id, reason))

    def run_call(self, call: CoreCall) -> concurrent.futures.Future[Any]:
        """A typed call (engine.client.CoreCall) on the scheduler thread between steps, run by its
        entry in CORE_CALLS; its result (or error) in the future."""
        run = CORE_CALLS.get(type(call))
        if run is None:
            raise TypeError(f"not a call the core runs: {call!r}")
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def command(core: EngineCore) -> None:
            try:
                value = run(core, call)
            except Exception as exc:  # noqa: BLE001 - the caller gets it (SystemExit still ends the loop)
                if not isinstance(exc, LoraplexError):
                    log.exception("engine call %s failed", type(call).__name__)
                result.set_exception(exc)
                return
            if isinstance(value, concurrent.futures.Future):  # started: it completes off this thread
                self._stats = core.stats()
                value.add_done_callback(lambda done: self._settle(done, result))
            else:
                result.set_result(value)

        self._commands.put(command)
        return result

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

    def _settle(self, done: concurrent.futures.Future, result: concurrent.futures.Future) -> None:
        """A call that completed later: the stats first (an adapter that loaded is counted), then its result."""
        self._stats = self.core.stats()
        if done.exception() is not None:
            result.set_exception(done.exception())
        else:
            result.set_result(done.result())


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

    def _submit(self, request: EngineRequest) -> None:
        self._thread.add_request(request)

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
