"""The servicer's own contract, over real gRPC against a scripted engine: streaming, the abort in
`finally` on cancel/deadline, status mapping, admin auth, metrics codes, health and reflection.
(The real-engine tests are in test_server_integration.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from adapter_cache.errors import NotFoundError, ResourceExhaustedError, UnavailableError
from harness.tools import require_tool
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.engine.request import FinishReason, RequestOutput, Timings
from inference_service.engine.types import ModelInfo
from inference_service.frontend.grpc_server import ServerConfig, build_server
from inference_service.frontend.metrics import build_registry
from inference_service.limits import RequestLimits
from inference_service.tokenizer import ByteTokenizer

GRPCURL = Path(sys.executable).with_name("grpcurl")  # the venv running the tests ships it (pip wrapper)


def fake_model_info() -> ModelInfo:
    """The engine's own type (a hand-made twin drifted: it lacked the pool's fields GetModelInfo reads),
    with a KV cache that holds the context, as every engine's does (the front door checks against it)."""
    return ModelInfo(name="fake", max_context=64, vocab_size=258, max_loras=2, max_lora_rank=8,
                     max_new_tokens_limit=32, limits=RequestLimits(), max_registered_adapters=8,
                     kv_cache_blocks=4, kv_block_size=16)


@dataclass
class FakeAdapter:
    name: str
    uri: str
    state: str = "LOADED"
    slot: int = 0
    pinned: bool = False
    rank: int = 8
    size_bytes: int = 100
    active_requests: int = 0
    version: int = 1


class FakeStream:
    def __init__(self, engine: FakeEngine, request_id: str, n: int, delay: float) -> None:
        self.engine, self.request_id, self.n, self.delay, self.i = engine, request_id, n, delay, 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.i > self.n:
            raise StopAsyncIteration
        await asyncio.sleep(self.delay)
        self.i += 1
        if self.request_id in self.engine.aborted:
            self.i = self.n + 1
            return RequestOutput(self.request_id, [], finished=True, finish_reason=FinishReason.CANCELLED)
        done = self.i == self.n
        return RequestOutput(self.request_id, [65 + self.i], text=chr(65 + self.i), finished=done,
                             finish_reason=FinishReason.LENGTH if done else None, prompt_tokens=3,
                             generated_tokens=self.i, timings=Timings() if done else None)


@dataclass
class FakeEngine:
    delay: float = 0.0
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    model_info: ModelInfo = field(default_factory=fake_model_info)
    aborted: dict[str, FinishReason] = field(default_factory=dict)
    adapters: dict[str, FakeAdapter] = field(default_factory=dict)

    def add_request(self, prompt_token_ids, params, adapter=None, request_id=None, cache_salt=None, tenant=None,
                    priority=0):
        if adapter == "missing":
            raise NotFoundError(f"unknown adapter {adapter!r}")
        if adapter == "busy":
            raise ResourceExhaustedError("queue full")
        return FakeStream(self, request_id, params.max_new_tokens, self.delay)

    def abort(self, request_id, reason=FinishReason.CANCELLED):
        self.aborted[request_id] = reason

    def adapter_is_current(self, name):
        return name in self.adapters

    def load_adapter(self, name, uri, sha256=None, pinned=False, preload=False, owner=None):
        import concurrent.futures

        fut = concurrent.futures.Future()
        if "unreachable" in uri:
            fut.set_exception(UnavailableError("object store unreachable"))
        else:
            self.adapters[name] = FakeAdapter(name, uri, pinned=pinned)
            fut.set_result(self.adapters[name])
        return fut

    def unload_adapter(self, name):
        import concurrent.futures

        fut = concurrent.futures.Future()
        if self.adapters.pop(name, None) is None:
            fut.set_exception(NotFoundError(f"unknown adapter {name!r}"))
        else:
            fut.set_result(None)
        return fut

    def list_adapters(self, limit=None, after=None):
        import concurrent.futures

        fut = concurrent.futures.Future()
        listed = sorted((a for a in self.adapters.values() if after is None or (a.name, a.version) > after),
                        key=lambda a: (a.name, a.version))
        fut.set_result(listed[:limit])
        return fut


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _with_server(engine, body, **cfg):
    registry, sink = build_registry()
    running = await build_server(engine, ServerConfig(listen="127.0.0.1:0", **cfg), sink)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            await body(pb_grpc.InferenceStub(channel), channel, running.port)
    finally:
        await running.stop(0)
    return generate_latest(registry).decode()


def _req(**kw) -> pb.GenerateRequest:
    r = pb.GenerateRequest(text="hi", **kw)
    return r


def test_stream_deltas_and_final_message():
    engine = FakeEngine()

    async def body(stub, *_):
        msgs = [m async for m in stub.Generate(_req(request_id="r1", max_new_tokens=4))]
        assert [m.text for m in msgs] == ["B", "C", "D", "E"]
        assert all(m.request_id == "r1" for m in msgs)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert msgs[-1].usage.prompt_tokens == 3 and msgs[-1].usage.generated_tokens == 4
        assert not msgs[0].HasField("usage")

    text = run(_with_server(engine, body))
    assert 'loraplex_grpc_requests_total{code="OK",method="Generate"} 1.0' in text
    assert engine.aborted == {}  # finished normally: nothing to abort


def test_client_cancel_aborts_in_engine_and_counts_cancelled():
    engine = FakeEngine(delay=0.05)

    async def body(stub, *_):
        call = stub.Generate(_req(request_id="c1", max_new_tokens=30))
        await call.read()
        call.cancel()
        for _ in range(100):
            if "c1" in engine.aborted:
                break
            await asyncio.sleep(0.02)

    text = run(_with_server(engine, body))
    assert engine.aborted == {"c1": FinishReason.CANCELLED}
    assert 'loraplex_grpc_requests_total{code="CANCELLED",method="Generate"} 1.0' in text
    assert 'loraplex_grpc_requests_total{code="OK",method="Generate"} 0.0' in text  # never counted as success


class _EndlessBigStream(FakeStream):
    """64 KiB deltas, always ready, until aborted: the handler fills the stream's flow-control window
    and then waits at its `yield` (grpc's send) for a client that does not read."""

    async def __anext__(self) -> RequestOutput:
        await asyncio.sleep(0)
        if self.request_id in self.engine.aborted:
            raise StopAsyncIteration
        return RequestOutput(self.request_id, [65], text="x" * 65536)


def test_cancel_while_the_handler_waits_to_send_counts_cancelled():
    """A cancel that finds the handler suspended at `yield` reaches it as GeneratorExit, not
    CancelledError: still a cancel (aborted in the engine, counted CANCELLED), never an OK."""
    engine = FakeEngine()
    engine.add_request = lambda prompt, params, adapter=None, request_id=None, cache_salt=None, tenant=None, \
        priority=0: _EndlessBigStream(engine, request_id, 0, 0.0)  # type: ignore

    async def body(stub, *_):
        call = stub.Generate(_req(request_id="w1", max_new_tokens=30))
        await call.read()
        await asyncio.sleep(0.5)  # not reading: the server's sends back up
        call.cancel()
        for _ in range(100):
            if "w1" in engine.aborted:
                break
            await asyncio.sleep(0.02)

    text = run(_with_server(engine, body))
    assert engine.aborted == {"w1": FinishReason.CANCELLED}
    assert 'loraplex_grpc_requests_total{code="CANCELLED",method="Generate"} 1.0' in text
    assert 'loraplex_grpc_requests_total{code="OK",method="Generate"} 0.0' in text


def test_a_cancel_just_before_our_copy_of_the_deadline_counts_as_the_deadline():
    """The client's deadline starts before the request reaches the server, so its cancel arrives
    while the server's copy has a little time left: within DEADLINE_SLACK_S that is the deadline,
    beyond it a cancel (the clock injected: a loaded host gave 0.3 s calls a few ms of such slack)."""
    from inference_service.frontend import grpc_server

    def with_remaining(seconds: float | None) -> str:
        return grpc_server._cancel_code(SimpleNamespace(time_remaining=lambda: seconds))

    assert with_remaining(-0.01) == with_remaining(0.0) == "DEADLINE_EXCEEDED"
    assert with_remaining(grpc_server.DEADLINE_SLACK_S / 2) == "DEADLINE_EXCEEDED"
    assert with_remaining(grpc_server.DEADLINE_SLACK_S * 3) == "CANCELLED"
    assert with_remaining(None) == "CANCELLED"  # no deadline at all


def test_deadline_aborts_with_deadline_reason():
    engine = FakeEngine(delay=0.05)

    async def body(stub, *_):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(_req(request_id="d1", max_new_tokens=30), timeout=0.3):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(100):
            if "d1" in engine.aborted:
                break
            await asyncio.sleep(0.02)

    text = run(_with_server(engine, body))
    assert engine.aborted == {"d1": FinishReason.DEADLINE}
    assert 'loraplex_grpc_requests_total{code="DEADLINE_EXCEEDED",method="Generate"} 1.0' in text


@pytest.mark.parametrize(
    "kw, code",
    [
        (dict(adapter="missing"), grpc.StatusCode.NOT_FOUND),
        (dict(adapter="busy"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (dict(max_new_tokens=33), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(sampling=pb.SamplingParams(temperature=float("nan"))), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(sampling=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(sampling=pb.SamplingParams(top_k=-1)), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(sampling=pb.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_error_codes(kw, code):
    async def body(stub, *_):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(_req(**kw)):
                pass
        assert e.value.code() == code, e.value.details()
        assert e.value.details()

    text = run(_with_server(FakeEngine(), body))
    assert f'code="{code.name}"' in text


def test_prompt_validation():
    async def body(stub, *_):
        for req in (pb.GenerateRequest(), pb.GenerateRequest(text=""),
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])),
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 9999]))):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(req):
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(_with_server(FakeEngine(), body))


def test_admin_auth_and_unavailable_mapping():
    engine = FakeEngine()

    async def body(stub, *_):
        req = pb.LoadAdapterRequest(name="a", uri="file:///srv/a")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadAdapter(req)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadAdapter(req, metadata=(("authorization", "Bearer nope"),))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        good = (("authorization", "Bearer tok"),)
        resp = await stub.LoadAdapter(req, metadata=good)
        assert resp.adapter.name == "a" and resp.adapter.state == pb.ADAPTER_STATE_LOADED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadAdapter(pb.LoadAdapterRequest(name="b", uri="file:///srv/unreachable"), metadata=good)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LoadAdapter(pb.LoadAdapterRequest(name="b", uri="file:///srv/../etc"), metadata=good)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        listed = await stub.ListAdapters(pb.ListAdaptersRequest())  # read-only RPCs are open
        assert [(a.name, a.uri) for a in listed.adapters] == [("a", "")]  # URIs for admins only
        listed = await stub.ListAdapters(pb.ListAdaptersRequest(), metadata=good)
        assert [(a.name, a.uri) for a in listed.adapters] == [("a", "file:///srv/a")]
        await stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a"), metadata=good)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.model_name, info.max_context, info.max_new_tokens_limit) == ("fake", 64, 32)

    text = run(_with_server(engine, body, admin_token="tok", adapter_source_allow=("file:///srv",)))
    assert 'loraplex_grpc_requests_total{code="UNAUTHENTICATED",method="LoadAdapter"} 1.0' in text
    assert 'loraplex_grpc_requests_total{code="PERMISSION_DENIED",method="LoadAdapter"} 2.0' in text


def test_health_and_reflection_with_grpcurl():
    async def body(stub, channel, port):
        h = health_pb2_grpc.HealthStub(channel)
        for service in ("", "loraplex.v1.Inference"):
            resp = await h.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        exe = require_tool("grpcurl", GRPCURL)
        out = await asyncio.to_thread(subprocess.run, [exe, "-plaintext", f"127.0.0.1:{port}", "list"],
                                      capture_output=True, text=True, timeout=30)
        assert "loraplex.v1.Inference" in out.stdout and "grpc.health.v1.Health" in out.stdout, out
        out = await asyncio.to_thread(
            subprocess.run,
            [exe, "-plaintext", "-d", '{"text": "hi", "max_new_tokens": 2}', f"127.0.0.1:{port}",
             "loraplex.v1.Inference/Generate"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "FINISH_REASON_LENGTH" in out.stdout, out

    run(_with_server(FakeEngine(), body))


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    require_tool("openssl")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-subj", "/CN=loraplex-test-ca", "-days", "1", cwd=d)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for who in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
                 "-subj", f"/CN={who}", cwd=d)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)
    return d


def test_mtls(pki):
    from inference_service.client import InferenceClient

    async def main():
        cfg = ServerConfig(listen="127.0.0.1:0", tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                           tls_client_ca=str(pki / "ca.pem"))
        running = await build_server(FakeEngine(), cfg)
        try:
            ca = (pki / "ca.pem").read_bytes()
            addr = f"localhost:{running.port}"

            def calls():
                with InferenceClient(addr, root_certificates=ca, client_cert=(pki / "client.pem").read_bytes(),
                                     client_key=(pki / "client.key").read_bytes()) as c:
                    assert c.generate_text("hi", max_new_tokens=3) == "BCD"
                with InferenceClient(addr, root_certificates=ca) as c:  # no client certificate
                    with pytest.raises(grpc.RpcError) as e:
                        c.model_info(timeout=5)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                with InferenceClient(addr) as c:  # plaintext against TLS
                    with pytest.raises(grpc.RpcError):
                        c.model_info(timeout=5)

            await asyncio.to_thread(calls)
        finally:
            await running.stop(0)

    run(main())


def test_every_engine_adapter_state_has_its_proto_value():
    """ListAdapters' states come from the generated AdapterState values; one the proto lacks is UNSPECIFIED."""
    from inference_service.frontend.grpc_proto import adapter_state
    from inference_service.lora.registry import AdapterState

    for state in AdapterState:
        assert adapter_state(state.value) == pb.AdapterState.Value(f"ADAPTER_STATE_{state.value}") != 0
    assert adapter_state("NOT_A_STATE") == pb.ADAPTER_STATE_UNSPECIFIED
