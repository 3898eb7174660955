"""Fuzzing GenerateRequest: hypothesis-built requests, and raw bytes, against the real
servicer and engine (builtin:tiny) over real gRPC, in process.

Every outcome is OK or one of the codes a bad request may get (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
NOT_FOUND), never INTERNAL/UNKNOWN and never a hang (each call has a deadline, and the servicer's
own deadline-exceeded would fail the check too); afterwards the engine holds no request, KV block or
adapter reference. `make test` runs a few hundred examples; a longer run:

    LORAPLEX_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest -q tests/test_fuzz_generate.py
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.in_process import Engine
from inference_service.frontend.grpc_server import ServerConfig, build_server

EXAMPLES = int(os.environ.get("LORAPLEX_FUZZ_EXAMPLES", "300"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.NOT_FOUND}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Engine, grpc.Channel]]:
    root = tmp_path_factory.mktemp("fuzz-adapters")
    write_peft_adapter(root / "good", seed=3)
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", max_new_tokens_limit=16))
    engine.start()
    engine.load_adapter("good", (root / "good").as_uri()).result(60)
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()
    port: list[int] = []

    async def serve() -> None:
        running = await build_server(engine, ServerConfig(listen="127.0.0.1:0", adapter_source_allow=(root.as_uri(),)))
        port.append(running.port)
        ready.set()
        await stop.wait()
        await running.stop(0)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60)
    channel = grpc.insecure_channel(f"127.0.0.1:{port[0]}")
    try:
        yield engine, channel
    finally:
        channel.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        engine.shutdown()


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _assert_engine_empty(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if not (stats.requests_running or any(stats.requests_waiting.values()) or stats.kv_blocks_used
                or stats.adapter_references):
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine kept state after the fuzzed requests: {engine.stats()}")


def _mostly(valid: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """About four in five draws valid, so requests get past validation and exercise the engine too."""
    return st.integers(0, 4).flatmap(lambda i: hostile if i == 0 else valid)


_text = st.text(max_size=60) | st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=300)
_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 1e-300, 5e-324, 1e-6, 1.0, 1e300])
_sampling = st.builds(
    lambda t, p, k, seed: pb.SamplingParams(temperature=t, top_k=k, **({} if p is None else {"top_p": p}),
                                            **({} if seed is None else {"seed": seed})),
    _mostly(st.sampled_from([0.0, 1e-300, 0.5, 1.0, 2.0]) | st.floats(0, 5), _floats),
    st.none() | _mostly(st.floats(0.01, 1.0), _floats),
    _mostly(st.integers(0, 300), st.integers(-(2**31), 2**31 - 1)),
    st.none() | st.integers(0, 2**64 - 1),
)
_uint32 = _mostly(st.integers(0, 300), st.integers(0, 2**32 - 1))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:  # type: ignore[no-untyped-def]
    req = pb.GenerateRequest(
        request_id=draw(_mostly(st.just("") | st.text(alphabet="abc-_.", min_size=1, max_size=20),
                                _text | st.text(alphabet="abc", min_size=120, max_size=140))),
        adapter=draw(_mostly(st.sampled_from(["", "good"]), st.sampled_from(["missing", "bad@1", "x" * 129]) | _text)),
        sampling=draw(_sampling),
        stop=draw(_mostly(st.lists(st.text(min_size=1, max_size=8), max_size=4), st.lists(_text, max_size=20))),
        stop_token_ids=draw(_mostly(st.lists(st.integers(0, 300), max_size=4), st.lists(_uint32, max_size=80))),
        ignore_eos=draw(st.booleans()),
    )
    which = draw(_mostly(st.sampled_from(["text", "ids"]), st.just("none")))
    if which == "text":
        req.text = draw(_mostly(st.text(min_size=1, max_size=40), _text))
    elif which == "ids":
        req.token_ids.ids.extend(draw(st.lists(_uint32, max_size=40)))
    if draw(st.booleans()):
        req.max_new_tokens = draw(_mostly(st.integers(1, 8), st.integers(0, 8) | _uint32))
    return req


@FUZZ
@given(request=generate_requests())
def test_fuzzed_generate_requests_get_ok_or_a_documented_code(served, request):
    engine, channel = served
    code = _code(lambda: list(pb_grpc.InferenceStub(channel).Generate(request, timeout=30)))
    event(code.name)  # --hypothesis-show-statistics: how the outcomes spread
    assert code in ALLOWED, (code, request)
    _assert_engine_empty(engine)


@FUZZ
@given(raw=st.binary(max_size=200) | st.builds(lambda b: b"\x1a" + bytes([len(b)]) + b, st.binary(max_size=100)))
def test_fuzzed_request_bytes_get_ok_or_a_documented_code(served, raw):
    engine, channel = served
    call = channel.unary_stream("/loraplex.v1.Inference/Generate", request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString)
    code = _code(lambda: list(call(raw, timeout=30)))
    event(code.name)
    assert code in ALLOWED, (code, raw)
    _assert_engine_empty(engine)
