"""A consumer that falls behind gets the deltas that piled up as one message (the real Engine,
its scheduler thread, and an asyncio consumer), with nothing lost or reordered."""

from __future__ import annotations

import asyncio

from inference_service.engine.config import EngineConfig
from inference_service.engine.in_process import Engine
from inference_service.engine.request import SamplingParams

PROMPT = [256, 72, 101, 108, 108, 111]
PARAMS = SamplingParams(max_new_tokens=16, ignore_eos=True)


async def _read_all(stream) -> list:  # type: ignore[no-untyped-def]
    return [out async for out in stream]


async def _both(engine: Engine) -> tuple[list, list]:
    kept_up = await _read_all(engine.add_request(PROMPT, PARAMS, request_id="keeps-up"))
    behind = engine.add_request(PROMPT, PARAMS, request_id="falls-behind")
    # Not reading while the engine generates every token: all 16 deltas reach this loop's queue.
    while engine.stats().requests_running or sum(engine.stats().requests_waiting.values()):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the last step's hand-off runs on this loop
    return kept_up, await _read_all(behind)


def test_lagging_consumer_gets_one_coalesced_message():
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", kv_cache_bytes=4 << 20))
    engine.start()
    try:
        kept_up, fell_behind = asyncio.run(_both(engine))
    finally:
        engine.shutdown()
    assert len(fell_behind) == 1 and fell_behind[0].finished, [len(o.new_token_ids) for o in fell_behind]
    tokens = [t for o in kept_up for t in o.new_token_ids]
    assert len(tokens) == 16 and fell_behind[0].new_token_ids == tokens  # greedy: the same tokens, in order
    assert fell_behind[0].text == "".join(o.text for o in kept_up)
    assert fell_behind[0].generated_tokens == 16
