"""Each bad input gets its documented status code, and leaves the real server healthy and leak-free."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.bad_adapters import write_admin_error_adapters
from harness.inference_server import start_inference_server
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = pytest.mark.slow
TOKEN = "errors-admin-token"
LIMIT = 64
MAX_MESSAGE = 64 * 1024
LEAK_GAUGES = ("loraplex_lora_slots_referenced", "loraplex_lora_adapter_references",
               "loraplex_lora_pending_load_events", "loraplex_requests_running", "loraplex_requests_waiting",
               "loraplex_kv_cache_usage_ratio")
S = grpc.StatusCode


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    write_peft_adapter(root / "good", rank=8, seed=1)
    write_admin_error_adapters(root, outside)
    server = start_inference_server(
        ["--model", "builtin:tiny", "--max-loras", "2", "--max-lora-rank", "16", "--max-new-tokens-limit",
         str(LIMIT), "--max-message-bytes", str(MAX_MESSAGE), "--adapter-source-allow", root.as_uri()],
        env={"LORAPLEX_ADMIN_TOKEN": TOKEN},
        log_dir=tmp_path_factory.mktemp("errors-logs"),
    )
    with InferenceClient(server.address, token=TOKEN) as c:
        c.load_adapter("good", (root / "good").as_uri(), preload=True)
    yield server, root, outside
    server.stop()


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.details(), "error without a message"
    return e.value.code()


def _gen(server, prompt, **kw):
    with InferenceClient(server.address, max_message_bytes=4 * MAX_MESSAGE) as c:
        return list(c.generate(prompt, timeout=30, **kw))


GENERATE_CASES = {
    "unknown adapter": (dict(prompt="hi", adapter="nope"), S.NOT_FOUND),
    "empty prompt": (dict(prompt=""), S.INVALID_ARGUMENT),
    "empty token ids": (dict(prompt=[]), S.INVALID_ARGUMENT),
    "token id outside vocab": (dict(prompt=[1, 100000]), S.INVALID_ARGUMENT),
    "prompt longer than the context": (dict(prompt="x" * 1100, max_new_tokens=4), S.INVALID_ARGUMENT),
    "prompt plus new tokens over the context": (dict(prompt="x" * 1000, max_new_tokens=LIMIT), S.INVALID_ARGUMENT),
    "negative temperature": (dict(prompt="hi", temperature=-0.5), S.INVALID_ARGUMENT),
    "nan temperature": (dict(prompt="hi", temperature=float("nan")), S.INVALID_ARGUMENT),
    "nan top_p": (dict(prompt="hi", top_p=float("nan")), S.INVALID_ARGUMENT),
    "negative top_p": (dict(prompt="hi", top_p=-0.1), S.INVALID_ARGUMENT),
    "negative top_k": (dict(prompt="hi", top_k=-3), S.INVALID_ARGUMENT),
    "max_new_tokens over the limit": (dict(prompt="hi", max_new_tokens=LIMIT + 1), S.INVALID_ARGUMENT),
    "max_new_tokens zero": (dict(prompt="hi", max_new_tokens=0), S.INVALID_ARGUMENT),
    "empty stop string": (dict(prompt="hi", stop=[""]), S.INVALID_ARGUMENT),
    "oversized message": (dict(prompt="y" * (MAX_MESSAGE + 10)), S.RESOURCE_EXHAUSTED),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_errors(env, case):
    server = env[0]
    kwargs, code = GENERATE_CASES[case]
    prompt = kwargs.pop("prompt")
    try:
        assert _code(lambda: _gen(server, prompt, **kwargs)) == code
    finally:
        kwargs["prompt"] = prompt


def _admin_cases(root, outside):
    return {
        "missing admin token": (None, dict(name="x", uri=(root / "good").as_uri()), S.UNAUTHENTICATED),
        "wrong admin token": ("wrong", dict(name="x", uri=(root / "good").as_uri()), S.PERMISSION_DENIED),
        "uri outside the allowed prefixes": (TOKEN, dict(name="x", uri=(outside / "elsewhere").as_uri()),
                                             S.PERMISSION_DENIED),
        "other scheme outside the allow list": (TOKEN, dict(name="x", uri="s3://bucket/adapters/x"),
                                                S.PERMISSION_DENIED),
        "path traversal": (TOKEN, dict(name="x", uri=root.as_uri() + "/../" + outside.name + "/elsewhere"),
                           S.PERMISSION_DENIED),
        "encoded path traversal": (TOKEN, dict(name="x", uri=root.as_uri() + "/%2e%2e/" + outside.name),
                                   S.PERMISSION_DENIED),
        "rank too large": (TOKEN, dict(name="x", uri=(root / "rank64").as_uri(), preload=True), S.INVALID_ARGUMENT),
        "unparsable config": (TOKEN, dict(name="x", uri=(root / "bad-json").as_uri(), preload=True),
                              S.INVALID_ARGUMENT),
        "truncated safetensors": (TOKEN, dict(name="x", uri=(root / "truncated").as_uri(), preload=True),
                                  S.INVALID_ARGUMENT),
        "dora": (TOKEN, dict(name="x", uri=(root / "dora").as_uri(), preload=True), S.INVALID_ARGUMENT),
        "more layers than the base model": (TOKEN, dict(name="x", uri=(root / "too-many-layers").as_uri(),
                                                        preload=True), S.FAILED_PRECONDITION),
        "missing files": (TOKEN, dict(name="x", uri=(root / "nothing-here").as_uri(), preload=True),
                          S.NOT_FOUND),
        "empty name": (TOKEN, dict(name="", uri=(root / "good").as_uri()), S.INVALID_ARGUMENT),
        "bad sha256": (TOKEN, dict(name="x", uri=(root / "good").as_uri(), sha256="zz"), S.INVALID_ARGUMENT),
        "sha256 mismatch": (TOKEN, dict(name="x", uri=(root / "good").as_uri(), sha256="0" * 64, preload=True),
                            S.INVALID_ARGUMENT),
    }


def test_admin_errors(env):
    server, root, outside = env
    failures = []
    for case, (token, kw, code) in _admin_cases(root, outside).items():
        with InferenceClient(server.address, token=token) as c:
            got = _code(lambda c=c, kw=kw: c.load_adapter(timeout=30, **kw))
        if got != code:
            failures.append(f"{case}: {got.name} != {code.name}")
    with InferenceClient(server.address) as c:
        if (got := _code(lambda: c.unload_adapter("good"))) != S.UNAUTHENTICATED:
            failures.append(f"unload without token: {got.name}")
    with InferenceClient(server.address, token=TOKEN) as c:
        if (got := _code(lambda: c.unload_adapter("never-loaded"))) != S.NOT_FOUND:
            failures.append(f"unload unknown: {got.name}")
        names = {a.name for a in c.list_adapters()}
    assert not failures, failures
    assert names == {"good"}, names  # rejected loads left nothing behind


def _raw_call(server, method: str, raw: bytes, stream: bool):
    """Sends `raw` as the request bytes: fields this proto does not have cannot be built otherwise."""
    with grpc.insecure_channel(server.address) as ch:
        kind = ch.unary_stream if stream else ch.unary_unary
        call = kind(f"/loraplex.v1.Inference/{method}", request_serializer=None, response_deserializer=None)
        result = call(raw, timeout=30)
        return list(result) if stream else result


def _with_unknown(msg, number: int = 1023) -> bytes:
    return msg.SerializeToString() + _varint(number << 3) + b"\x01"  # varint field `number` = 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def test_unknown_fields_are_refused_not_dropped(env):
    """protobuf parses on past fields it does not know: a client on a newer proto (say, asking for a
    constraint) would get an answer that ignored it. Each one, top level or nested, is INVALID_ARGUMENT."""
    server = env[0]
    sampling = pb.SamplingParams(temperature=0.0)
    nested = pb.GenerateRequest(text="hi", max_new_tokens=2).SerializeToString()
    nested += _varint(5 << 3 | 2) + _varint(len(raw := _with_unknown(sampling, 77))) + raw  # sampling.77
    cases = {
        "Generate, top level": ("Generate", _with_unknown(pb.GenerateRequest(text="hi", max_new_tokens=2)), True),
        "Generate, inside sampling": ("Generate", nested, True),
        "Detokenize": ("Detokenize", _with_unknown(pb.DetokenizeRequest(token_ids=[104, 105])), False),
    }
    for case, (method, raw, stream) in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            _raw_call(server, method, raw, stream)
        assert e.value.code() == S.INVALID_ARGUMENT, case
        assert "field number" in e.value.details(), (case, e.value.details())
    # The same requests without the extra field are served.
    assert _raw_call(server, "Generate", pb.GenerateRequest(text="hi", max_new_tokens=2).SerializeToString(), True)
    assert pb.DetokenizeResponse.FromString(
        _raw_call(server, "Detokenize", pb.DetokenizeRequest(token_ids=[104, 105]).SerializeToString(), False)
    ).text == "hi"


def test_detokenize_is_bounded_by_the_context(env):
    server = env[0]
    with InferenceClient(server.address, max_message_bytes=4 * MAX_MESSAGE) as c:
        context = c.model_info().max_context
        stub_raw = pb.DetokenizeRequest(token_ids=[104] * (context + 1)).SerializeToString()
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server, "Detokenize", stub_raw, False)
    assert e.value.code() == S.INVALID_ARGUMENT and "context" in e.value.details(), e.value.details()


def test_server_healthy_and_leak_free_after_errors(env):
    server = env[0]
    # runs after the error cases above (module order); run them again to be independent of ordering
    for case in GENERATE_CASES.values():
        kwargs = dict(case[0])
        prompt = kwargs.pop("prompt")
        with pytest.raises(grpc.RpcError):
            _gen(server, prompt, **kwargs)
    with grpc.insecure_channel(server.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    msgs = _gen(server, "still fine", adapter="good", max_new_tokens=5, ignore_eos=True)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    deadline = time.monotonic() + 10
    while any(server.value(g) for g in LEAK_GAUGES) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {g: server.value(g) for g in LEAK_GAUGES} == dict.fromkeys(LEAK_GAUGES, 0.0)
    assert server.proc.poll() is None
    assert "Traceback" not in server.log(), server.log()[-3000:]
    with InferenceClient(server.address) as c:
        assert {a.name for a in c.list_adapters()} == {"good"}
