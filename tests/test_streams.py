"""The front end's request streams (inference_service/engine/streams.py): one pending output per stream,
coalescing for a consumer that lags, and detokenization on the consumer's side that gives the
same text however the tokens were grouped."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from adapter_cache.errors import InvalidArgumentError, ResourceExhaustedError
from inference_service.engine.request import FinishReason, RequestOutput, SamplingParams
from inference_service.engine.streams import StreamTable
from inference_service.tokenizer import ByteTokenizer

PROMPT = list(b"Hi ")
# "naïve ✓ done": multi-byte characters split across tokens, which the detokenizer holds back.
TEXT_IDS = list("naïve ✓ done".encode())


def _deltas(ids: list[int], reason: FinishReason = FinishReason.LENGTH) -> list[RequestOutput]:
    outs = [RequestOutput("r", [t], text=None, generated_tokens=i + 1) for i, t in enumerate(ids)]
    outs[-1].finished, outs[-1].finish_reason = True, reason
    return outs


def test_a_consumer_that_never_reads_holds_one_pending_output() -> None:
    table = StreamTable(ByteTokenizer(), capacity=4)
    stream = table.open("r", PROMPT, SamplingParams())
    for out in _deltas(TEXT_IDS):
        table.deliver([out])
        assert stream.pending_tokens <= len(TEXT_IDS)
    assert stream.pending_tokens == len(TEXT_IDS)
    messages = list(stream)
    assert len(messages) == 1, "everything delivered meanwhile is one message"
    assert messages[0].new_token_ids == TEXT_IDS and messages[0].text == "naïve ✓ done"
    assert messages[0].finished and messages[0].generated_tokens == len(TEXT_IDS)
    assert len(table) == 0


def test_a_consumer_that_keeps_up_gets_one_message_per_token_and_the_same_text() -> None:
    table = StreamTable(ByteTokenizer(), capacity=4)
    got: list[RequestOutput] = []

    async def run() -> None:
        stream = table.open("r", PROMPT, SamplingParams())
        assert stream.loop is asyncio.get_running_loop()

        async def feed() -> None:
            for out in _deltas(TEXT_IDS):
                await asyncio.to_thread(table.deliver, [out])  # from another thread, as the engine does
                await asyncio.sleep(0.001)

        feeder = asyncio.ensure_future(feed())
        async for out in stream:
            got.append(out)
        await feeder

    asyncio.run(run())
    assert len(got) == len(TEXT_IDS)
    assert "".join(o.text or "" for o in got) == "naïve ✓ done"
    # A multi-byte character's first bytes wait for the rest: those messages carry no text yet.
    assert any(o.text == "" for o in got[:-1])


def test_a_cancelled_request_drops_an_incomplete_character() -> None:
    table = StreamTable(ByteTokenizer(), capacity=4)
    stream = table.open("r", PROMPT, SamplingParams())
    check = "✓".encode()
    table.deliver([RequestOutput("r", [check[0]], text=None, generated_tokens=1)])
    table.deliver([RequestOutput("r", [], finished=True, finish_reason=FinishReason.CANCELLED)])
    (message,) = list(stream)
    assert message.text == "" and message.finish_reason is FinishReason.CANCELLED


def test_admission_bounds_and_duplicate_ids() -> None:
    table = StreamTable(ByteTokenizer(), capacity=2)
    table.open("a", PROMPT, SamplingParams())
    with pytest.raises(InvalidArgumentError, match="already in use"):
        table.open("a", PROMPT, SamplingParams())
    table.open("b", PROMPT, SamplingParams())
    with pytest.raises(ResourceExhaustedError, match="queue is full"):
        table.open("c", PROMPT, SamplingParams())
    table.close("a")
    table.open("c", PROMPT, SamplingParams())


def test_fail_all_ends_every_open_stream_from_another_thread() -> None:
    table = StreamTable(ByteTokenizer(), capacity=8)
    streams = [table.open(f"r{i}", PROMPT, SamplingParams()) for i in range(3)]
    error = ResourceExhaustedError("gone")
    threading.Thread(target=table.fail_all, args=(error,)).start()
    for stream in streams:
        (message,) = list(stream)
        assert message.finished and message.finish_reason is FinishReason.ERROR and message.error is error
    assert len(table) == 0


def test_outputs_reach_each_stream_in_order_when_steps_outrun_the_chunked_wakeups() -> None:
    """More streams than one loop turn wakes (WAKE_CHUNK), and the next step's outputs delivered
    before the first step's tail is handed over, with a different set of requests (the last one
    finishing first): every stream still gets its tokens in order and its final output. Handed
    over out of order, the tail request's final was merged into its earlier non-final delta and
    its stream hung (what the 10,000-call storm found)."""
    from inference_service.engine.streams import WAKE_CHUNK

    n = 2 * WAKE_CHUNK + 5
    last = f"r{n - 1}"
    table = StreamTable(ByteTokenizer(), capacity=n)
    got: dict[str, list[int]] = {}

    def out(rid: str, token: int, final: bool) -> RequestOutput:
        return RequestOutput(rid, [token], text=None, generated_tokens=token - 99, finished=final,
                             finish_reason=FinishReason.LENGTH if final else None)

    async def run() -> None:
        streams = [table.open(f"r{i}", PROMPT, SamplingParams()) for i in range(n)]

        async def consume(stream) -> None:  # noqa: ANN001
            async for message in stream:
                got.setdefault(stream.request_id, []).extend(message.new_token_ids)

        consumers = [asyncio.ensure_future(consume(s)) for s in streams]
        # Both steps are handed over before the loop runs: step 2 holds only the last request.
        table.deliver([out(f"r{i}", 100, False) for i in range(n)])
        table.deliver([out(last, 101, True)])
        table.deliver([out(f"r{i}", 101, True) for i in range(n - 1)])
        await asyncio.wait_for(asyncio.gather(*consumers), timeout=10)

    asyncio.run(run())
    assert got == {f"r{i}": [100, 101] for i in range(n)}
    assert len(table) == 0


@pytest.mark.parametrize("interval", [3, 5])
def test_a_stream_interval_sends_the_first_token_then_every_n_tokens_and_the_end_at_once(interval: int) -> None:
    table = StreamTable(ByteTokenizer(), capacity=4, stream_interval=interval)
    got: list[RequestOutput] = []

    async def run() -> None:
        stream = table.open("r", PROMPT, SamplingParams())

        async def feed() -> None:
            for out in _deltas(TEXT_IDS):
                await asyncio.to_thread(table.deliver, [out])
                await asyncio.sleep(0.002)  # the consumer keeps up: only the interval groups tokens

        feeder = asyncio.ensure_future(feed())
        async for out in stream:
            got.append(out)
        await feeder

    asyncio.run(run())
    sizes = [len(o.new_token_ids) for o in got]
    full, rest = divmod(len(TEXT_IDS) - 1, interval)
    assert sizes == [1] + [interval] * full + ([rest] if rest else []), sizes
    assert [t for o in got for t in o.new_token_ids] == TEXT_IDS
    assert "".join(o.text for o in got) == "naïve ✓ done" and got[-1].finished


def test_a_stream_interval_holds_tokens_until_due_and_sends_the_end_at_once() -> None:
    table = StreamTable(ByteTokenizer(), capacity=4, stream_interval=4)
    stream = table.open("r", PROMPT, SamplingParams())
    outs = _deltas(TEXT_IDS[:4])
    got: list[RequestOutput] = []
    reader = threading.Thread(target=lambda: got.extend(stream))  # a synchronous consumer
    reader.start()
    table.deliver([outs[0]])
    _wait(lambda: len(got) == 1)  # the first token: at once
    table.deliver(outs[1:3])
    time.sleep(0.05)
    assert len(got) == 1 and stream.pending_tokens == 2  # 2 < 4 tokens: not due yet
    table.deliver([outs[3]])  # the end: at once, with the 3 tokens pending
    reader.join(10)
    assert not reader.is_alive()
    assert [o.new_token_ids for o in got] == [TEXT_IDS[:1], TEXT_IDS[1:4]] and got[-1].finished


def _wait(predicate, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
