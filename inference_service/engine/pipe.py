"""The pipe between a front end and its engine core process: what crosses it, and how each turn's
news is packed.

Front end → core (`ToCore`): a request as it is (engine.client.EngineRequest), an abort, a typed
admin call (`CallCore` around an engine.client.CoreCall), and the order to stop. Core → front end:
`CoreReady` or `CoreFailed` once, then after each loop turn of the scheduler at most ONE `Update`:
the step's outputs (plain token deltas as compact tuples, the rest whole), the metric events the
step recorded (`RecordedMetrics`, replayed into the real sink by `replay`), the stats snapshot and
the adapter names when they changed, and the results of admin calls (`CallResult`). The core
process packs and sends it on a thread of its own (`Outbox`). engine/process.py starts, stops and
reaps the process at either end of this pipe.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import multiprocessing.connection
import queue
import threading
from typing import Any, Protocol

from adapter_cache.errors import LoraplexError
from inference_service.engine.client import CoreCall, EngineRequest
from inference_service.engine.request import FinishReason, RequestOutput
from inference_service.engine.streams import Delta
from inference_service.engine.types import EngineStats, ModelInfo
from inference_service.metrics_sink import MetricsSink
from inference_service.tokenizer import Tokenizer

# ---- what crosses the pipe: typed messages -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class AbortRequest:
    """Front end → core: end a request (a request itself crosses as engine.client.EngineRequest)."""

    request_id: str
    reason: FinishReason


@dataclasses.dataclass(frozen=True, slots=True)
class CallCore:
    """Front end → core: a typed call (engine.client.CoreCall); its answer comes back as a CallResult."""

    call_id: int
    call: CoreCall


@dataclasses.dataclass(frozen=True, slots=True)
class StopCore:
    """Front end → core: stop the scheduler loop and exit."""


ToCore = EngineRequest | AbortRequest | CallCore | StopCore


@dataclasses.dataclass(frozen=True, slots=True)
class CoreReady:
    """Core → front end, once: the core is built."""

    model_info: ModelInfo
    tokenizer: Tokenizer
    stats: EngineStats


@dataclasses.dataclass(frozen=True, slots=True)
class CoreFailed:
    """Core → front end, once: building the core raised `error` (the front end raises it)."""

    error: BaseException


@dataclasses.dataclass(frozen=True, slots=True)
class CallResult:
    """Core → front end, inside an Update: a CallCore's value, or its error."""

    call_id: int
    error: LoraplexError | None
    value: Any = None


@dataclasses.dataclass
class Update:
    """Everything one turn of the core's loop tells the front end, in one message."""

    deltas: list[Delta]
    outputs: list[RequestOutput]  # finished ones and those with logits/logprobs: whole
    recorded_metrics: RecordedMetricsBatch
    stats: EngineStats | None  # when it changed
    adapter_names: frozenset[str] | None  # when it changed
    results: list[CallResult]


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterLoaded:
    tier: str
    seconds: float

    def replay(self, metrics: MetricsSink) -> None:
        metrics.adapter_loaded(self.tier, self.seconds)


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterEvicted:
    def replay(self, metrics: MetricsSink) -> None:
        metrics.adapter_evicted()


@dataclasses.dataclass(frozen=True, slots=True)
class TokensCounted:
    prompt: int
    generated: int

    def replay(self, metrics: MetricsSink) -> None:
        metrics.tokens(self.prompt, self.generated)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFinished:
    finish_reason: str
    adapter: str | None

    def replay(self, metrics: MetricsSink) -> None:
        metrics.request_finished(self.finish_reason, self.adapter)


MetricEvent = AdapterLoaded | AdapterEvicted | TokensCounted | RequestFinished
RecordedMetricsBatch = tuple[list[float], list[float], list[MetricEvent]]


class RecordedMetrics:
    """The core process's metrics sink: records what it is told as typed events for the front end
    to replay into the real sink. Per-token timings go into plain lists (one pickled list of floats
    per step, not an object per token); appends are atomic, and loader threads report loads."""

    def __init__(self) -> None:
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._events: collections.deque[MetricEvent] = collections.deque()

    def take(self) -> RecordedMetricsBatch:
        ttft, self._ttft = self._ttft, []
        itl, self._itl = self._itl, []
        events = []
        while self._events:
            events.append(self._events.popleft())
        return ttft, itl, events

    def adapter_loaded(self, tier: str, seconds: float) -> None:
        self._events.append(AdapterLoaded(tier, seconds))

    def adapter_evicted(self) -> None:
        self._events.append(AdapterEvicted())

    def first_token(self, seconds: float) -> None:
        self._ttft.append(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.append(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self._events.append(TokensCounted(prompt, generated))

    def request_finished(self, finish_reason: str, adapter: str | None) -> None:
        self._events.append(RequestFinished(finish_reason, adapter))


def replay(metrics: MetricsSink, recorded: RecordedMetricsBatch) -> None:
    ttft, itl, events = recorded
    for seconds in ttft:
        metrics.first_token(seconds)
    for seconds in itl:
        metrics.inter_token(seconds)
    for event in events:
        event.replay(metrics)


# ---- the core's side: one Update per loop turn -------------------------------------------------------------

class AdapterNames(Protocol):
    """What the outbox reads of the core: the names new requests may use, and when they changed."""

    def adapter_names(self) -> frozenset[str]: ...

    def adapter_names_changes(self) -> int: ...


class Outbox:
    """Collects a loop turn's outputs and call results; a sender thread encodes and sends them as
    one `Update`, while the scheduler thread goes on with the next step (the forward pass
    releases the GIL: on an accelerator the encoding overlaps it)."""

    def __init__(self, conn: multiprocessing.connection.Connection, core: AdapterNames,
                 sink: RecordedMetrics) -> None:
        self._conn, self._core, self._sink = conn, core, sink
        self._outputs: list[RequestOutput] = []
        self._results: collections.deque[CallResult] = collections.deque()
        self._sent_stats: EngineStats | None = None
        self._sent_names = -1
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="sender", daemon=True)
        self._sender.start()

    def add_outputs(self, outputs: list[RequestOutput]) -> None:
        self._outputs += outputs

    def add_result(self, call_id: int, future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is not None and not isinstance(error, LoraplexError):
            # Only our errors are known to cross the pipe; anything else is a bug, reported as one.
            error = LoraplexError(f"internal error in the engine core: {type(error).__name__}: {error}")
        self._results.append(CallResult(call_id, error) if error is not None else CallResult(call_id, None,
                                                                                            future.result()))

    def flush(self, stats: EngineStats) -> None:
        """On the scheduler thread, once per loop turn: hands over what changed (cheap)."""
        plain = dataclasses.replace(stats, updated_at=0.0)
        stats_changed = plain != self._sent_stats
        names_changes = self._core.adapter_names_changes()
        names = self._core.adapter_names() if names_changes != self._sent_names else None
        recorded = self._sink.take()
        if not (self._outputs or self._results or any(recorded) or stats_changed or names is not None):
            return
        results = []
        while self._results:
            results.append(self._results.popleft())
        outputs, self._outputs = self._outputs, []
        self._queue.put((outputs, recorded, stats if stats_changed else None, names, results))
        self._sent_stats, self._sent_names = plain, names_changes

    def close(self) -> None:
        self._queue.put(None)
        self._sender.join(timeout=10)

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            outputs, recorded, stats, names, results = item
            deltas: list[Delta] = []
            whole: list[RequestOutput] = []
            for out in outputs:
                if out.finished or out.logits is not None or out.logprobs is not None or out.error is not None:
                    whole.append(out)
                else:
                    deltas.append((out.request_id, out.new_token_ids, out.text, out.generated_tokens))
            try:
                self._conn.send(Update(deltas, whole, recorded, stats, names, results))
            except (OSError, ValueError):
                return  # the front end has gone; the command reader stops the loop
