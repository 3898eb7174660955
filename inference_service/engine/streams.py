"""The front end's side of a request: its output stream, and the table of open streams.

The engine hands a whole step's outputs over once (`StreamTable.deliver`, from whichever thread
receives them); each `RequestStream` keeps at most ONE pending output: a consumer that lags gets
everything produced meanwhile coalesced into one delta, so a client that stops reading holds one
message (bounded by its max_new_tokens) and never stalls the engine. With a stream interval of N
(`--stream-interval`, vLLM's and SGLang's knob) a stream sends its first token at once, then a
message per N tokens, and its end at once: fewer messages for the front end at hundreds of streams.
Detokenization happens here, on the consumer's side, when the consumer takes an output: never on
the scheduler thread (the core detokenizes only requests with stop strings, which must end at an
exact token).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Iterable, Iterator

from adapter_cache.errors import InvalidArgumentError, LoraplexError, ResourceExhaustedError
from inference_service.engine.output_text import StreamText
from inference_service.engine.request import FinishReason, RequestOutput, SamplingParams
from inference_service.tokenizer import Tokenizer

# Streams woken per event-loop turn. grpc.aio accepts one new call per turn of the loop; waking
# every stream of a step in one turn made a turn as long as all their writes (~10 ms at 256
# streams), so a burst of new calls waited seconds to be accepted. In chunks, turns stay short
# and new calls get their turn; the same work is done.
WAKE_CHUNK = 16

# A plain token delta (no finish, logprobs or logits): request id, token ids, text or None, tokens
# generated so far. The engine core process sends most of a step's outputs as these.
Delta = tuple[str, list[int], str | None, int]


class RequestStream:
    """One request's outputs; iterate it sync (any thread) or async (on the loop it was made on)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None, text: StreamText,
                 interval: int = 1) -> None:
        self.request_id = request_id
        self.loop = loop
        self._text = text
        self._interval = interval  # tokens per message after the first (the end is sent at once)
        self._pending: RequestOutput | None = None
        self._sent = False  # the first output was taken
        self._done = False
        # Async streams are fed on their loop (one call_soon_threadsafe per step); sync ones from
        # the delivering thread, so they need a lock. An async consumer waits on a bare future made
        # when it has nothing to take (an asyncio.Event costs a deque and a loop lookup per wait,
        # several microseconds a message at thousands of messages a second).
        self._waiter: asyncio.Future[None] | None = None
        self._cond: threading.Condition | None = None if loop else threading.Condition()

    @property
    def pending_tokens(self) -> int:
        """Tokens delivered but not yet taken by the consumer (what a slow reader holds)."""
        pending = self._pending
        return len(pending.new_token_ids) if pending is not None else 0

    def _takeable(self) -> bool:
        """A message is due: the first token, the end, or `interval` tokens since the last one."""
        pending = self._pending
        return pending is not None and (not self._sent or pending.finished
                                        or len(pending.new_token_ids) >= self._interval)

    def put(self, output: RequestOutput) -> None:
        if self._cond is None:
            self._merge(output)
            self._wake()
            return
        with self._cond:
            self._merge(output)
            if self._takeable():
                self._cond.notify()

    def put_tokens(self, token_ids: list[int], text: str | None, generated_tokens: int) -> None:
        """On the stream's loop: a plain token delta (no finish, logprobs or logits), merged into
        the pending output without a RequestOutput of its own (one is made per message, not per
        token, for a consumer that lags or waits for --stream-interval tokens)."""
        pending = self._pending
        if pending is None:
            self._pending = RequestOutput(self.request_id, token_ids, text=text, generated_tokens=generated_tokens)
        else:
            pending.absorb_tokens(token_ids, text, generated_tokens)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._takeable():
            waiter.set_result(None)

    def _merge(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            self._pending.absorb(output)

    def _take(self) -> RequestOutput:
        output, self._pending = self._pending, None
        assert output is not None
        self._sent = True
        self._text.fill(output)
        return output

    def __iter__(self) -> Iterator[RequestOutput]:
        assert self._cond is not None, "this stream was made in an event loop: iterate it with `async for`"
        while not self._done:
            with self._cond:
                while not self._takeable():
                    self._cond.wait()
                output = self._take()
            self._done = output.finished
            yield output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self.loop is not None, "create the stream inside a running event loop to iterate async"
        while not self._done:
            if not self._takeable():
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            output = self._take()
            self._done = output.finished
            yield output


class StreamTable:
    """The open streams of one engine, by request id: admission, delivery, and failing them all."""

    def __init__(self, tokenizer: Tokenizer, capacity: int, stream_interval: int = 1) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity  # waiting + running requests the engine accepts
        self._interval = stream_interval
        self._streams: dict[str, RequestStream] = {}
        self._backlogs: dict[asyncio.AbstractEventLoop,
                             collections.deque[tuple[RequestStream, RequestOutput | Delta]]] = {}
        self._draining: set[asyncio.AbstractEventLoop] = set()  # loops with a _drain scheduled
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        stream = RequestStream(request_id, loop, StreamText(self._tokenizer, prompt_token_ids, params), self._interval)
        with self._lock:
            if len(self._streams) >= self._capacity:
                raise ResourceExhaustedError(f"the request queue is full ({len(self._streams)} requests)")
            if request_id in self._streams:
                raise InvalidArgumentError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        """Forget a stream the engine never took (its intake could not be sent)."""
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver(self, outputs: Iterable[RequestOutput], deltas: Iterable[Delta] = ()) -> None:
        """Any thread: route one step's outputs (plain token deltas first, then whole outputs);
        one hand-off per event loop, not per token."""
        woken: list[asyncio.AbstractEventLoop] = []
        streams = self._streams
        with self._lock:
            for delta in deltas:
                stream = streams.get(delta[0])
                if stream is not None:
                    self._route(stream, delta, woken)
            for output in outputs:
                stream = streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del streams[output.request_id]
                self._route(stream, output, woken)
        for loop in woken:
            try:
                loop.call_soon_threadsafe(self._drain, loop)
            except RuntimeError:  # that loop is closed: its clients are gone
                with self._lock:
                    self._backlogs.pop(loop, None)
                    self._draining.discard(loop)

    def _route(self, stream: RequestStream, item: RequestOutput | Delta,
               woken: list[asyncio.AbstractEventLoop]) -> None:
        """Under the lock: a sync stream takes `item` now, an async one on its loop."""
        loop = stream.loop
        if loop is None:
            stream.put(_output(item))
            return
        self._backlogs.setdefault(loop, collections.deque()).append((stream, item))
        if loop not in self._draining:  # else the scheduled _drain takes it in order
            self._draining.add(loop)
            woken.append(loop)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On `loop`: hand WAKE_CHUNK outputs to their streams, then yield the loop if more wait.
        One FIFO per loop, so a stream's outputs are put in the order they were made even when a
        later step's outputs arrive before this step's are all handed over."""
        with self._lock:
            backlog = self._backlogs[loop]
            items = [backlog.popleft() for _ in range(min(WAKE_CHUNK, len(backlog)))]
            more = bool(backlog)
            if not more:
                self._draining.discard(loop)
        for stream, item in items:
            if type(item) is tuple:
                stream.put_tokens(item[1], item[2], item[3])
            else:
                stream.put(item)  # type: ignore[arg-type]
        if more:
            loop.call_soon(self._drain, loop)

    def fail_all(self, error: LoraplexError) -> None:
        """The engine is gone: end every open stream with `error`."""
        with self._lock:
            ids = list(self._streams)
        self.deliver(RequestOutput(rid, [], finished=True, finish_reason=FinishReason.ERROR, error=error)
                     for rid in ids)


def _output(item: RequestOutput | Delta) -> RequestOutput:
    if isinstance(item, RequestOutput):
        return item
    request_id, token_ids, text, generated = item
    return RequestOutput(request_id, token_ids, text=text, generated_tokens=generated)


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of a request's n samples as they come, each with its sample's index, until every
    sample has ended. One output is taken from a stream at a time (the next only once this one was
    consumed), so a consumer that lags still gets each sample's tokens coalesced. Closing the
    iterator early stops reading; aborting the samples is the caller's. One stream is read as it is
    (no task per output: the common case stays as cheap as before)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
            if output.finished:
                return
        return
    iterators = [stream.__aiter__() for stream in streams]
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    output = future.result()
                except StopAsyncIteration:
                    continue
                yield index, output
                if not output.finished:
                    pending[asyncio.ensure_future(anext(iterators[index]))] = index
    finally:
        for future in pending:
            future.cancel()
