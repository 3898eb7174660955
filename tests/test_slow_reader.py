"""A client that stops reading a stream must not stall the engine or anyone else.

Through the real server (engine core in its own process): one client opens a long stream with
logprobs (messages big enough to fill the HTTP/2 flow-control window) and stops reading after
the first message. The engine must finish that request anyway (its KV and slot freed: the
stream's one pending message holds what the transport could not take), a victim stream beside
it must get exactly its solo tokens, and when the slow client reads again it gets every token,
the ones produced meanwhile coalesced into fewer messages.
"""

from __future__ import annotations

import time

from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc

NEW_TOKENS = 1000  # builtin:tiny's context is 1024


def _request(text: str, n: int, logprobs: int | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text=text, max_new_tokens=n, ignore_eos=True)
    if logprobs is not None:
        req.logprobs = logprobs
    return req


def test_a_client_that_stops_reading_does_not_stall_the_engine(inference_server_factory) -> None:
    server = inference_server_factory("--max-new-tokens-limit", str(NEW_TOKENS))
    stub = pb_grpc.InferenceStub(server.channel())
    solo = [t for m in stub.Generate(_request("victim", 200), timeout=60) for t in m.token_ids]
    reference = [t for m in stub.Generate(_request("slow", NEW_TOKENS), timeout=60) for t in m.token_ids]

    slow = stub.Generate(_request("slow", NEW_TOKENS, logprobs=20), timeout=120)
    first = next(slow)  # then nothing is read for a while
    victim = [t for m in stub.Generate(_request("victim", 200), timeout=60) for t in m.token_ids]
    assert victim == solo

    deadline = time.monotonic() + 30
    while (server.value("loraplex_requests_running") > 0 or server.value("loraplex_lora_slots_referenced") > 0
           or server.value("loraplex_lora_adapter_references") > 0):
        assert time.monotonic() < deadline, "the engine waits on a client that does not read"
        time.sleep(0.1)

    rest = list(slow)
    tokens = [t for m in [first, *rest] for t in m.token_ids]
    assert tokens == reference
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(rest) + 1 < NEW_TOKENS, "tokens produced while the client did not read came as one message"
    assert [lp.token_id for m in [first, *rest] for lp in m.logprobs] == reference
    assert server.value("loraplex_requests_running") == 0
