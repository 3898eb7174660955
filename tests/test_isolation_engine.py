"""Tenant isolation of the serving path, on real server subprocesses.

Each case runs one hostile call beside a victim stream (harness/isolation.py, on a resident
adapter): the victim streams across the whole call, every run with its exact tokens and never stalled
(the harness's bound), the hostile call gets its documented status code,
and afterwards the server is clean (no leak in /metrics, SERVING, no traceback in its log). One
server is shared by the cases in sequence (module fixture) to keep the file's runtime down; the
hung-staging case needs a sidecar and starts its own.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import VictimResult, assert_clean, resident_adapter, solo_run, status_of, victim_beside
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.demo_adapters import write_peft_adapter

TOKEN = "iso-engine-admin-token"
ADMIN = (("authorization", f"Bearer {TOKEN}"),)
MAX_REGISTERED = 1600
VICTIM_TOKENS = 384


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("iso-engine-adapters")
    write_peft_adapter(root / "good", seed=1)
    # Finite in the file (so it passes validation), but x·A·B overflows float32: inf, then NaN logits.
    write_peft_adapter(root / "overflow", seed=2, scale=1e18)
    return root


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory) -> Iterator[InferenceServer]:
    tmp = tmp_path_factory.mktemp("iso-engine-server")
    (tmp / "token").write_text(TOKEN)
    s = start_inference_server(
        ["--admin-token-file", str(tmp / "token"), "--adapter-source-allow", adapters.as_uri(),
         "--max-registered-adapters", str(MAX_REGISTERED)], log_dir=tmp)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(server, adapters) -> VictimResult:
    """A victim on an adapter resident in a slot: a hostile request that reached the batch's LoRA
    rows or the slots (the overflowing adapter's inf) would show in its tokens."""
    resident_adapter(server, "victim", (adapters / "good").as_uri(), token=TOKEN)
    return solo_run(server, adapter="victim", max_new_tokens=VICTIM_TOKENS)


@pytest.fixture
def stub(server) -> Iterator[pb_grpc.InferenceStub]:
    with server.channel(options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        yield pb_grpc.InferenceStub(ch)


@pytest.fixture
def refused(server) -> Iterator:
    """Sends a serialized GenerateRequest and returns the status it failed with. Attacks are built
    and serialized before the victim starts: the attacker's own client work is not what is measured."""
    with server.channel(options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        call = ch.unary_stream("/loraplex.v1.Inference/Generate", request_serializer=None,
                               response_deserializer=pb.GenerateResponse.FromString)
        yield lambda raw: status_of(lambda: list(call(raw, timeout=60)))


def _request(**fields) -> bytes:
    fields.setdefault("text", "attack")
    return pb.GenerateRequest(**fields).SerializeToString()


def _generate(stub, **fields) -> list[pb.GenerateResponse]:
    fields.setdefault("text", "attack")
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=60))


def _assert_log_bounded(server: InferenceServer, marker: str | None = None) -> None:
    """No log line holds a client's megabyte, and no client text starts a line of its own."""
    lines = server.log().splitlines()
    assert max(map(len, lines)) < 4000, "a client-sized log line"
    if marker is not None:
        assert not any(line.startswith(marker) for line in lines), "a forged log line"


# ---- per-request fault containment ------------------------------------------------------

def test_tiny_temperature_samples_greedily_beside_victim(server, base, stub):
    with victim_beside(server, base):
        out = _generate(stub, sampling=pb.SamplingParams(temperature=1e-300), max_new_tokens=16, ignore_eos=True)
    greedy = _generate(stub, max_new_tokens=16, ignore_eos=True)
    tokens = [t for m in out for t in m.token_ids]
    assert tokens == [t for m in greedy for t in m.token_ids]
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_non_finite_logits_end_only_that_request(server, base, stub, adapters):
    stub.LoadAdapter(pb.LoadAdapterRequest(name="overflow", uri=(adapters / "overflow").as_uri(), preload=True),
                     metadata=ADMIN, timeout=60)
    logged = server.log().count("non-finite")  # lines before this test's own
    with victim_beside(server, base):
        code = status_of(lambda: _generate(stub, adapter="overflow", max_new_tokens=64, ignore_eos=True))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert server.log().count("non-finite") > logged
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name="overflow"), metadata=ADMIN, timeout=60)


# ---- bounded inputs ---------------------------------------------------------------------

def test_150k_stop_strings_refused(server, base, refused):
    request = _request(stop=[f"s{i}" for i in range(150_000)])
    with victim_beside(server, base):
        code = refused(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_overlong_stop_string_refused(server, base, refused):
    request = _request(stop=["x" * 100_000])
    with victim_beside(server, base):
        code = refused(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_900k_stop_token_ids_refused(server, base, refused):
    request = _request(stop_token_ids=[7] * 900_000)
    with victim_beside(server, base):
        code = refused(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_megabyte_adapter_name_refused_and_not_logged(server, base, stub, refused, adapters):
    name = "a" * (1 << 20)
    request = _request(adapter=name)
    with victim_beside(server, base):
        assert refused(request) == grpc.StatusCode.INVALID_ARGUMENT
        code = status_of(lambda: stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, uri=(adapters / "good").as_uri()), metadata=ADMIN, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code = status_of(lambda: stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), metadata=ADMIN, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    _assert_log_bounded(server)


def test_megabyte_request_id_refused_and_not_logged(server, base, refused):
    request = _request(request_id="r" * (1 << 20))
    with victim_beside(server, base):
        code = refused(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    _assert_log_bounded(server)


def test_crlf_request_id_cannot_forge_log_lines(server, base, refused):
    request = _request(request_id="x\r\nFORGED INFO loraplex.server: admin ok")
    with victim_beside(server, base):
        code = refused(request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    _assert_log_bounded(server, marker="FORGED")


@pytest.mark.parametrize("name", ["acme@v3", "evil\u202etxt", "zero\u200bwidth"])
def test_adapter_names_outside_the_grammar_refused(server, base, stub, refused, adapters, name):
    request = _request(adapter=name)
    with victim_beside(server, base, check_clean=False):
        assert refused(request) == grpc.StatusCode.INVALID_ARGUMENT
        code = status_of(lambda: stub.LoadAdapter(
            pb.LoadAdapterRequest(name=name, uri=(adapters / "good").as_uri()), metadata=ADMIN, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert_clean(server)


def test_invalid_utf8_is_invalid_argument_and_counted(server, base):
    counted = server.value("loraplex_grpc_requests_total", method="Generate", code="INVALID_ARGUMENT")
    # GenerateRequest{text: b"\xff\xfe"}: field 3, length-delimited, not UTF-8.
    raw = b"\x1a\x02\xff\xfe"
    with server.channel() as ch, victim_beside(server, base):
        call = ch.unary_stream("/loraplex.v1.Inference/Generate", request_serializer=None,
                               response_deserializer=pb.GenerateResponse.FromString)
        assert status_of(lambda: list(call(raw, timeout=30))) == grpc.StatusCode.INVALID_ARGUMENT
        load = ch.unary_unary("/loraplex.v1.Inference/LoadAdapter", request_serializer=None,
                              response_deserializer=pb.LoadAdapterResponse.FromString)
        assert status_of(lambda: load(b"\x0a\x01\xc0", metadata=ADMIN, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    after = server.value("loraplex_grpc_requests_total", method="Generate", code="INVALID_ARGUMENT")
    assert after == counted + 1


def test_token_id_outside_vocab_refused(server, base, stub, refused):
    vocab = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
    prompt = _request(text=None, token_ids=pb.TokenIds(ids=[1, vocab, 2]))
    stop = _request(text=None, token_ids=pb.TokenIds(ids=[1]), stop_token_ids=[vocab])
    with victim_beside(server, base):
        assert refused(prompt) == grpc.StatusCode.INVALID_ARGUMENT
        assert refused(stop) == grpc.StatusCode.INVALID_ARGUMENT


def test_huge_prompts_refused_before_tokenizing(server, base, stub, refused):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    text, ids = _request(text="p" * (3 << 20)), _request(text=None, token_ids=pb.TokenIds(ids=[1] * 1_000_000))
    with victim_beside(server, base):
        assert refused(text) == grpc.StatusCode.INVALID_ARGUMENT
        assert refused(ids) == grpc.StatusCode.INVALID_ARGUMENT  # past the context: never fits, not retryable
    assert info.max_prompt_chars < 3 << 20 and info.max_context < 1_000_000


def test_model_info_reports_the_limits(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert (info.max_stop_strings, info.max_stop_string_length, info.max_stop_token_ids) == (16, 256, 64)
    assert (info.max_prompt_chars, info.max_request_id_length) == (262_144, 128)
    assert info.max_registered_adapters == MAX_REGISTERED
    assert info.adapter_name_pattern == "[A-Za-z0-9][A-Za-z0-9._-]{0,127}"


def test_model_info_reports_the_adapter_pool_and_kv_cache(server, stub):
    """The pool's and the KV cache's sizes, as the metrics count them (one source: the engine's)."""
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.lora_pool_bytes > 0 and info.lora_page_rank > 0
    assert info.lora_pool_bytes == server.value("loraplex_lora_pool_bytes")  # used + free
    assert info.max_loras >= 1 and info.max_lora_rank > 0
    assert info.kv_block_size > 0
    assert info.kv_cache_blocks == server.value("loraplex_kv_cache_blocks")  # held + cached + free


# ---- information exposure ---------------------------------------------------------------

def test_list_adapters_shows_uris_to_admins_only(server, base, stub, adapters):
    stub.LoadAdapter(pb.LoadAdapterRequest(name="listed", uri=(adapters / "good").as_uri()), metadata=ADMIN,
                     timeout=60)
    with victim_beside(server, base):
        anonymous = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters}
        wrong = stub.ListAdapters(pb.ListAdaptersRequest(), metadata=(("authorization", "Bearer no"),), timeout=30)
        admin = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest(), metadata=ADMIN,
                                                      timeout=30).adapters}
    assert anonymous["listed"].uri == "" and anonymous["listed"].state == pb.ADAPTER_STATE_REGISTERED
    assert all(a.uri == "" for a in wrong.adapters)
    assert admin["listed"].uri == (adapters / "good").as_uri()
    assert status_of(lambda: stub.ListAdapters(pb.ListAdaptersRequest(page_token="x" * 10_000), timeout=30)) == \
        grpc.StatusCode.INVALID_ARGUMENT


# ---- bounded registry, O(active) steps (last: it fills the registry) ---------------------

def _names_registered(stub) -> list[str]:
    names, token = [], ""
    while True:
        page = stub.ListAdapters(pb.ListAdaptersRequest(page_size=1000, page_token=token), timeout=30)
        names += [a.name for a in page.adapters]
        token = page.next_page_token
        if not token:
            return names


def test_1500_idle_adapters_do_not_stall_decoding_and_the_cap_holds(server, base, stub, adapters):
    """With the registry full of idle adapters, while a client pages through all of them, the victim
    streams on unharmed (how much idle adapters cost a step: bench/isolation.py)."""
    uri = (adapters / "good").as_uri()
    # The module's other tests registered a few names; idle-* are this test's own.
    others = [n for n in _names_registered(stub) if not n.startswith("idle-")]
    idle = MAX_REGISTERED - len(others)
    assert idle >= 1500

    def load(i: int) -> None:
        stub.LoadAdapter(pb.LoadAdapterRequest(name=f"idle-{i:05d}", uri=uri), metadata=ADMIN, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(load, range(idle)))
    with victim_beside(server, base):
        names = _names_registered(stub)
        first = stub.ListAdapters(pb.ListAdaptersRequest(), timeout=30)
        code = status_of(lambda: stub.LoadAdapter(pb.LoadAdapterRequest(name="one-too-many", uri=uri),
                                                  metadata=ADMIN, timeout=60))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # full of LoadAdapter names: not retryable
    assert len(names) == MAX_REGISTERED == len(set(names)) and names == sorted(names)
    assert len(first.adapters) == 100 and first.next_page_token  # bounded default page
    assert status_of(lambda: stub.ListAdapters(pb.ListAdaptersRequest(page_size=5000), timeout=30)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    # A version swap of a registered name is not a new name: the cap does not refuse it.
    stub.LoadAdapter(pb.LoadAdapterRequest(name="idle-00000", uri=(adapters / "overflow").as_uri()),
                     metadata=ADMIN, timeout=60)


# ---- a hung staging does not block other loads ------------------------------------------

class _HungOrigin:
    """An HTTP origin that accepts connections and never answers (a stuck object store)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_hung_staging_does_not_block_other_loads(inference_server_factory, adapters, tmp_path):
    from harness.sidecar import Sidecar

    origin = _HungOrigin()
    hung_prefix = f"http://127.0.0.1:{origin.port}/adapters/"
    sidecar = Sidecar(tmp_path, allow=[hung_prefix, adapters.as_uri()])
    try:
        server = inference_server_factory(
            "--cache-address", sidecar.target, "--adapter-source-allow", hung_prefix,
            "--adapter-source-allow", adapters.as_uri(), "--adapter-load-timeout-s", "3")
        base = solo_run(server, max_new_tokens=VICTIM_TOKENS)
        with server.channel() as ch:
            stub = pb_grpc.InferenceStub(ch)
            hung = stub.LoadAdapter.future(pb.LoadAdapterRequest(name="stuck", uri=hung_prefix + "a", preload=True),
                                           timeout=60)
            stuck_too = stub.LoadAdapter.future(
                pb.LoadAdapterRequest(name="stuck2", uri=hung_prefix + "b", preload=True), timeout=60)
            with victim_beside(server, base, check_clean=False):
                # The stuck origin holds both workers, yet this load (another source) completes
                # before the stuck ones' deadline frees anything.
                good = stub.LoadAdapter(pb.LoadAdapterRequest(name="good", uri=(adapters / "good").as_uri(),
                                                              preload=True), timeout=2.7)
            assert good.adapter.state == pb.ADAPTER_STATE_LOADED
            for call in (hung, stuck_too):
                with pytest.raises(grpc.RpcError) as e:
                    call.result()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
                assert "--adapter-load-timeout-s" in e.value.details()
            out = list(stub.Generate(pb.GenerateRequest(text="after", adapter="good", max_new_tokens=4), timeout=30))
            assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert_clean(server)
    finally:
        origin.close()
        sidecar.proc.terminate()
        sidecar.proc.wait(10)
