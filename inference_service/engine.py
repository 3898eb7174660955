"""The scheduler thread, and the in-process bridge to it.

`CoreThread` runs an `engine_core.EngineCore`: other threads talk to it only through a command
queue; it hands each step's outputs to one callback, once per step (never per token), and
publishes a stats snapshot after each step. `Engine` is the in-process front end over it (the
request streams of inference_service/streams.py); `engine_process.ProcessEngine` is the same front
end over a CoreThread in a process of its own, which is what `loraplex-inference` serves with.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from adapter_cache.errors import LoraplexError, NotFoundError
from inference_service.config import EngineConfig
from inference_service.engine_core import AdapterInfo, EngineCore, EngineStats, validate_request
from inference_service.limits import check_adapter_name, check_request_id
from inference_service.lora.source import AdapterSource
from inference_service.metrics_sink import MetricsSink
from inference_service.request import FinishReason, Request, RequestOutput, SamplingParams
from inference_service.streams import RequestStream, StreamTable

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
                    log.exception("engine call %s failed", getattr(fn, "__name__", fn))
                result.set_exception(exc)
            else:
                result.set_result(value)

        self._commands.put(run)
        return result

    def load_adapter(self, name: str, uri: str, sha256: str | None = None, pinned: bool = False,
                     preload: bool = False, on_demand: bool = False) -> concurrent.futures.Future[AdapterInfo]:
        result: concurrent.futures.Future[AdapterInfo] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            inner = core.load_adapter(name, uri, sha256, pinned, preload, on_demand)
            inner.add_done_callback(lambda f: self._resolve_adapter(f, result, name))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        result: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            core.unload_adapter(name).add_done_callback(lambda f: _copy_future(f, result))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def list_adapters(self, limit: int | None = None,
                      after: tuple[str, int] | None = None) -> concurrent.futures.Future[list[AdapterInfo]]:
        """A page of `EngineCore.list_adapters`, computed between steps when asked, never in one."""
        return self.call(EngineCore.list_adapters, limit, after)

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


def checked_request(model_info: Any, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                    request_id: str | None) -> str:
    """The checks both bridges make before a request leaves the caller's thread; its request id."""
    if request_id is not None:
        check_request_id(request_id, model_info.limits.max_request_id_length)
    if adapter:
        check_adapter_name(adapter)
    validate_request(model_info, prompt_token_ids, params)
    return request_id or f"req-{uuid.uuid4().hex[:12]}"


class Engine:
    """EngineCore on a thread of this process, with thread-safe intake, abort and admin calls."""

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

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        request_id = checked_request(self.model_info, prompt_token_ids, params, adapter, request_id)
        # A dict lookup from this thread is atomic; the scheduler thread checks again at intake.
        if adapter and not self.core.adapter_is_current(adapter):
            raise NotFoundError(f"unknown adapter {adapter!r}")
        stream = self.streams.open(request_id, prompt_token_ids, params)
        self._thread.add_request(Request(request_id, prompt_token_ids, params), adapter)
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._thread.abort(request_id, reason)

    def load_adapter(self, name: str, uri: str, sha256: str | None = None, pinned: bool = False,
                     preload: bool = False, on_demand: bool = False) -> concurrent.futures.Future[AdapterInfo]:
        """`on_demand`: the adapter resolver's registration (see LoRAManager.load_adapter)."""
        check_adapter_name(name)
        return self._thread.load_adapter(name, uri, sha256, pinned, preload, on_demand)

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        check_adapter_name(name)
        return self._thread.unload_adapter(name)

    def list_adapters(self, limit: int | None = None,
                      after: tuple[str, int] | None = None) -> concurrent.futures.Future[list[AdapterInfo]]:
        return self._thread.list_adapters(limit, after)

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """`fn(core, *args)` on the scheduler thread between steps (the watchdog's heartbeat)."""
        return self._thread.call(fn, *args)

    def adapter_is_current(self, name: str) -> bool:
        """Whether new requests may use `name` now (atomic from any thread; intake checks again)."""
        return self.core.adapter_is_current(name)

    @property
    def alive(self) -> bool:
        return self._thread.alive

    def stats(self) -> EngineStats:
        return self._thread.stats()
