"""The OpenAI-compatible HTTP API against a real server subprocess, with the official `openai`
SDK as the client: the same greedy outputs as gRPC and the in-process engine, usage counts, SSE
streaming, adapters by `model`, vLLM's load/unload routes, the HTTP twin of every gRPC bad
input (mapped status + OpenAI error body), and no leak when a client walks away mid-stream."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import grpc
import httpx2 as httpx  # the HTTP client the openai SDK is built on
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.bad_adapters import write_admin_error_adapters
from harness.devices import SERVER_DEVICE
from harness.engine_helpers import generate, load_adapters
from harness.inference_server import start_inference_server
from harness.waiting import HANG_S, wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import SamplingParams
from inference_service.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow
TOKEN = "http-admin-token"
LIMIT = 600
MAX_MESSAGE = 64 * 1024
BASE = "builtin:tiny"
ADAPTERS = ("alpha", "beta")
LEAK_GAUGES = ("loraplex_lora_slots_referenced", "loraplex_lora_adapter_references",
               "loraplex_lora_pending_load_events", "loraplex_requests_running", "loraplex_requests_waiting",
               "loraplex_kv_cache_usage_ratio")
# A ChatML (Qwen2-style) template: the byte tokenizer of builtin:tiny has no template of its own.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PROMPTS = ("The quick brown fox", "Once upon a time", "loraplex")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    for i, name in enumerate(ADAPTERS):
        write_peft_adapter(root / name, rank=8, seed=10 + i)
    write_peft_adapter(root / "spare", rank=4, seed=20)
    write_admin_error_adapters(root, outside)
    template = root / "chatml.jinja"
    template.write_text(CHATML)
    server = start_inference_server(
        ["--model", BASE, "--max-loras", "2", "--max-lora-rank", "16", "--max-new-tokens-limit", str(LIMIT),
         "--max-message-bytes", str(MAX_MESSAGE), "--adapter-source-allow", root.as_uri(),
         "--chat-template", str(template)],
        env={"LORAPLEX_ADMIN_TOKEN": TOKEN, "LORAPLEX_SERVED_MODEL_NAME": f"{BASE},base-alias"},
        log_dir=tmp_path_factory.mktemp("http-logs"), http=True,
    )
    for name in ADAPTERS:
        r = _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(root / name)}, token=TOKEN)
        assert r.status_code == 200, r.text
    yield server, root, outside
    server.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server, path: str, body: object, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(server.http_url + path, json=body, headers=headers, timeout=60)


def _http_value(server, name: str) -> float:
    """A metric's value (summed over labels) from /metrics on the HTTP port: the same registry."""
    text = httpx.get(server.http_url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _leaks(server) -> dict[str, float]:
    return {g: _http_value(server, g) for g in LEAK_GAUGES if _http_value(server, g)}


def _wait_leak_free(server, within: float) -> dict[str, float]:
    deadline = time.monotonic() + within
    while (leaks := _leaks(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return leaks


def _grpc(server, prompt, adapter, max_new_tokens: int) -> tuple[str, list[int]]:
    with InferenceClient(server.address) as c:
        msgs = list(c.generate(prompt, adapter=adapter, max_new_tokens=max_new_tokens, ignore_eos=True, timeout=60))
    return "".join(m.text for m in msgs), [t for m in msgs for t in m.token_ids]


# ---- generation -----------------------------------------------------------------------------

def _usage(usage, finish: str) -> dict:
    return {**usage.model_dump(exclude_none=True), "finish": finish}


def _completion(server, model, prompt, stream: bool) -> tuple[str, dict]:
    client = _client(server)
    kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, _usage(r.usage, r.choices[0].finish_reason)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "usage chunk last"
    return text, _usage(chunks[-1].usage, finish[-1])


def _chat(server, model, content, stream: bool) -> tuple[str, dict]:
    client = _client(server)
    kw = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.role == "assistant"
        return r.choices[0].message.content, _usage(r.usage, r.choices[0].finish_reason)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, _usage(chunks[-1].usage, finish[-1])


def _chat_ids(content: str) -> list[int]:
    text = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return ByteTokenizer().encode(text, add_special_tokens=False)


def test_greedy_outputs_equal_grpc_and_the_in_process_engine(env):
    """Completions and chat, streamed and not, on the base model and two adapters at once."""
    server, root, _ = env
    tok = ByteTokenizer()
    jobs = {}
    with ThreadPoolExecutor(24) as pool:
        for model in (BASE, *ADAPTERS):
            for i, prompt in enumerate(PROMPTS):
                for stream in (False, True):
                    jobs[("cmpl", model, i, stream)] = pool.submit(_completion, server, model, prompt, stream)
                    jobs[("chat", model, i, stream)] = pool.submit(_chat, server, model, prompt, stream)
            jobs[("ids", model, 0, False)] = pool.submit(_completion, server, model, tok.encode(PROMPTS[0]), False)
        results = {k: f.result() for k, f in jobs.items()}

    core = EngineCore(EngineConfig(model=BASE, device=SERVER_DEVICE, max_loras=2, max_lora_rank=16))
    load_adapters(core, {name: (root / name).as_uri() for name in ADAPTERS})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    requests = {}
    for model in (BASE, *ADAPTERS):
        adapter = None if model == BASE else model
        for i, prompt in enumerate(PROMPTS):
            requests[f"cmpl-{model}-{i}"] = (tok.encode(prompt), adapter)
            requests[f"chat-{model}-{i}"] = (_chat_ids(prompt), adapter)
    in_process = generate(core, requests, params)
    core.shutdown()

    for (kind, model, i, stream), (text, usage) in results.items():
        adapter = None if model == BASE else model
        prompt_ids = _chat_ids(PROMPTS[i]) if kind == "chat" else tok.encode(PROMPTS[i])
        grpc_text, grpc_ids = _grpc(server, prompt_ids, adapter, 12)
        expected_ids = in_process[f"{'chat' if kind == 'chat' else 'cmpl'}-{model}-{i}"]
        assert grpc_ids == expected_ids, (kind, model, i)
        assert text == grpc_text, (kind, model, i, stream)
        # The same prompts run twice (streamed and not, concurrently): some find their prefix cached.
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]
        assert cached % 16 == 0 and 0 <= cached < len(prompt_ids), (kind, model, i, stream, cached)
        assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12,
                         "total_tokens": len(prompt_ids) + 12, "finish": "length"}, (kind, model, i, stream)
    # the adapters change the output: `model` really selects them
    assert len({results[("cmpl", m, 0, False)][0] for m in (BASE, *ADAPTERS)}) == 3


def test_usage_reports_prefix_cache_hits(env):
    """A prompt sent again finds its full blocks cached (but its last token, which is computed):
    OpenAI's usage.prompt_tokens_details.cached_tokens (streamed and not), gRPC's usage.cached_tokens,
    and the prefix-cache counters (ours and vLLM's names) count them; another adapter misses."""
    server = env[0]
    prompt = "A system prompt every request of this tenant repeats, long enough for a few KV blocks. "
    tok = ByteTokenizer()
    n = len(tok.encode(prompt + "turn"))
    hits_before = _http_value(server, "loraplex_prefix_cache_hits_total")
    _, first = _completion(server, ADAPTERS[0], prompt + "turn", stream=False)
    _, again = _completion(server, ADAPTERS[0], prompt + "turn", stream=True)
    _, other = _completion(server, ADAPTERS[1], prompt + "turn", stream=False)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} == other["prompt_tokens_details"]
    assert again["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}
    chat = [_chat(server, ADAPTERS[1], prompt, stream=s)[1] for s in (False, True)]
    assert chat[1]["prompt_tokens_details"]["cached_tokens"] == (len(_chat_ids(prompt)) - 1) // 16 * 16
    with InferenceClient(server.address) as c:
        msgs = list(c.generate(tok.encode(prompt + "turn"), adapter=ADAPTERS[0], max_new_tokens=3,
                               ignore_eos=True, timeout=60))
    assert msgs[-1].usage.cached_tokens == (n - 1) // 16 * 16
    hits = _http_value(server, "loraplex_prefix_cache_hits_total") - hits_before
    assert hits >= 2 * ((n - 1) // 16 * 16)
    assert _http_value(server, "vllm:prefix_cache_hits_total") == _http_value(
        server, "loraplex_prefix_cache_hits_total")
    assert _http_value(server, "loraplex_prefix_cache_queries_total") >= _http_value(
        server, "loraplex_prefix_cache_hits_total")
    assert not _wait_leak_free(server, 10), "cached blocks count as held"
    # The block counts where operators look: at rest none held, this test's blocks
    # cached, and the three states add up to the pool.
    text = httpx.get(server.http_url + "/metrics", timeout=10).text
    blocks = {s.labels["state"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "loraplex_kv_cache_blocks"}
    assert blocks["held"] == 0 and blocks["cached"] >= 2 * ((n - 1) // 16) and blocks["free"] > 0, blocks


def test_stream_deltas_and_stop_strings(env):
    server = env[0]
    client = _client(server)
    full = client.completions.create(model=BASE, prompt="abc", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    chunks = list(client.completions.create(model=BASE, prompt="abc", max_tokens=30, temperature=0, stop=[stop],
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks), "usage only when stream_options.include_usage"


def test_seeded_sampling_is_reproducible_over_http(env):
    server = env[0]
    client = _client(server)
    kw = dict(model=ADAPTERS[0], prompt="seeded", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 40})
    first, second = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert first == second
    with InferenceClient(server.address) as c:
        grpc_text = c.generate_text("seeded", adapter=ADAPTERS[0], max_new_tokens=16, temperature=0.9, top_p=0.9,
                                    top_k=40, seed=7, ignore_eos=True, timeout=60)
    assert first == grpc_text


def test_models_lists_base_and_adapters_with_parent(env):
    server = env[0]
    models = {m.id: m for m in _client(server).models.list().data}
    assert set(models) >= {BASE, *ADAPTERS}
    assert models[BASE].model_extra["parent"] is None
    assert all(models[a].model_extra["parent"] == BASE for a in ADAPTERS)
    assert models[ADAPTERS[0]].model_extra["root"] == ADAPTERS[0]  # anonymous callers never see URIs
    admin = openai.OpenAI(base_url=server.http_url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    as_admin = {m.id: m for m in admin.models.list().data}
    assert as_admin[ADAPTERS[0]].model_extra["root"].endswith("/" + ADAPTERS[0])


def test_served_model_names_all_name_the_base_model(env):
    server = env[0]
    models = {m.id: m for m in _client(server).models.list().data}
    assert models["base-alias"].model_extra["parent"] is None
    kw = dict(prompt="alias", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    client = _client(server)
    assert client.completions.create(model="base-alias", **kw).choices[0].text == \
        client.completions.create(model=BASE, **kw).choices[0].text


def _grpc_chat(server, messages: list[dict], adapter: str = "", **chat: object) -> pb.GenerateResponse:
    """Generate with a prompt given as messages, greedy; its responses merged into one."""
    request = pb.GenerateRequest(adapter=adapter, max_new_tokens=12, ignore_eos=True,
                                 messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages], **chat))
    with InferenceClient(server.address) as c:
        responses = list(c.stub.Generate(request, timeout=60))
    merged = pb.GenerateResponse(text="".join(r.text for r in responses),
                                 token_ids=[t for r in responses for t in r.token_ids])
    merged.usage.CopyFrom(responses[-1].usage)
    return merged


@pytest.mark.parametrize("model", [BASE, ADAPTERS[0]])
def test_grpc_chat_messages_use_the_http_chat_template(env, model):
    """Generate with `messages` renders the same prompt as /v1/chat/completions (same template, same
    tokens): the same prompt size and, greedy, the same answer; the conversation's roles reach it."""
    server, _, _ = env
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour: é ✓"}]
    adapter = "" if model == BASE else model
    out = _grpc_chat(server, messages, adapter)
    http = _client(server).chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert out.text == http.choices[0].message.content
    assert out.usage.prompt_tokens == http.usage.prompt_tokens == len(
        ByteTokenizer().encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour: é ✓"
                               "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
    # Without the assistant's turn opened, the prompt is shorter by exactly that opening.
    closed = _grpc_chat(server, messages, adapter, add_generation_prompt=False)
    assert closed.usage.prompt_tokens == out.usage.prompt_tokens - len("<|im_start|>assistant\n")


def test_grpc_chat_bad_messages_are_invalid_argument(env):
    server, _, _ = env
    with InferenceClient(server.address) as c:
        for chat in (pb.ChatMessages(),
                     pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")], add_generation_prompt=True,
                                     continue_final_message=True)):
            with pytest.raises(grpc.RpcError) as e:
                list(c.stub.Generate(pb.GenerateRequest(messages=chat, max_new_tokens=2), timeout=60))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()


def test_server_without_a_chat_template_and_with_max_model_len(inference_server_factory):
    server = inference_server_factory("--model", BASE, "--max-model-len", "128", http=True)
    r = _post(server, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    message = _error_of(r)["message"]
    assert "no chat template" in message and "--chat-template" in message
    with InferenceClient(server.address) as c, pytest.raises(grpc.RpcError) as e:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
        list(c.stub.Generate(pb.GenerateRequest(messages=chat), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in e.value.details()
    assert _client(server).models.list().data[0].model_extra["max_model_len"] == 128
    r = _post(server, "/v1/completions", {"model": BASE, "prompt": "x" * 120, "max_tokens": 16})
    assert r.status_code == 400 and "context" in _error_of(r)["message"]
    ok = _post(server, "/v1/completions", {"model": BASE, "prompt": "x" * 100, "max_tokens": 16})
    assert ok.status_code == 200, ok.text
    # SIGTERM drains: a stream in flight finishes (within the grace period), then the process exits 0
    body = {"model": BASE, "prompt": "drain", "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.http_url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0


def test_prefix_cache_scope_listener_keeps_grpc_and_http_apart(inference_server_factory):
    """`--prefix-cache-scope listener`: a prompt cached through gRPC misses over HTTP (and back);
    each listener still hits its own. A key that dropped the salt would hit across them."""
    server = inference_server_factory("--model", BASE, "--prefix-cache-scope", "listener",
                                      "--prefix-cache-salt", "deployment-1", http=True)
    prompt = "Tenants on two listeners never share cached KV, whatever they send. "
    ids = ByteTokenizer().encode(prompt)
    full = (len(ids) - 1) // 16 * 16

    def grpc_cached() -> int:
        with InferenceClient(server.address) as c:
            return list(c.generate(ids, max_new_tokens=2, ignore_eos=True, timeout=60))[-1].usage.cached_tokens

    def http_cached() -> int:
        return _completion(server, BASE, ids, stream=False)[1]["prompt_tokens_details"]["cached_tokens"]

    assert grpc_cached() == 0
    assert http_cached() == 0  # cached, but by the other listener
    assert http_cached() == full and grpc_cached() == full


def test_tokenize_and_detokenize(env):
    server = env[0]
    r = _post(server, "/tokenize", {"prompt": "héllo"}).json()
    assert r["tokens"] == ByteTokenizer().encode("héllo") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert _post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": False}).json()["tokens"] == [104, 105]
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == _chat_ids("hi")
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
    assert _post(server, "/detokenize", {"tokens": [999]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "model": "nope"}).status_code == 404


def test_health(env):
    assert httpx.get(env[0].http_url + "/health", timeout=10).status_code == 200


# ---- disconnects ----------------------------------------------------------------------------

def _log_has(server, needle: str, within: float = HANG_S) -> bool:
    deadline = time.monotonic() + within
    while needle not in server.log():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_client_closing_mid_stream_aborts_and_leaves_metrics_leak_free(env):
    server = env[0]
    body = {"model": ADAPTERS[1], "prompt": "long story", "max_tokens": LIMIT, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.http_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = json.loads(first[len("data: "):])["id"]
        assert _http_value(server, "loraplex_requests_running") >= 1
    # Released because it was cancelled (the log line), not because it ran to its 600 tokens; how
    # soon depends on the host, the wait only stops a hang.
    leaks = _wait_leak_free(server, within=HANG_S)
    assert not leaks, f"still held after the client left: {leaks}"
    assert _log_has(server, f"request {request_id} adapter={ADAPTERS[1]} finish=cancelled status=499")
    line = next(line for line in server.log().splitlines() if f"request {request_id} adapter=" in line)
    assert line.endswith(" tenant=anonymous"), line  # whose request it was


def test_client_leaving_a_non_streaming_request_aborts_it(env):
    server = env[0]
    body = json.dumps({"model": BASE, "prompt": "long answer", "max_tokens": LIMIT, "temperature": 0,
                       "ignore_eos": True}).encode()
    url = urlsplit(server.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: _http_value(server, "loraplex_requests_running"), "the request to run", poll_s=0.02)
    leaks = _wait_leak_free(server, within=HANG_S)  # cancelled (the log line below), not run to its end
    assert not leaks, leaks
    assert _log_has(server, "adapter=- finish=cancelled status=499")


# ---- admin routes ---------------------------------------------------------------------------

def test_load_and_unload_over_http_with_and_without_token(env):
    server, root, _ = env
    body = {"lora_name": "spare", "lora_path": str(root / "spare")}
    for token, status, kind in ((None, 401, "authentication_error"), ("wrong", 403, "permission_error")):
        r = _post(server, "/v1/load_lora_adapter", body, token=token)
        assert (r.status_code, r.json()["error"]["type"]) == (status, kind)
        r = _post(server, "/v1/unload_lora_adapter", {"lora_name": ADAPTERS[0]}, token=token)
        assert r.status_code == status
    assert "spare" not in {m.id for m in _client(server).models.list().data}
    r = _post(server, "/v1/load_lora_adapter", body, token=TOKEN)
    assert r.status_code == 200 and "spare" in r.text
    assert _post(server, "/v1/load_lora_adapter", body, token=TOKEN).status_code == 400  # no load_inplace
    assert _post(server, "/v1/load_lora_adapter", {**body, "load_inplace": True}, token=TOKEN).status_code == 200
    text = _client(server).completions.create(model="spare", prompt="hi", max_tokens=4, temperature=0).choices[0]
    assert text.finish_reason in ("length", "stop")
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "spare"}, token=TOKEN).status_code == 200
    wait_until(lambda: "spare" not in {m.id for m in _client(server).models.list().data},
               "the unloaded adapter gone from /v1/models")
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="spare", prompt="hi", max_tokens=4)


# ---- bad inputs: the HTTP twins of tests/test_server_errors.py ------------------------------

GENERATE_CASES = {
    "unknown adapter": (dict(model="nope"), 404),
    "empty prompt": (dict(prompt=""), 400),
    "empty token ids": (dict(prompt=[]), 400),
    "token id outside vocab": (dict(prompt=[1, 100000]), 400),
    "prompt longer than the context": (dict(prompt="x" * 1100, max_tokens=4), 400),
    "prompt plus new tokens over the context": (dict(prompt="x" * 1000, max_tokens=LIMIT), 400),
    "negative temperature": (dict(temperature=-0.5), 400),
    "nan temperature": (dict(temperature=float("nan")), 400),
    "nan top_p": (dict(top_p=float("nan")), 400),
    "negative top_p": (dict(top_p=-0.1), 400),
    "negative top_k": (dict(top_k=-3), 400),
    "max_tokens over the limit": (dict(max_tokens=LIMIT + 1), 400),
    "max_tokens zero": (dict(max_tokens=0), 400),
    "empty stop string": (dict(stop=[""]), 400),
    "oversized body": (dict(prompt="y" * (MAX_MESSAGE + 10)), 413),
    # HTTP-only shapes
    "n above --max-n": (dict(n=17), 400),
    "n zero": (dict(n=0), 400),
    "two prompts": (dict(prompt=["a", "b"]), 400),
    "prompt of the wrong type": (dict(prompt={"text": "hi"}), 400),
    "no model": (dict(model=None), 400),
    "seed out of range": (dict(seed=2**64), 400),
    # sampling parity fields (their gRPC twins: test_parity_bad_inputs_over_grpc)
    "frequency_penalty too large": (dict(frequency_penalty=2.5), 400),
    "presence_penalty too small": (dict(presence_penalty=-2.5), 400),
    "repetition_penalty zero": (dict(repetition_penalty=0), 400),
    "min_p above 1": (dict(min_p=1.5), 400),
    "min_tokens over max_tokens": (dict(min_tokens=5), 400),
    "logit_bias out of range": (dict(logit_bias={"65": 101}), 400),
    "logit_bias id outside vocab": (dict(logit_bias={"100000": 1}), 400),
    "logit_bias key not an id": (dict(logit_bias={"abc": 1}), 400),
}


def _error_of(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["message"], body
    return body["error"]


# Chat takes messages, not a prompt: the prompt-shape cases are completions-only (chat's own are below).
CASES = [("completions", c) for c in GENERATE_CASES] + [
    ("chat", c) for c, (changes, _) in GENERATE_CASES.items()
    if "prompt" not in changes or c in ("oversized body", "prompt longer than the context")]


@pytest.mark.parametrize("route,case", CASES)
def test_generate_errors(env, route, case):
    server = env[0]
    changes, status = GENERATE_CASES[case]
    body = {"model": BASE, "max_tokens": 4, "temperature": 0, **changes}
    if route == "chat":
        content = body.pop("prompt", "hi")
        body["messages"] = [{"role": "user", "content": content}]
        path = "/v1/chat/completions"
    else:
        body.setdefault("prompt", "hi")
        path = "/v1/completions"
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        r = httpx.post(server.http_url + path, content=json.dumps({**body, "stream": stream}),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == status, (stream, r.text)
        _error_of(r)


def test_chat_bad_messages(env):
    server = env[0]
    for messages in ([], [{"content": "no role"}], [{"role": "user", "content": [{"type": "image_url"}]}]):
        r = _post(server, "/v1/chat/completions", {"model": BASE, "messages": messages})
        assert r.status_code == 400, r.text
        _error_of(r)


def test_openai_sdk_raises_the_mapped_exceptions(env):
    client = _client(env[0])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="hi", temperature=-1)
    assert "temperature" in e.value.message


def _admin_cases(root, outside):
    good = str(root / "good-x")
    return {
        "missing admin token": (None, dict(lora_name="x", lora_path=good), 401),
        "wrong admin token": ("wrong", dict(lora_name="x", lora_path=good), 403),
        "uri outside the allowed prefixes": (TOKEN, dict(lora_name="x", lora_path=str(outside / "elsewhere")), 403),
        "other scheme outside the allow list": (TOKEN, dict(lora_name="x", lora_path="s3://bucket/adapters/x"), 403),
        "path traversal": (TOKEN, dict(lora_name="x", lora_path=root.as_uri() + "/../" + outside.name +
                                       "/elsewhere"), 403),
        "encoded path traversal": (TOKEN, dict(lora_name="x", lora_path=root.as_uri() + "/%2e%2e/" + outside.name),
                                   403),
        "rank too large": (TOKEN, dict(lora_name="x", lora_path=str(root / "rank64")), 400),
        "unparsable config": (TOKEN, dict(lora_name="x", lora_path=str(root / "bad-json")), 400),
        "truncated safetensors": (TOKEN, dict(lora_name="x", lora_path=str(root / "truncated")), 400),
        "dora": (TOKEN, dict(lora_name="x", lora_path=str(root / "dora")), 400),
        "more layers than the base model": (TOKEN, dict(lora_name="x", lora_path=str(root / "too-many-layers")),
                                            400),
        "missing files": (TOKEN, dict(lora_name="x", lora_path=str(root / "nothing-here")), 404),
        "empty name": (TOKEN, dict(lora_name="", lora_path=str(root / ADAPTERS[0])), 400),
        "the base model's name": (TOKEN, dict(lora_name=BASE, lora_path=str(root / ADAPTERS[0])), 400),
        "no path": (TOKEN, dict(lora_name="x"), 400),
        "bad sha256": (TOKEN, dict(lora_name="x", lora_path=str(root / ADAPTERS[0]), sha256="zz"), 400),
        "sha256 mismatch": (TOKEN, dict(lora_name="x", lora_path=str(root / ADAPTERS[0]), sha256="0" * 64), 400),
    }


def test_admin_errors(env):
    server, root, outside = env
    failures = []
    for case, (token, body, status) in _admin_cases(root, outside).items():
        r = _post(server, "/v1/load_lora_adapter", body, token=token)
        if r.status_code != status:
            failures.append(f"{case}: {r.status_code} != {status}: {r.text}")
        else:
            _error_of(r)
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, token=TOKEN)
    if r.status_code != 404:
        failures.append(f"unload unknown: {r.status_code}")
    assert not failures, failures
    names = {m.id for m in _client(server).models.list().data}
    assert "x" not in names  # rejected loads left nothing behind


def test_every_http_request_is_counted_by_route_template_and_code(env):
    """loraplex_http_requests_total counts refusals too (a 404 for an unknown path or model, a 400, a
    413), by the route's template: a client's paths never become label values."""
    server, _, _ = env
    count = lambda route, code: server.value("loraplex_http_requests_total", route=route, code=code)  # noqa: E731
    before = {key: count(*key) for key in (("unmatched", "404"), ("/v1/completions", "404"),
                                           ("/v1/completions", "400"), ("/v1/completions", "200"),
                                           ("/v1/completions", "413"))}
    for path in ("/no/such/path", "/v1/models/x-1?y=2", "/v1/completionz"):
        assert httpx.get(server.http_url + path, timeout=10).status_code == 404
    assert _post(server, "/v1/completions", {"model": "no-such-adapter", "prompt": "x"}).status_code == 404
    assert _post(server, "/v1/completions", {"model": BASE, "prompt": "x", "bogus": 1}).status_code == 400
    assert _post(server, "/v1/completions", {"model": BASE, "prompt": "x" * MAX_MESSAGE}).status_code == 413
    assert _post(server, "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 1}).status_code == 200
    grown = {key: count(*key) - value for key, value in before.items()}
    assert grown == {("unmatched", "404"): 3, ("/v1/completions", "404"): 1, ("/v1/completions", "400"): 1,
                     ("/v1/completions", "200"): 1, ("/v1/completions", "413"): 1}, grown
    routes = {labels for (name, labels) in server.samples() if name == "loraplex_http_requests_total"}
    assert not any("x-1" in str(labels) or "such" in str(labels) for labels in routes), routes


def test_server_healthy_and_leak_free_after_errors(env):
    server = env[0]
    for changes, _ in GENERATE_CASES.values():
        body = {k: v for k, v in {"model": BASE, "prompt": "hi", "max_tokens": 4, **changes}.items() if v is not None}
        assert httpx.post(server.http_url + "/v1/completions", content=json.dumps(body),
                          headers={"Content-Type": "application/json"}, timeout=60).status_code >= 400
    assert httpx.get(server.http_url + "/health", timeout=10).status_code == 200
    r = _client(server).completions.create(model=ADAPTERS[0], prompt="still fine", max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert not _wait_leak_free(server, within=10)
    assert server.proc.poll() is None
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_public_http_address_without_a_token_serves_with_admin_routes_disabled(tmp_path, inference_server_factory):
    """As gRPC (auth.admin_disabled_reason): off loopback with no token the server starts, generation
    works, and the admin routes are refused with how to enable them."""
    server = inference_server_factory("--http-addr", "0.0.0.0", http=True,
                                      env={"LORAPLEX_ADMIN_TOKEN": ""})
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}, token="guess")
    assert r.status_code == 403 and "admin RPCs are disabled" in r.json()["error"]["message"], r.text
    done = _client(server).completions.create(model=BASE, prompt="hi", max_tokens=2, temperature=0)
    assert done.usage.completion_tokens >= 1


def test_plain_urllib_sees_openai_error_shape(env):
    """Not only the SDK: any HTTP client gets the JSON error body and the status."""
    req = urllib.request.Request(env[0].http_url + "/v1/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


# ---- sampling parity over both APIs ---------------------------------------------------------

PARITY = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3, min_tokens=4,
              logit_bias={"101": 3.0, "32": -2.0})


def _grpc_parity(server, prompt: str, logprobs: int, **sampling) -> list:
    from inference_service.api import inference_pb2 as pb
    from inference_service.api import inference_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(text=prompt, adapter=ADAPTERS[0], max_new_tokens=10, logprobs=logprobs,
                             min_tokens=sampling.pop("min_tokens", 0), stop=sampling.pop("stop", []))
    bias = sampling.pop("logit_bias", {})
    req.sampling.CopyFrom(pb.SamplingParams(**sampling))
    for k, v in bias.items():
        req.sampling.logit_bias[int(k)] = v
    with InferenceClient(server.address) as c:
        return list(pb_grpc.InferenceStub(c.channel).Generate(req, timeout=60))


def test_sampling_parity_fields_give_the_same_output_over_http_and_grpc(env):
    server = env[0]
    r = _client(server).completions.create(
        model=ADAPTERS[0], prompt="parity", max_tokens=10, temperature=0, logprobs=3,
        frequency_penalty=PARITY["frequency_penalty"], presence_penalty=PARITY["presence_penalty"],
        logit_bias=PARITY["logit_bias"], extra_body={k: PARITY[k] for k in ("repetition_penalty", "min_tokens")})
    msgs = _grpc_parity(server, "parity", 3, **PARITY)
    assert r.choices[0].text == "".join(m.text for m in msgs)
    grpc_lps = [lp for m in msgs for lp in m.logprobs]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(grpc_lps) == 10
    assert lp.token_logprobs == pytest.approx([g.logprob for g in grpc_lps], abs=1e-6)
    assert all(len(g.top) == 3 for g in grpc_lps)
    # completions' top_logprobs is a dict by token text: byte tokens >= 0x80 keep their own keys (bytes:\x..)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert [len(t) for t in lp.tokens] and lp.text_offset[0] == 0
    plain = _client(server).completions.create(model=ADAPTERS[0], prompt="parity", max_tokens=10, temperature=0)
    assert plain.choices[0].text != r.choices[0].text, "the parity fields changed nothing"


def test_chat_logprobs_and_stop_reason(env):
    server = env[0]
    client = _client(server)
    r = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the top one
    full = client.completions.create(model=BASE, prompt="stop here", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:7]
    for stream in (False, True):
        kw = dict(model=BASE, prompt="stop here", max_tokens=30, temperature=0, stop=["\x00nope", stop],
                  extra_body={"ignore_eos": True})
        if stream:
            last = [c for c in client.completions.create(stream=True, **kw) if c.choices][-1].choices[0]
        else:
            last = client.completions.create(**kw).choices[0]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop, stream
    r = _post(server, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "x"}],
                                               "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in _error_of(r)["message"]
    r = _post(server, "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "x"}],
                                               "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400


def test_tokenize_and_detokenize_rpcs(env):
    from inference_service.api import inference_pb2 as pb
    from inference_service.api import inference_pb2_grpc as pb_grpc

    server = env[0]
    with InferenceClient(server.address) as c:
        stub = pb_grpc.InferenceStub(c.channel)
        ids = list(stub.Tokenize(pb.TokenizeRequest(text="héllo"), timeout=10).token_ids)
        assert ids == _post(server, "/tokenize", {"prompt": "héllo"}).json()["tokens"]
        bare = stub.Tokenize(pb.TokenizeRequest(text="hi", add_special_tokens=False), timeout=10).token_ids
        assert list(bare) == [104, 105]
        assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10).text == "héllo"
        shown = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=False), timeout=10).text
        assert shown == "<s>héllo"
        with pytest.raises(grpc.RpcError) as e:
            stub.Detokenize(pb.DetokenizeRequest(token_ids=[99999]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("bad", [
    dict(frequency_penalty=2.5), dict(presence_penalty=-2.5), dict(repetition_penalty=0.0), dict(min_p=1.5),
    dict(min_tokens=11), dict(logit_bias={"65": 101.0}), dict(logit_bias={"100000": 1.0}), dict(logprobs=21),
])
def test_parity_bad_inputs_over_grpc(env, bad):
    bad = dict(bad)
    logprobs = bad.pop("logprobs", 0)
    with pytest.raises(grpc.RpcError) as e:
        _grpc_parity(env[0], "x", logprobs, **bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()



def test_accepted_connections_send_without_nagle() -> None:
    """The listening socket says TCP, so asyncio sets TCP_NODELAY on every accepted connection: a
    stream's first chunk, written right after the response headers, is not held for the client's
    delayed ACK (+40 ms on each streamed request of a keep-alive connection before the fix)."""
    from inference_service.frontend.http.config import HttpConfig
    from inference_service.frontend.http.serving import _listen

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = _listen(HttpConfig(port=0))
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            result = await asyncio.wait_for(seen, 10)
            writer.close()
            return result
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1
