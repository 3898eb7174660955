"""The bridge between the scheduler thread and its callers.

`Engine` runs an `engine_core.EngineCore` on its own thread: other threads (the asyncio gRPC
loop, tests) talk to it only through a command queue, and read results from per-request output
streams and from snapshots it publishes after each step. It uses only EngineCore's methods, so a
bridge to a core in another process could take its place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from adapter_cache.errors import InvalidArgumentError, LoraplexError, NotFoundError, ResourceExhaustedError
from inference_service.config import EngineConfig
from inference_service.engine_core import AdapterInfo, EngineCore, EngineStats
from inference_service.limits import check_adapter_name, check_request_id
from inference_service.lora.source import AdapterSource
from inference_service.metrics_sink import MetricsSink
from inference_service.request import FinishReason, Request, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class RequestStream:
    """One request's outputs, fed by the scheduler thread; iterate it sync or async."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request_id = request_id
        self.loop = loop
        self._async_queue: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if loop else None
        self._sync_queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        """Called on the asyncio loop (async streams) or the scheduler thread (sync streams)."""
        if self._async_queue is not None:
            self._async_queue.put_nowait(output)
        else:
            self._sync_queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self._sync_queue.get()
            yield output
            if output.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async_queue is not None, "create the stream inside a running event loop to iterate async"
        queue = self._async_queue
        while True:
            output = await queue.get()
            # Deltas that piled up while the consumer was busy go out as one: under load the
            # consumer then spends less per token instead of falling further behind.
            while not output.finished and not queue.empty():
                output = output.followed_by(queue.get_nowait())
            yield output
            if output.finished:
                return


Command = Callable[[EngineCore], None]


class Engine:
    """EngineCore on its own thread, with thread-safe intake, abort and admin calls."""

    def __init__(
        self, config: EngineConfig, source: AdapterSource | None = None, metrics: MetricsSink | None = None
    ) -> None:
        self.core = EngineCore(config, source, metrics)
        self.config = config
        self.tokenizer = self.core.tokenizer
        self.model_info = self.core.model_info
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._stats = self.core.stats()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(lambda core: None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.core.shutdown()

    # ---- public API (any thread) ----

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        if request_id is not None:
            check_request_id(request_id, self.model_info.limits.max_request_id_length)
        if adapter:
            check_adapter_name(adapter)
        self.core.validate(prompt_token_ids, params)
        # A dict lookup from this thread is atomic; the scheduler thread checks again at intake.
        if adapter and not self.core.adapter_is_current(adapter):
            raise NotFoundError(f"unknown adapter {adapter!r}")
        with self._streams_lock:
            if len(self._streams) >= self.config.max_queue + self.config.max_num_seqs:
                raise ResourceExhaustedError(f"the request queue is full ({len(self._streams)} requests)")
            request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
            if request_id in self._streams:
                raise InvalidArgumentError(f"request id {request_id!r} is already in use")
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            stream = RequestStream(request_id, loop)
            self._streams[request_id] = stream
        request = Request(request_id, prompt_token_ids, params)
        self._commands.put(lambda core: self._intake(core, request, adapter))
        return stream

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self._commands.put(lambda core: core.abort(request_id, reason))

    def load_adapter(
        self, name: str, uri: str, sha256: str | None = None, pinned: bool = False, preload: bool = False
    ) -> concurrent.futures.Future[AdapterInfo]:
        check_adapter_name(name)
        result: concurrent.futures.Future[AdapterInfo] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            inner = core.load_adapter(name, uri, sha256, pinned, preload)
            inner.add_done_callback(lambda f: self._resolve_adapter(f, result, name))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        check_adapter_name(name)
        result: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            inner = core.unload_adapter(name)
            inner.add_done_callback(lambda f: self._copy_future(f, result))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def list_adapters(
        self, limit: int | None = None, after: tuple[str, int] | None = None
    ) -> concurrent.futures.Future[list[AdapterInfo]]:
        """A page of `EngineCore.list_adapters`, computed on the scheduler thread (which owns the
        registry) when asked, never as part of a step."""
        result: concurrent.futures.Future[list[AdapterInfo]] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            result.set_result(core.list_adapters(limit, after))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def call(self, fn: Command) -> concurrent.futures.Future[None]:
        """Runs `fn` on the scheduler thread between steps; the health watchdog's heartbeat."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            fn(core)
            done.set_result(None)

        self._commands.put(run)
        return done

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    # ---- scheduler thread ----

    def _loop(self) -> None:
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
            self._publish(core)
            self._deliver(outputs)
            if not outputs and (core.has_work() or core.has_pending_work()):
                time.sleep(0.0005)  # waiting on loads only: leave the cores to the loaders

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                command(self.core)
            except Exception:  # noqa: BLE001 - a bad command must not stop the scheduler
                log.exception("engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _intake(self, core: EngineCore, request: Request, adapter: str | None) -> None:
        try:
            core.add_request(request, adapter)
        except LoraplexError as exc:
            request.finish_reason, request.error = FinishReason.ERROR, exc
            self._deliver([RequestOutput(request.request_id, [], finished=True, finish_reason=FinishReason.ERROR,
                                         prompt_tokens=request.num_prompt_tokens, error=exc)])

    def _publish(self, core: EngineCore) -> None:
        self._stats = core.stats()  # O(active): no per-step work for idle registered adapters

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                if stream.loop is None:
                    stream.put(output)
                else:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
        # One hand-off per loop per step, not per token: keeps the asyncio side cheap.
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that loop is closed: its clients are gone

    def _guarded(self, core: EngineCore, run: Command, result: concurrent.futures.Future) -> None:
        try:
            run(core)
        except LoraplexError as exc:
            result.set_exception(exc)
        self._publish(core)

    def _resolve_adapter(
        self, inner: concurrent.futures.Future, result: concurrent.futures.Future[AdapterInfo], name: str
    ) -> None:
        if inner.exception() is not None:
            result.set_exception(inner.exception())
            return
        entry = inner.result()
        self._publish(self.core)
        info = self.core.adapter_info(entry.uid)
        if info is None:
            result.set_exception(NotFoundError(f"adapter {name} was unloaded while loading"))
            return
        result.set_result(info)

    @staticmethod
    def _copy_future(inner: concurrent.futures.Future, result: concurrent.futures.Future) -> None:
        if inner.exception() is not None:
            result.set_exception(inner.exception())
        else:
            result.set_result(inner.result())


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put(output)
