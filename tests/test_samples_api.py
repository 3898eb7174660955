"""`n` > 1 through the real server, with the official `openai` SDK and gRPC.

A request's n samples share the prompt's prefill (the samples after the first hit its cached
blocks: gRPC's per-sample usage.cached_tokens shows it), each has its own seed stream (the same
seed gives the same n outputs; the samples differ at temperature 1), usage counts the prompt once
and the completions summed, `best_of` is refused unless it equals n, n out of 1..--max-n is a 400
naming `n` (gRPC: INVALID_ARGUMENT), structured output constrains each sample, and a client that
leaves mid-stream cancels all n: every leak gauge back to zero, the server healthy.
"""

from __future__ import annotations

import json
import socket
from collections import defaultdict
from urllib.parse import urlsplit

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest

from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import assert_clean
from harness.waiting import wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow
BASE = "builtin:tiny"
ADAPTER = "ad"
MAX_N = 4
LIMIT = 600
STEP_DELAY_S = 0.02
BLOCK = 16
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "ok"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("samples")
    template = tmp / "chatml.jinja"
    template.write_text(CHATML)
    write_peft_adapter(tmp / ADAPTER, rank=8, seed=41)
    # --max-n through its environment twin. Every step lasts at least STEP_DELAY_S (the test hook), so
    # the tokens samples make before a cancel reaches them count the cancel's delay in steps of a known
    # length: on builtin:tiny alone a step takes a few ms, and a loaded host's delay of 0.6 s between the
    # client leaving and the abort let four samples pass LIMIT tokens.
    s = start_inference_server(["--model", BASE, "--chat-template", str(template), "--max-new-tokens-limit",
                                str(LIMIT), "--max-loras", "2", "--max-lora-rank", "8",
                                "--adapter-source-allow", tmp.as_uri()],
                               env={"LORAPLEX_MAX_N": str(MAX_N),
                                    "LORAPLEX_TEST_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)},
                               log_dir=tmp, http=True)
    s.load_http_adapter(ADAPTER, tmp / ADAPTER)
    yield s
    s.stop()


def _client(server: InferenceServer) -> openai.OpenAI:
    return server.openai()


def _completions(server, stream: bool, **kw) -> tuple[list[str], list[str], dict]:
    """Texts and finish reasons by choice index, and usage (streamed: from the usage chunk)."""
    client = _client(server)
    kw = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 10, "extra_body": {"ignore_eos": True}, **kw}
    if not stream:
        r = client.completions.create(**kw)
        assert [c.index for c in r.choices] == list(range(len(r.choices)))
        return [c.text for c in r.choices], [c.finish_reason for c in r.choices], r.usage.model_dump(exclude_none=True)
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for c in chunks[:-1]:
        (choice,) = c.choices  # one choice per chunk, carrying its index
        texts[choice.index] += choice.text
        if choice.finish_reason:
            assert choice.index not in finish, "one finish per choice"
            finish[choice.index] = choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    n = len(finish)
    return [texts[i] for i in range(n)], [finish[i] for i in range(n)], chunks[-1].usage.model_dump(exclude_none=True)


def _chat(server, stream: bool, **kw) -> tuple[list[str], list[str], dict]:
    client = _client(server)
    kw = {"model": BASE, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 10,
          "extra_body": {"ignore_eos": True}, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        assert [c.index for c in r.choices] == list(range(len(r.choices)))
        assert all(c.message.role == "assistant" for c in r.choices)
        return ([c.message.content for c in r.choices], [c.finish_reason for c in r.choices],
                r.usage.model_dump(exclude_none=True))
    texts: dict[int, str] = defaultdict(str)
    roles: set[int] = set()
    finish: dict[int, str] = {}
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for c in chunks[:-1]:
        (choice,) = c.choices
        if choice.delta.role == "assistant":
            roles.add(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    n = len(finish)
    assert roles == set(range(n)), "each choice opens with its role"
    return [texts[i] for i in range(n)], [finish[i] for i in range(n)], chunks[-1].usage.model_dump(exclude_none=True)


@pytest.mark.parametrize("api", [_completions, _chat], ids=["completions", "chat"])
def test_n_samples_seeded_streamed_and_not(server, api):
    """n = 3 through the SDK: three choices, indexed, each its own sample (they differ at temperature
    1), the same for the same seed, streamed or not; usage counts the completions of all three."""
    runs = {stream: api(server, stream, n=3, seed=1234, temperature=1.0) for stream in (False, True, False)}
    texts, finish, usage = runs[False]
    assert len(texts) == 3 and finish == ["length"] * 3
    assert len(set(texts)) == 3, f"samples of one request share a seed stream: {texts}"
    assert api(server, False, n=3, seed=1234, temperature=1.0)[0] == texts, "same seed, same samples"
    assert runs[True][0] == texts and runs[True][1] == finish, "streamed: the same samples by index"
    assert usage["completion_tokens"] == 3 * 10 == runs[True][2]["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + 30
    single = api(server, False, n=1, seed=1234, temperature=1.0)
    assert single[0] == texts[:1] and single[2]["prompt_tokens"] == usage["prompt_tokens"], \
        "sample 0 is n = 1 with the same seed; the prompt is counted once"
    other = api(server, False, n=3, seed=99, temperature=1.0)[0]
    assert other != texts
    greedy = api(server, False, n=2, temperature=0)[0]
    assert greedy[0] == greedy[1], "greedy samples are the same sequence"
    assert_clean(server)


def test_usage_of_n_samples(server):
    """Usage of n samples: prompt_tokens once, completion_tokens summed, the prompt's cached tokens
    once (as sample 0 found them: none for a new prompt, its full blocks when it is sent again)."""
    prompt = "A prompt of its own for the usage test, long enough for a few KV blocks of sixteen tokens."
    p = len(ByteTokenizer().encode(prompt))
    _, _, first = _completions(server, False, prompt=prompt, n=4, max_tokens=5)
    assert first["prompt_tokens"] == p and first["completion_tokens"] == 20 and first["total_tokens"] == p + 20
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    _, _, again = _completions(server, True, prompt=prompt, n=2, max_tokens=3)
    assert again["prompt_tokens"] == p and again["completion_tokens"] == 6
    assert again["prompt_tokens_details"] == {"cached_tokens": (p - 1) // BLOCK * BLOCK}


def test_samples_share_the_prompts_prefill_over_grpc(server):
    """The samples after the first find every full block of the prompt cached (computed once, by
    sample 0): each sample's final response carries its own usage and index."""
    prompt = [(11 * i) % 200 + 40 for i in range(70)]
    shared = (len(prompt) - 1) // BLOCK * BLOCK
    request = InferenceClient.request(prompt, adapter=ADAPTER, max_new_tokens=4, ignore_eos=True, n=3)
    with grpc.insecure_channel(server.address) as channel:
        msgs = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
    finals = {m.index: m for m in msgs if m.finish_reason}
    assert sorted(finals) == [0, 1, 2]
    assert [finals[i].usage.cached_tokens for i in range(3)] == [0, shared, shared]
    assert all(finals[i].usage.prompt_tokens == len(prompt) and finals[i].usage.generated_tokens == 4
               for i in range(3))
    assert all(f.finish_reason == pb.FINISH_REASON_LENGTH for f in finals.values())
    tokens = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in range(3)}
    assert tokens[0] == tokens[1] == tokens[2] and len(tokens[0]) == 4  # greedy
    assert_clean(server)


def test_seeded_samples_over_grpc_match_http(server):
    request = InferenceClient.request("Once upon a time", max_new_tokens=10, temperature=1.0, seed=1234,
                                      ignore_eos=True)
    request.n = 3
    with grpc.insecure_channel(server.address) as channel:
        msgs = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
    texts = ["".join(m.text for m in msgs if m.index == i) for i in range(3)]
    assert texts == _completions(server, False, n=3, seed=1234, temperature=1.0)[0]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_out_of_range_and_best_of_are_400s(server, route):
    base = {"model": BASE, "max_tokens": 4}
    base |= {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    cases = [({"n": 0}, "n"), ({"n": -1}, "n"), ({"n": MAX_N + 1}, "n"), ({"n": "x"}, "n")]
    if route == "/v1/completions":
        cases += [({"n": 2, "best_of": 3}, "best_of"), ({"best_of": 2}, "best_of")]
    for stream in (False, True):
        for changes, param in cases:
            r = httpx.post(server.http_url + route, json={**base, **changes, "stream": stream}, timeout=60)
            assert r.status_code == 400, (changes, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["code"] == "INVALID_ARGUMENT", (changes, error)
    if route == "/v1/completions":
        r = httpx.post(server.http_url + route, json={**base, "n": 2, "best_of": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = httpx.post(server.http_url + route, json={**base, "n": MAX_N}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N, r.text
    assert_clean(server)


def test_n_out_of_range_over_grpc(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        for n in (0, -1, MAX_N + 1):
            request = InferenceClient.request("hi", max_new_tokens=4)
            request.n = n
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (n, e.value.details())
            assert "n must be in" in e.value.details()
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_n == MAX_N


def test_structured_output_constrains_every_sample(server):
    r = _client(server).chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=400, n=3, temperature=1.0,
        seed=5, response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    assert len(r.choices) == 3
    answers = [json.loads(c.message.content) for c in r.choices]
    for answer, choice in zip(answers, r.choices, strict=True):
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(answer, SCHEMA)
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1, "each sample its own"
    assert_clean(server)


def _running(server: InferenceServer) -> float:
    return server.value("loraplex_requests_running")


class _AllSamplesCancelled:
    """Around a cancel of an n=4 request: every sample leaves the engine as cancelled, at once. None
    finishes by itself (finish reason length), and all of them together generate fewer tokens than
    one sample's max_tokens: a sample left running after the cancel would generate up to LIMIT (the
    counters are counted as each request leaves the engine, so waiting for it tells nothing)."""

    def __init__(self, server: InferenceServer) -> None:
        self.server = server

    def _finished(self) -> dict[str, float]:
        return {reason: self.server.value("loraplex_requests_finished_total", finish_reason=reason)
                for reason in ("cancelled", "length", "stop", "error")}

    def __enter__(self) -> _AllSamplesCancelled:
        self.finished, self.generated = self._finished(), self.server.value("loraplex_generation_tokens_total")
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            return
        assert_clean(self.server, timeout=5 + LIMIT * 0.2)  # long enough for a leftover sample to end by itself
        after = self._finished()
        delta = {reason: after[reason] - self.finished[reason] for reason in after}
        assert delta == {"cancelled": 4, "length": 0, "stop": 0, "error": 0}, delta
        generated = self.server.value("loraplex_generation_tokens_total") - self.generated
        assert generated < LIMIT, f"{generated} tokens generated by 4 samples cancelled early"


def test_a_client_leaving_mid_stream_cancels_all_n(server):
    body = {"model": ADAPTER, "prompt": "long story", "max_tokens": LIMIT, "temperature": 1.0, "stream": True,
            "n": 4, "ignore_eos": True}
    with _AllSamplesCancelled(server), httpx.Client(timeout=60) as http, \
            http.stream("POST", server.http_url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen: set[int] = set()
        request_id = None
        for line in lines:
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            request_id = chunk["id"]
            seen |= {c["index"] for c in chunk["choices"]}
            if seen == {0, 1, 2, 3}:
                break
        assert seen == {0, 1, 2, 3}, "every sample streams"
        assert _running(server) >= 1, "the samples were still generating"
    assert_clean(server)  # after _AllSamplesCancelled's own wait for the gauges
    wait_until(lambda: f"request {request_id} adapter={ADAPTER} finish=cancelled status=499" in server.log(),
               lambda: server.log()[-2000:])


def test_a_cancelled_grpc_call_cancels_all_n(server):
    request = InferenceClient.request("long story", adapter=ADAPTER, max_new_tokens=LIMIT, temperature=1.0,
                                      ignore_eos=True)
    request.n = 4
    with _AllSamplesCancelled(server), grpc.insecure_channel(server.address) as channel:
        call = pb_grpc.InferenceStub(channel).Generate(request, timeout=60)
        indices: set[int] = set()
        for message in call:
            indices.add(message.index)
            if len(indices) == 4:
                break
        assert _running(server) >= 1
        call.cancel()
    assert indices == {0, 1, 2, 3}
    assert_clean(server)  # after _AllSamplesCancelled's own wait for the gauges


def test_a_client_leaving_a_non_streaming_request_cancels_all_n(server):
    body = json.dumps({"model": ADAPTER, "prompt": "long answer", "max_tokens": LIMIT, "temperature": 1.0, "n": 4,
                       "ignore_eos": True}).encode()
    needle = f"adapter={ADAPTER} finish=cancelled status=499"
    before = server.log().count(needle)
    url = urlsplit(server.http_url)
    with _AllSamplesCancelled(server), socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # the leader, then its samples once its prompt is cached
        wait_until(lambda: _running(server) >= 2, "the samples to run", poll_s=0.01)
    assert_clean(server)  # after _AllSamplesCancelled's own wait for the gauges
    wait_until(lambda: server.log().count(needle) > before, lambda: server.log()[-2000:])
