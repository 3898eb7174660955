"""The engine: request intake, abort, and output fan-out around one scheduler thread.

`EngineCore` is the synchronous heart (add, abort, step) and owns the scheduler, the model
runner and the LoRA manager. `Engine` runs it on its own thread: other threads (the asyncio
gRPC loop, tests) talk to it only through a command queue, and read results from per-request
output streams and from snapshots it publishes after each step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from inference_service.config import EngineConfig
from inference_service.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    ResourceExhaustedError,
)
from inference_service.limits import RequestLimits, check_adapter_name, check_request_id, check_stop, shown
from inference_service.lora.source import AdapterSource
from inference_service.metrics_sink import MetricsSink, NullMetrics
from inference_service.model_runner import ModelRunner
from inference_service.models.loader import load_model
from inference_service.request import FinishReason, Request, RequestOutput, SamplingParams
from inference_service.sampling import NON_FINITE, SAMPLING_FAILED
from inference_service.scheduler import ScheduledBatch, Scheduler
from inference_service.tokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    vocab_size: int
    max_loras: int
    max_lora_rank: int
    max_new_tokens_limit: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_registered_adapters: int = 0


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    version: int
    uri: str
    state: str
    slot: int
    pinned: bool
    rank: int
    size_bytes: int
    active_requests: int


@dataclass(frozen=True)
class EngineStats:
    slots_total: int = 0
    slots_occupied: int = 0
    slots_referenced: int = 0
    slots_pinned: int = 0
    pending_load_events: int = 0
    requests_running: int = 0
    requests_waiting: dict[str, int] = field(default_factory=dict)
    kv_cache_usage: float = 0.0
    kv_blocks_used: int = 0
    adapter_references: int = 0
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    loads_total: int = 0
    evictions_total: int = 0
    updated_at: float = 0.0  # wall-clock time of this snapshot: vllm:lora_requests_info's value


class EngineCore:
    """Synchronous engine: call from one thread only."""

    def __init__(
        self, config: EngineConfig, source: AdapterSource | None = None, metrics: MetricsSink | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics or NullMetrics()
        model, self.tokenizer = load_model(config.model, config.torch_device(), config.torch_dtype(),
                                           config.tokenizer)
        self.runner = ModelRunner(config, model, self.tokenizer, source, self.metrics)
        self.lora = self.runner.lora
        self.scheduler = Scheduler(config, self.runner.kv, self.lora)
        mc = model.config
        max_context = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.model_info = ModelInfo(
            name=mc.name or config.model,
            max_context=max_context,
            vocab_size=mc.vocab_size,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            max_new_tokens_limit=config.max_new_tokens_limit,
            limits=config.limits,
            max_registered_adapters=config.max_registered_adapters,
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    # ---- intake ----

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Checks that need no scheduler state (safe from any thread)."""
        info = self.model_info
        if not prompt_token_ids:
            raise InvalidArgumentError("the prompt is empty")
        if len(prompt_token_ids) >= info.max_context:
            raise ResourceExhaustedError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit the context of {info.max_context} tokens")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= info.vocab_size:
            raise InvalidArgumentError(f"prompt token ids must be in [0, {info.vocab_size})")
        check_stop(params.stop, len(params.stop_token_ids), info.limits)
        if any(t >= info.vocab_size for t, _ in params.logit_bias):
            raise InvalidArgumentError(f"logit_bias token ids must be in [0, {info.vocab_size})")
        params.validate(info.max_new_tokens_limit)
        if any(t >= info.vocab_size for t in params.stop_token_ids):
            raise InvalidArgumentError(f"stop_token_ids must be in [0, {info.vocab_size})")
        total = len(prompt_token_ids) + params.max_new_tokens
        if len(prompt_token_ids) >= info.max_context or total > info.max_context:
            raise ResourceExhaustedError(
                f"prompt of {len(prompt_token_ids)} tokens + max_new_tokens {params.max_new_tokens} "
                f"does not fit the context of {info.max_context} tokens"
            )
        if self.runner.kv.blocks_needed(total) > self.runner.kv.num_blocks:
            raise ResourceExhaustedError(f"{total} tokens do not fit the KV cache ({self.runner.kv.num_blocks} blocks)")

    def add_request(self, request: Request, adapter: str | None) -> None:
        """Take a validated request in; resolves the adapter name and takes its reference."""
        if adapter:
            request.adapter_uid = self.lora.acquire(adapter, request.request_id)
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens)
        self.scheduler.add(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self.scheduler.abort(request_id, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        outputs: dict[str, RequestOutput] = {}
        if batch:
            results = self._run(batch)
            now = time.monotonic()
            for request, num_tokens in batch.items:
                if request.finished:
                    continue  # its forward pass failed alone (see _run)
                request.num_computed_tokens += num_tokens
                if request.timings.first_scheduled is None:
                    request.timings.first_scheduled = now
                if request.request_id in results:
                    token, logits = results[request.request_id]
                    if token == NON_FINITE:
                        self.scheduler.finish(request, FinishReason.ERROR, self._non_finite(request))
                        continue
                    if token == SAMPLING_FAILED:
                        self.scheduler.finish(request, FinishReason.ERROR,
                                              LoraplexError(f"internal error sampling request {request.request_id}"))
                        continue
                    try:
                        outputs[request.request_id] = self._append_token(request, token, logits, now)
                    except Exception:  # noqa: BLE001 - a bug in stop matching or detokenizing: this request only
                        log.exception("request %s failed after token %d", shown(request.request_id), token)
                        self.scheduler.finish(request, FinishReason.ERROR,
                                              LoraplexError(f"internal error in request {request.request_id}"))
        for request in self.scheduler.finished_this_step:
            outputs[request.request_id] = self._final_output(request, outputs.get(request.request_id))
        self.scheduler.finished_this_step.clear()
        return list(outputs.values())

    def _run(self, batch: ScheduledBatch) -> dict[str, tuple[int, object]]:
        """The batch's forward pass; if it raises, its requests run again one at a time, so only a
        request that fails alone is ended (with INTERNAL: that is a bug) and the others go on."""
        try:
            return self.runner.run(batch)
        except Exception:  # noqa: BLE001 - contained below
            if len(batch.items) == 1:
                request = batch.items[0][0]
                log.exception("the forward pass of request %s failed", shown(request.request_id))
                self.scheduler.finish(request, FinishReason.ERROR,
                                      LoraplexError(f"internal error in request {request.request_id}"))
                return {}
            log.exception("a forward pass of %d requests failed; running them one at a time", len(batch.items))
        results: dict[str, tuple[int, object]] = {}
        for item in batch.items:
            results.update(self._run(ScheduledBatch([item])))
        return results

    def _non_finite(self, request: Request) -> LoraplexError:
        log.warning("request %s: non-finite logits (adapter %s); ended alone", shown(request.request_id),
                    request.adapter_uid or "-")
        if request.adapter_uid is None:
            return LoraplexError("the base model produced non-finite logits for this request")
        return FailedPreconditionError(
            f"adapter {request.adapter_uid.split('@')[0]} made the model produce non-finite logits "
            "(its weights or scaling overflow this model's dtype)"
        )

    def _append_token(self, request: Request, token: int, logits: object, now: float) -> RequestOutput:
        timings = request.timings
        request.output_token_ids.append(token)
        if timings.first_token is None:
            timings.first_token = now
            self.metrics.first_token(now - timings.arrival)
        else:
            self.metrics.inter_token(now - (timings.last_token or now))
        timings.last_token = now
        p = request.params
        detok = self._detokenizers[request.request_id]
        reason = None
        if token in p.stop_token_ids:
            reason, request.stop_reason = FinishReason.STOP, token
        elif not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            reason = FinishReason.EOS
        elif len(request.output_token_ids) >= p.max_new_tokens:
            reason = FinishReason.LENGTH
        previous = detok.text
        detok.update(request.output_token_ids, final=reason is not None)
        text = detok.text
        if p.stop and reason in (None, FinishReason.LENGTH):
            longest = max(len(s) for s in p.stop)
            window_start = max(0, len(previous) - longest)
            matching = len(request.output_token_ids) >= p.min_tokens  # no stop string before min_tokens
            hits = [(i, s) for s in p.stop if matching and (i := text.find(s, window_start)) >= 0]
            if hits:
                first, request.stop_reason = min(hits)
                text, reason = text[:first], FinishReason.STOP
            elif reason is None:
                # Hold back a tail that may yet become a stop string: never stream part of one.
                text = text[: max(0, len(text) - longest + 1)]
        delta = text[request.emitted_text_len :]
        request.emitted_text_len += len(delta)
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            text=delta,
            prompt_tokens=request.num_prompt_tokens,
            generated_tokens=len(request.output_token_ids),
            timings=timings,
            logits=[logits] if p.return_logits else None,  # type: ignore[list-item]
            logprobs=[request.step_logprobs] if p.logprobs is not None else None,  # type: ignore[list-item]
            stop_reason=request.stop_reason,
        )
        if reason is not None:
            self.scheduler.finish(request, reason)
        return output

    def _final_output(self, request: Request, output: RequestOutput | None) -> RequestOutput:
        if output is None:
            output = RequestOutput(
                request_id=request.request_id,
                new_token_ids=[],
                prompt_tokens=request.num_prompt_tokens,
                generated_tokens=len(request.output_token_ids),
                timings=request.timings,
            )
        request.timings.finished = time.monotonic()
        output.finished, output.finish_reason, output.error = True, request.finish_reason, request.error
        self._detokenizers.pop(request.request_id, None)
        self.metrics.tokens(request.num_prompt_tokens, len(request.output_token_ids))
        reason = request.finish_reason.value if request.finish_reason else "error"
        self.metrics.request_finished(reason, request.adapter_uid.split("@")[0] if request.adapter_uid else None)
        log.debug(  # the server logs each outcome with its status code
            "request %s adapter=%s finished: %s, %d prompt + %d generated tokens%s",
            request.request_id, request.adapter_uid, reason, request.num_prompt_tokens,
            len(request.output_token_ids), f" ({request.error})" if request.error else "",
        )
        return output

    # ---- snapshots ----

    def stats(self) -> EngineStats:
        lora, pool = self.lora, self.lora.pool
        versions = lora.registry.versions
        occupied = [uid for uid in pool.slot_to_uid if uid is not None]
        waiting = {r.adapter_uid for r in self.scheduler.waiting if r.adapter_uid}
        running = {r.adapter_uid for r in self.scheduler.running if r.adapter_uid}
        return EngineStats(
            slots_total=pool.num_slots,
            slots_occupied=len(occupied),
            slots_referenced=sum(1 for uid in occupied if versions[uid].refs),
            slots_pinned=sum(1 for uid in occupied if versions[uid].pinned),
            pending_load_events=len(lora.loader.pending),
            requests_running=len(self.scheduler.running),
            requests_waiting=dict(Counter(r.wait_reason or "queued" for r in self.scheduler.waiting)),
            kv_cache_usage=self.runner.kv.usage,
            kv_blocks_used=self.runner.kv.num_used,
            adapter_references=lora.registry.total_refs(),
            max_lora=pool.num_slots,
            running_lora_adapters=tuple(sorted(u.split("@")[0] for u in running)),
            waiting_lora_adapters=tuple(sorted(u.split("@")[0] for u in waiting - running)),
            loads_total=lora.loads_total,
            evictions_total=lora.evictions_total,
            updated_at=time.time(),
        )

    def list_adapters(self, limit: int | None = None, after: tuple[str, int] | None = None) -> list[AdapterInfo]:
        """Adapters ordered by (name, version): the first `limit` after `after` (a page).
        O(registered) per call, never per step: it runs only for a ListAdapters."""
        versions = self.lora.registry.versions.values()
        if after is not None:
            versions = [v for v in versions if (v.name, v.version) > after]  # type: ignore[assignment]
        key = lambda v: (v.name, v.version)  # noqa: E731
        chosen = sorted(versions, key=key) if limit is None else heapq.nsmallest(limit, versions, key=key)
        return [self.adapter_info(v.uid) for v in chosen]

    def adapter_info(self, uid: str) -> AdapterInfo:
        lora, v = self.lora, self.lora.registry.versions[uid]
        return AdapterInfo(
            name=v.name,
            version=v.version,
            uri=v.uri,
            state=lora.state(v.uid).value,
            slot=lora.pool.uid_to_slot.get(v.uid, -1),
            pinned=v.pinned,
            rank=v.rank,
            size_bytes=v.size_bytes,
            active_requests=len(v.refs),
        )

    def shutdown(self) -> None:
        self.lora.shutdown()


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
        if adapter and adapter not in self.core.lora.registry.current:
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
            inner = core.lora.load_adapter(name, uri, sha256, pinned, preload)
            inner.add_done_callback(lambda f: self._resolve_adapter(f, result, name))

        self._commands.put(lambda core: self._guarded(core, run, result))
        return result

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        check_adapter_name(name)
        result: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run(core: EngineCore) -> None:
            inner = core.lora.unload_adapter(name)
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
            self._run_commands(block=idle and not core.lora.has_pending_work())
            if self._stop.is_set():
                break
            try:
                outputs = core.step()
            except Exception:  # noqa: BLE001 - keep serving; fail the requests of this step
                log.exception("scheduler step failed")
                outputs = self._fail_all(core)
            self._publish(core)
            self._deliver(outputs)
            if not outputs and (core.has_work() or core.lora.has_pending_work()):
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

    def _fail_all(self, core: EngineCore) -> list[RequestOutput]:
        for request in list(core.scheduler.running):
            core.scheduler.finish(request, FinishReason.ERROR, LoraplexError("internal error in the scheduler step"))
        outputs = [core._final_output(r, None) for r in core.scheduler.finished_this_step]
        core.scheduler.finished_this_step.clear()
        return outputs

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
        if entry.uid not in self.core.lora.registry.versions:
            result.set_exception(NotFoundError(f"adapter {name} was unloaded while loading"))
            return
        result.set_result(self.core.adapter_info(entry.uid))

    @staticmethod
    def _copy_future(inner: concurrent.futures.Future, result: concurrent.futures.Future) -> None:
        if inner.exception() is not None:
            result.set_exception(inner.exception())
        else:
            result.set_result(inner.result())


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.put(output)
