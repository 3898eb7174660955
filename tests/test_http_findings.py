"""The HTTP API's contract at its edges, against real server subprocesses with real clients (the `openai` SDK,
httpx, http.client in hostile processes of their own):

- every field of the SDK's request params is implemented or refused by name (no silent drop);
- request-sized work (2M-id bodies and prompts, 100k-entry logit_bias) stays off the event loop
  that gRPC shares: gRPC and HTTP victim streams are unharmed while hostile clients loop;
- logprobs of tokens that are not whole UTF-8 characters keep their own bytes;
- malformed bodies, unknown routes, wrong methods and chunked oversize bodies get OpenAI's error
  body with their exact status.
"""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai SDK is built on
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from harness.inference_server import ROOT, InferenceServer, start_inference_server
from harness.isolation import STALL_S, assert_clean
from harness.models import make_checkpoint
from harness.processes import children_running
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.client import InferenceClient
from inference_service.frontend.http.protocol import IGNORED_FIELDS

pytestmark = pytest.mark.slow
BASE = "builtin:tiny"
MAX_MESSAGE = 4 * 1024 * 1024  # the CLI's default --max-message-bytes: the hostile bodies fit under it
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NON_ASCII = "Grüße aus Köln, ça va? 東京 ünïcödé"


def _server(tmp: Path, model: str = BASE) -> InferenceServer:
    template = tmp / "chatml.jinja"
    template.write_text(CHATML)
    return start_inference_server(["--model", model, "--chat-template", str(template), "--max-new-tokens-limit", "600"],
                                  log_dir=tmp, http=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = _server(tmp_path_factory.mktemp("findings"))
    yield s
    s.stop()


def _client(server: InferenceServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


# ---- no request field is silently dropped ---------------------------------------------

def _sdk_fields(params) -> set[str]:
    """Every key of the SDK's request TypedDicts (streaming and not)."""
    keys: set[str] = set()
    for td in (params.CompletionCreateParamsNonStreaming, params.CompletionCreateParamsStreaming):
        keys |= td.__required_keys__ | td.__optional_keys__
    return keys


# Implemented, with a value that changes nothing for a 2-token greedy request.
IMPLEMENTED = dict(model=BASE, max_tokens=2, temperature=0, top_p=1.0, seed=1, stop=["\x00never"],
                   frequency_penalty=0.0, presence_penalty=0.0, logit_bias={"65": 0.5}, n=1, stream=False,
                   stream_options={"include_usage": True, "include_obfuscation": False})
CHAT_IMPLEMENTED = dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, logprobs=True,
                        top_logprobs=2, response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=True,
                        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
# Implemented and tested with constraints in tests/test_structured_http.py: response_format (chat's
# json_object, json_schema), tools with tool_choice "auto", "required" or a named function, vLLM's
# structured_outputs (both routes).
COMPLETION_IMPLEMENTED = dict(prompt="hi", logprobs=2, echo=False, best_of=1)
IGNORED = dict(user="u", metadata={"k": "v"}, store=False, service_tier="auto", safety_identifier="s",
               prompt_cache_key="k", prompt_cache_retention="24h", prompt_cache_options={"mode": "explicit"})
# Refused, with a value that would change the output (any value of an undeclared field is refused).
REFUSED = dict(
    response_format={"type": "json_object"}, tools=[{"type": "function", "function": {"name": "f"}}],
    tool_choice="auto", functions=[{"name": "f"}], function_call="auto", parallel_tool_calls=False,
    audio={"voice": "alloy", "format": "wav"}, modalities=["text", "audio"], prediction={"type": "content",
                                                                                          "content": "x"},
    reasoning_effort="low", verbosity="low", web_search_options={}, moderation={"model": "x"},
    echo=True, suffix="tail",
    n=0, best_of=2,  # n is implemented (tests/test_samples_api.py): refused outside 1..--max-n; best_of unless == n
    # not OpenAI's: vLLM's structured-output fields, and a typo
    guided_json={"type": "object"}, guided_regex="a+", guided_choice=["a"], guided_grammar="root ::= 'a'",
    temprature=0.5,
)


def _create(server: InferenceServer, chat: bool, fields: dict):
    client = _client(server)
    kwargs = {**IMPLEMENTED, **(CHAT_IMPLEMENTED if chat else COMPLETION_IMPLEMENTED), "stream": False}
    sdk = _sdk_fields(chat_params if chat else completion_params)
    kwargs |= {k: v for k, v in fields.items() if k in sdk}
    extra = {k: v for k, v in fields.items() if k not in sdk}
    create = client.chat.completions.create if chat else client.completions.create
    return create(**kwargs, extra_body=extra or None)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_sdk_field_is_implemented_or_refused_by_name(server, chat):
    """Walks the openai SDK's own request params: each one is implemented, accepted as a documented
    no-op (IGNORED_FIELDS), or refused with a 400 naming it; so are vLLM's structured-output fields
    and typos. A field a newer SDK adds falls into the last group unless it is implemented."""
    sdk = _sdk_fields(chat_params if chat else completion_params)
    accepted = set(IMPLEMENTED) | set(CHAT_IMPLEMENTED if chat else COMPLETION_IMPLEMENTED) | set(IGNORED)
    assert set(IGNORED) == set(IGNORED_FIELDS)
    r = _create(server, chat, {})  # everything implemented at once
    assert r.usage.completion_tokens >= 1
    for name in sorted(sdk & set(IGNORED)):
        assert _create(server, chat, {name: IGNORED[name]}).usage.completion_tokens >= 1, name
    failures = []
    # Every SDK field not accepted, every non-SDK one listed, and those refused at some values.
    refused = (sdk - accepted) | (set(REFUSED) - sdk) | ({"n", "echo", "best_of", "suffix"} & sdk)
    for name in sorted(refused):
        value = REFUSED.get(name, {"a field": "this test does not know"})
        try:
            _create(server, chat, {name: value})
            failures.append(f"{name}: accepted")
        except openai.BadRequestError as e:
            error = e.response.json()["error"]
            if e.status_code != 400 or error["param"] != name or name not in error["message"]:
                failures.append(f"{name}: {e.status_code} {error}")
    assert not failures, failures


def test_text_response_format_is_the_default_and_accepted(server):
    client = _client(server)
    plain = client.completions.create(model=BASE, prompt="abc", max_tokens=5, temperature=0)
    text = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "abc"}], max_tokens=5,
                                          temperature=0, response_format={"type": "text"})
    assert plain.choices[0].text and text.choices[0].message.content is not None
    r = httpx.post(server.http_url + "/v1/chat/completions", timeout=60, json={
        "model": BASE, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}})
    assert _openai_error(r, 400)["param"] == "response_format.json_schema"  # no schema given
    r = httpx.post(server.http_url + "/tokenize", timeout=60, json={"prompt": "x", "return_token_strs": True})
    assert _openai_error(r, 400)["param"] == "return_token_strs"


# ---- OpenAI's error body for every error, exact statuses --------------------------------

def test_malformed_bodies_routes_and_methods_get_openai_error_bodies(server):
    url = server.http_url
    post = dict(headers={"Content-Type": "application/json"}, timeout=60)
    invalid_utf8 = b'{"model": "builtin:tiny", "prompt": "\xff\xfe"}'
    assert "invalid unicode" in _openai_error(httpx.post(url + "/v1/completions", content=invalid_utf8, **post),
                                              400)["message"]
    deep = b'{"model": "builtin:tiny", "prompt": "x", "metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001
    assert "recursion" in _openai_error(httpx.post(url + "/v1/completions", content=deep, **post), 400)["message"]
    assert "recursion" in _openai_error(httpx.post(url + "/detokenize", content=b"[" * 100_000, **post),
                                        400)["message"]
    not_object = httpx.post(url + "/v1/chat/completions", content=b"[1, 2]", **post)
    assert "JSON object" in _openai_error(not_object, 400)["message"]
    assert _openai_error(httpx.post(url + "/v1/completions", content=b"", **post), 400)
    missing = _openai_error(httpx.get(url + "/v1/nope", timeout=60), 404)
    assert missing["code"] == "NOT_FOUND" and missing["type"] == "not_found_error"
    wrong = httpx.get(url + "/v1/completions", timeout=60)
    assert _openai_error(wrong, 405)["type"] == "invalid_request_error" and wrong.headers["allow"] == "POST"
    assert _openai_error(httpx.delete(url + "/v1/models", timeout=60), 405)


def test_chunked_body_over_the_limit_is_413(server):
    """No Content-Length to refuse up front: the limit cuts the chunked body off as it arrives."""
    def chunks():
        for _ in range(MAX_MESSAGE // 65536 + 2):
            yield b" " * 65536

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = httpx.post(server.http_url + path, content=chunks(), timeout=60,
                       headers={"Content-Type": "application/json"})
        assert r.request.headers.get("transfer-encoding") == "chunked"
        error = _openai_error(r, 413)
        assert error["code"] == "RESOURCE_EXHAUSTED" and str(MAX_MESSAGE) in error["message"]
    ok = _client(server).completions.create(model=BASE, prompt="still fine", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert "Traceback" not in server.log(), server.log()[-3000:]


def test_a_client_that_leaves_mid_body_is_logged_as_such_not_as_a_failure(server):
    """Half a body, then the socket closes: starlette's ClientDisconnect is the client's doing, not a
    server error (no "HTTP request failed" with a traceback), and the port keeps serving."""
    import socket
    import time

    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while "left before its request body arrived" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log()
    assert "left before its request body arrived" in log
    assert "HTTP request failed" not in log and "ClientDisconnect" not in log, log[-3000:]
    ok = _client(server).completions.create(model=BASE, prompt="still fine", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


# ---- logprobs of tokens that are parts of characters -----------------------------------

def _grpc_logprobs(server: InferenceServer, prompt: str | list[int], k: int, n: int) -> list:
    req = InferenceClient.request(prompt, max_new_tokens=n, ignore_eos=True)
    req.logprobs = k
    with InferenceClient(server.address) as c:
        return [lp for m in pb_grpc.InferenceStub(c.channel).Generate(req, timeout=60) for lp in m.logprobs]


def _token_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _check_logprobs(server: InferenceServer, model: str, token_bytes) -> None:
    """HTTP logprobs against gRPC's token ids on a non-ASCII prompt, greedy: every alternative keeps
    its own bytes, so completions' top_logprobs dicts keep all 20 keys and chat's `bytes` are the
    token's bytes; text_offset walks the completion's text."""
    n, k = 12, 20
    truth = _grpc_logprobs(server, NON_ASCII, k, n)
    assert len(truth) == n
    parts = [[token_bytes(t.token_id) for t in lp.top] for lp in truth]
    assert any(b.decode("utf-8", "replace") == "\ufffd" for p in parts for b in p), "the case needs partial bytes"
    client = _client(server)
    common = dict(model=model, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    for stream in (False, True):
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(prompt=NON_ASCII, logprobs=k, stream=True,
                                                                      **common) if c.choices]
            text = "".join(c.text for c in chunks)
            lps = [c.logprobs for c in chunks if c.logprobs]
            tokens = [t for lp in lps for t in lp.tokens]
            tops = [t for lp in lps for t in lp.top_logprobs]
            offsets = [o for lp in lps for o in lp.text_offset]
        else:
            choice = client.completions.create(prompt=NON_ASCII, logprobs=k, **common).choices[0]
            text, lp = choice.text, choice.logprobs
            tokens, tops, offsets = lp.tokens, lp.top_logprobs, lp.text_offset
        assert tokens == [_token_text(token_bytes(t.token_id)) for t in truth], stream
        assert [list(top) for top in tops] == [[_token_text(b) for b in p] for p in parts], stream
        assert all(len(top) == k for top in tops), stream
        # Where each token starts: the characters complete before it (a partial one is held back).
        before = [b"".join(token_bytes(t.token_id) for t in truth[:i]) for i in range(n)]
        expected_offsets = [len(codecs.getincrementaldecoder("utf-8")("replace").decode(b)) for b in before]
        assert offsets == expected_offsets and offsets[-1] <= len(text), (stream, offsets, expected_offsets)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": NON_ASCII}], logprobs=True,
                                          top_logprobs=k, **common).choices[0].logprobs.content
    messages = [{"role": "user", "content": NON_ASCII}]
    chat_ids = httpx.post(server.http_url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    chat_truth = _grpc_logprobs(server, chat_ids, k, n)
    assert [c.bytes for c in chat] == [list(token_bytes(t.token_id)) for t in chat_truth]
    assert [c.token for c in chat] == [_token_text(token_bytes(t.token_id)) for t in chat_truth]
    assert [[a.bytes for a in c.top_logprobs] for c in chat] == [
        [list(token_bytes(t.token_id)) for t in lp.top] for lp in chat_truth]


def _byte_token(token_id: int) -> bytes:
    return bytes((token_id,)) if token_id < 256 else {256: b"<s>", 257: b"</s>"}[token_id]


def test_logprobs_of_partial_characters_with_the_byte_tokenizer(server):
    _check_logprobs(server, BASE, _byte_token)


def test_logprobs_of_partial_characters_with_a_byte_level_bpe_checkpoint(tmp_path):
    """harness/models.py's checkpoint tokenizer is a byte-level BPE tokenizer.json (GPT-2's byte
    alphabet, ids 0-255 are the bytes): served through `tokenizers`, not the builtin tokenizer."""
    checkpoint = make_checkpoint(tmp_path / "ckpt", vocab_size=256)
    s = _server(tmp_path, str(checkpoint))
    try:
        _check_logprobs(s, "ckpt", lambda t: bytes((t,)))
    finally:
        s.stop()


# ---- request-sized work stays off the loop that gRPC shares ----------------------------

HOSTILE = r'''
import http.client, json, sys, threading
host, port = sys.argv[1], int(sys.argv[2])
bodies = {
    "/detokenize": b'{"tokens":[' + b",".join([b"0"] * 2_000_000) + b"]}",
    "/v1/completions": b'{"model":"builtin:tiny","max_tokens":1,"prompt":[' + b",".join([b"0"] * 2_000_000) + b"]}",
    "/v1/chat/completions": json.dumps({"model": "builtin:tiny", "messages": [{"role": "user", "content": "x"}],
                                        "logit_bias": {str(i): 1 for i in range(100_000)}}).encode(),
}
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seen = {}
conn = http.client.HTTPConnection(host, port, timeout=60)
first = True
while not stop.is_set():
    for path, body in bodies.items():
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read()).get("error") or {}
        how = "counted" if "JSON values" in (error.get("message") or "") else "parsed"
        key = f"{path} {r.status} {error.get('code')} {error.get('param')} {how}"
        seen[key] = seen.get(key, 0) + 1
    if first:
        print("looping", flush=True)
        first = False
print(json.dumps(seen), flush=True)
'''
# Refused by the count of their JSON values (the counter's message), before they are parsed on a
# thread that would hold the GIL for 0.3-0.8 s, naming the field that holds them.
EXPECTED = {"/detokenize 400 INVALID_ARGUMENT tokens counted", "/v1/completions 400 INVALID_ARGUMENT prompt counted",
            "/v1/chat/completions 400 INVALID_ARGUMENT logit_bias counted"}
# A victim stream in a process of its own (another tenant): the gaps between its messages.
VICTIM = r"""
import http.client, json, sys, time
from inference_service.client import InferenceClient
mode, target, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
stamps, made = [], 0
if mode == "grpc":
    with InferenceClient(target) as client:
        for m in client.generate("the grpc victim", max_new_tokens=tokens, ignore_eos=True, timeout=120):
            stamps.append(time.monotonic())
            made += len(m.token_ids)
else:
    host, port = target.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "builtin:tiny", "prompt": "the http victim", "max_tokens": tokens, "temperature": 0,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}),
        {"Content-Type": "application/json"})
    for line in conn.getresponse():
        if line.startswith(b"data: {"):
            stamps.append(time.monotonic())
            made = json.loads(line[6:]).get("usage", {}).get("completion_tokens", made)
gaps = [b - a for a, b in zip(stamps, stamps[1:])]
print(json.dumps({"made": made, "max_gap": max(gaps), "seconds": stamps[-1] - stamps[0]}))
"""
VICTIM_TOKENS = 512


def _victims(server: InferenceServer) -> dict[str, dict]:
    """A gRPC and an HTTP victim stream at once, each in its own process."""
    targets = {"grpc": server.address, "http": server.http_url.removeprefix("http://")}
    procs = {mode: subprocess.Popen([sys.executable, "-c", VICTIM, mode, target, str(VICTIM_TOKENS)],
                                    stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
             for mode, target in targets.items()}
    results = {}
    for mode, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"the {mode} victim failed"
        results[mode] = json.loads(out)
        assert results[mode]["made"] == VICTIM_TOKENS, results[mode]
    return results


def test_hostile_request_sized_bodies_do_not_stall_grpc_or_http_streams(server):
    """Four clients loop 2M-id /detokenize bodies, 2M-id prompts and 100k-entry logit_bias (each
    under the 4 MiB body limit) while a gRPC and an HTTP stream run: every hostile request gets its
    exact status, refused by the count of its values before any parse (the counter's own message), and
    neither stream pauses beyond the harness's stall bound (before, each body was parsed and validated
    on the loop both APIs share: every stream stopped for its whole parse)."""
    host, port = server.http_url.removeprefix("http://").split(":")
    hostile = [subprocess.Popen([sys.executable, "-c", HOSTILE, host, port], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(4)]
    try:
        for proc in hostile:
            assert proc.stdout.readline().strip() == "looping"
        beside = _victims(server)
    finally:
        seen: dict[str, int] = {}
        for proc in hostile:
            out, _ = proc.communicate("", timeout=120)
            for key, count in json.loads(out.strip().splitlines()[-1]).items():
                seen[key] = seen.get(key, 0) + count
    assert set(seen) == EXPECTED, seen  # every hostile request got its exact status, code and param
    figures = {mode: f"max gap {beside[mode]['max_gap']:.3f}s, {beside[mode]['seconds']:.2f}s" for mode in beside}
    print(f"\n{sum(seen.values())} hostile requests; {figures}")
    assert all(beside[m]["max_gap"] < STALL_S for m in beside), figures
    assert_clean(server)


def _value_counters(server: InferenceServer) -> list[int]:
    """The pids of the server's value-counter children (http/value_count.py)."""
    return children_running(server.proc.pid, b"inference_service.frontend.http.value_count")


def test_value_counter_child_killed_is_started_again(server):
    """The counter is a process of its own: killed (out of memory, an operator), the next body that
    needs counting starts another, and nothing else notices."""
    body = {"model": BASE, "prompt": [0] * 100_000, "max_tokens": 1}
    r = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60)
    assert _openai_error(r, 400)["param"] == "prompt"
    (pid,) = _value_counters(server)
    os.kill(pid, 9)
    r = httpx.post(server.http_url + "/v1/completions", json=body, timeout=60)
    assert _openai_error(r, 400)["param"] == "prompt"
    assert _value_counters(server) not in ([], [pid])
    ok = _client(server).completions.create(model=BASE, prompt="still fine", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def _trained_byte_level(path: Path) -> Path:
    """A byte-level BPE trained on non-ASCII text: its merges make tokens that hold parts of characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([NON_ASCII * 20, "東京都 京都 東 ünïcödé ça"] * 50, trainer)
    tok.save(str(path))
    return path


def _byte_fallback(path: Path) -> Path:
    """A SentencePiece-style BPE (Metaspace, byte fallback) whose vocabulary lacks '東': it is
    spelt with <0xNN> byte pieces, each of which decodes alone to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(path))
    return path


@pytest.mark.parametrize("make", [_trained_byte_level, _byte_fallback], ids=["byte-level", "byte-fallback"])
def test_token_bytes_spell_the_text_on_real_tokenizers(tmp_path, make):
    """Each token's bytes, joined, are the text's bytes, on tokenizers whose pieces split characters;
    decode([id]) of those pieces is U+FFFD (what logprobs showed before)."""
    from inference_service.tokenizer import FileTokenizer

    tok = FileTokenizer(make(tmp_path / "tokenizer.json"), eos_token_ids=())
    # Byte-level: characters it learnt whole or in part, and ones it never saw (single bytes).
    # Byte fallback: no spaces, whose '▁' a single-token decode strips (a SentencePiece limit apart).
    text = "東京" if make is _byte_fallback else f"{NON_ASCII} 北海道"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i], skip_special_tokens=False) == "\ufffd" for i in ids), "no partial-character token"
    spelt = b"".join(tok.token_bytes(i) for i in ids)
    assert spelt == text.encode(), (spelt, text)
