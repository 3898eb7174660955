"""What reaches the scheduler thread through the engine interface (engine/client.py): a request as
one EngineRequest, built once by the code both engines share and turned into the core's Request in
one place; every admin call run from one table, for both engines."""

from __future__ import annotations

import pickle
import typing

from inference_service.engine.client import CoreCall, EngineRequest
from inference_service.engine.config import EngineConfig
from inference_service.engine.in_process import CORE_CALLS, Engine, core_request
from inference_service.engine.request import FinishReason, SamplingParams, TenantTag, sample_seed

PROMPT = [30, 31, 32, 33, 34]
SALT = (("listener", "grpc"),)


def test_every_core_call_has_one_runner():
    assert set(CORE_CALLS) == set(typing.get_args(CoreCall))


def test_the_core_request_carries_every_field_of_the_message():
    message = EngineRequest("r1", PROMPT, SamplingParams(max_new_tokens=2, seed=5), "a", SALT, "g",
                            TenantTag("t", 2.0), priority=3, arrival=12.5)
    assert pickle.loads(pickle.dumps(message)) == message  # the process engine sends it as it is
    request = core_request(message)
    assert (request.request_id, request.prompt_token_ids, request.params) == ("r1", PROMPT, message.params)
    assert (request.cache_salt, request.group, request.tenant, request.priority) == (SALT, "g", TenantTag("t", 2.0), 3)
    assert request.timings.arrival == 12.5  # TTFT counts from the caller's intake


class _Recording(Engine):
    """The in-process engine, keeping each message it hands to its scheduler thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.sent: list[EngineRequest] = []

    def _submit(self, request: EngineRequest) -> None:
        self.sent.append(request)
        super()._submit(request)


def test_a_request_and_its_samples_leave_as_one_message_each():
    engine = _Recording(EngineConfig(model="builtin:tiny", device="cpu", max_loras=2, max_lora_rank=8,
                                     kv_cache_bytes=4 << 20))
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=7)
        tenant = TenantTag("alice")
        streams = engine.add_samples(PROMPT, params, 3, request_id="req", cache_salt=SALT, tenant=tenant, priority=2)
        streams.append(engine.add_request(PROMPT, params, request_id="one", priority=-1))
        for stream in streams:
            assert [out for out in stream][-1].finish_reason == FinishReason.LENGTH
        samples, single = engine.sent[:3], engine.sent[3]
        assert [m.request_id for m in samples] == ["req.0", "req.1", "req.2"]
        assert [m.params.seed for m in samples] == [sample_seed(7, i) for i in range(3)]
        assert len({m.group for m in samples}) == 1 and samples[0].group.startswith("req#")
        assert {(m.cache_salt, m.tenant, m.priority, m.arrival) for m in samples} == {
            (SALT, tenant, 2, samples[0].arrival)}
        assert (single.request_id, single.group, single.tenant, single.priority) == ("one", None, None, -1)
        assert len(engine.sent) == 4
    finally:
        engine.shutdown()
