"""The real server's intake, end to end: required adapters of --preload-file are in their slots
before it reports SERVING, a full queue answers RESOURCE_EXHAUSTED, a request id already in use answers
INVALID_ARGUMENT; and afterwards the server still serves and holds nothing."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

MAX_NUM_SEQS, MAX_QUEUE = 1, 2


@pytest.fixture
def server(tmp_path, inference_server_factory):
    adapters = {name: write_peft_adapter(tmp_path / name, rank=4, seed=i) for i, name in enumerate(["p0", "p1"])}
    preload = tmp_path / "preload.json"
    # required: they gate readiness (entries without it load in the background after SERVING)
    preload.write_text(json.dumps([{"name": n, "uri": p.as_uri(), "pinned": n == "p1", "required": True}
                                   for n, p in adapters.items()]))
    return inference_server_factory("--preload-file", str(preload), "--adapter-source-allow", tmp_path.as_uri(),
                                    "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE))


def _wait_for(server, running: int, waiting: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (server.value("loraplex_requests_running"), server.value("loraplex_requests_waiting")) != (running, waiting):
        assert time.monotonic() < deadline, "the held requests did not reach the engine"
        time.sleep(0.01)


def test_preload_file_adapters_are_in_slots_before_serving(server):
    with InferenceClient(server.address) as c:
        listed = {a.name: a for a in c.list_adapters()}  # the first call after SERVING
    assert set(listed) == {"p0", "p1"}
    assert all(a.state == pb.ADAPTER_STATE_LOADED for a in listed.values()), listed
    assert listed["p1"].pinned and not listed["p0"].pinned
    assert server.value("loraplex_lora_slots_occupied") == 2 and server.value("loraplex_lora_slots_pinned") == 1


def test_full_queue_is_resource_exhausted_and_the_server_recovers(server):
    with InferenceClient(server.address) as c:
        # One running and MAX_QUEUE waiting, each for 1000 tokens: the queue stays full for at least
        # 1000 decode steps after it fills, far longer than the next call takes to arrive.
        holders = [c.generate(f"hold {i}", max_new_tokens=1000, ignore_eos=True)
                   for i in range(MAX_NUM_SEQS + MAX_QUEUE)]
        _wait_for(server, MAX_NUM_SEQS, MAX_QUEUE)
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate("one too many", max_new_tokens=4, ignore_eos=True, timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "queue is full" in err.value.details()
        for s in holders:
            s.cancel()
        # The cancels free their places as the engine ends each request (a step or two): then it serves again.
        _wait_for(server, 0, 0)
        deadline = time.monotonic() + 10
        while True:
            try:
                msgs = list(c.generate("after", max_new_tokens=4, ignore_eos=True, timeout=60))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline, e
                time.sleep(0.05)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    refused = server.value("loraplex_grpc_requests_total", method="Generate", code="RESOURCE_EXHAUSTED")
    assert refused >= 1 and server.value("loraplex_requests_waiting") == 0


def test_request_id_in_use_is_invalid_argument(server):
    with InferenceClient(server.address) as c:
        first = c.generate("first", max_new_tokens=1000, ignore_eos=True, request_id="same-id")
        next(first)
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate("second", max_new_tokens=4, ignore_eos=True, request_id="same-id", timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "already in use" in err.value.details()
        first.cancel()
        # Once the first has ended, its id is free again.
        deadline = time.monotonic() + 10
        while True:  # the cancel reaches the engine within a step or two
            try:
                msgs = list(c.generate("again", max_new_tokens=4, ignore_eos=True, request_id="same-id", timeout=30))
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and time.monotonic() < deadline, e
                time.sleep(0.05)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert server.value("loraplex_requests_running") == 0 and server.value("loraplex_lora_slots_referenced") == 0
    assert server.value("loraplex_lora_adapter_references") == 0
