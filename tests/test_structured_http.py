"""Structured output through the real server with real clients: the official `openai` SDK
(`chat.completions.parse` with a pydantic model, `response_format`, vLLM's `structured_outputs` as
extra body), outputs validated with `jsonschema`; a fuzz test of random schemas; refusals with their
exact status on both APIs; a hostile schema beside a victim stream (harness/isolation.py).

builtin:tiny has random weights: its logits are noise, so a valid output is the mask's doing alone.
Schemas here bound their strings and arrays so that noise ends within max_tokens.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import assert_clean, solo_run, victim_beside
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = pytest.mark.slow
BASE = "builtin:tiny"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MAX = 500
COMPILE_CPU_S = 2.0  # the server's bound on a new constraint's compile (default 5): shorter attacks here
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "ok"],
          "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                         "ok": {"type": "boolean"}}}
ITEMS = {"type": "array", "maxItems": 5, "items": {"enum": ["a", "b", 3, None]}}


def _slow_schema() -> dict:
    """Within the size bound, and minutes of compile: many properties, each a nested repetition."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"((x{{1,30}}){{1,30}}){{1,30}}{i}"}
                                             for i in range(900)}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    template = tmp / "chatml.jinja"
    template.write_text(CHATML)
    for i, name in enumerate(("ad1", "ad2")):
        write_peft_adapter(tmp / name, rank=8, seed=30 + i)
    s = start_inference_server(["--model", BASE, "--chat-template", str(template), "--max-new-tokens-limit", "600",
                                "--max-loras", "2", "--max-lora-rank", "8", "--adapter-source-allow", tmp.as_uri(),
                                "--grammar-compile-cpu-s", str(COMPILE_CPU_S)],
                               log_dir=tmp, http=True)
    for name in ("ad1", "ad2"):
        s.load_http_adapter(name, tmp / name)
    yield s
    s.stop()


def _client(server: InferenceServer) -> openai.OpenAI:
    return server.openai()


def _chat(server, **kwargs):
    kwargs.setdefault("model", BASE)
    kwargs.setdefault("messages", [{"role": "user", "content": "Answer in JSON."}])
    kwargs.setdefault("max_tokens", MAX)
    return _client(server).chat.completions.create(**kwargs)


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "INVALID_ARGUMENT", error
    return error["message"]


class Trip(BaseModel):
    city: str = Field(max_length=12)
    days: int
    ok: bool


def test_sdk_parse_with_a_pydantic_model(server):
    """The SDK's own structured-output call: the parsed object, the content valid against the schema
    the SDK sent (strict)."""
    client = _client(server)
    for seed in range(3):
        done = client.chat.completions.parse(model=BASE, messages=[{"role": "user", "content": "Plan a trip."}],
                                             response_format=Trip, max_tokens=MAX, seed=seed, temperature=1.0)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Trip)
        jsonschema.validate(json.loads(choice.message.content), Trip.model_json_schema())


class Reasoned(BaseModel):
    reasoning: str = Field(max_length=40)
    answer: int


class ReasonedBackwards(BaseModel):
    answer: int
    reasoning: str = Field(max_length=40)


def test_sdk_parse_keeps_the_schemas_key_order(server):
    """A reasoning-first schema is answered reasoning first, and the same fields declared the other way
    round are answered in that order: schemas differing only in key order are distinct constraints
    (never one cached grammar for both)."""
    client = _client(server)
    for model, order in ((Reasoned, ["reasoning", "answer"]), (ReasonedBackwards, ["answer", "reasoning"]),
                         (Reasoned, ["reasoning", "answer"])):
        done = client.chat.completions.parse(model=BASE, messages=[{"role": "user", "content": "Think, then answer."}],
                                             response_format=model, max_tokens=MAX, seed=3, temperature=1.0)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, model)
        assert list(json.loads(choice.message.content)) == order, choice.message.content


def test_response_format_json_schema_and_json_object(server):
    for adapter in (BASE, "ad1", "ad2"):
        r = _chat(server, model=adapter, seed=1, temperature=1.0, response_format={
            "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    ended = 0
    for seed in range(4):
        r = _chat(server, seed=seed, temperature=1.0, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":  # an open object of noise may not end within MAX
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            ended += 1
        else:
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX
    assert ended >= 1, "no json_object answer ended: EOS is never allowed after a complete object"  # 2 of 4 here
    assert r.choices[0].message.content.startswith("{")


def test_cut_by_max_tokens_says_length(server):
    r = _chat(server, max_tokens=4, seed=2, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.choices[0].message.content.startswith('{"')


def test_streamed_constrained_output(server):
    stream = _chat(server, stream=True, seed=3, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": "items", "schema": ITEMS}})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), ITEMS)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_structured_outputs_extension(server, route):
    cases = {"regex": (r"[A-Z][a-z]{1,6} [0-9]{2}", lambda t: re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", t)),
             "choice": (["red", "green", "blue \"quoted\""], lambda t: t in ("red", "green", 'blue "quoted"')),
             "grammar": ('root ::= "<" [a-c]+ ">"', lambda t: re.fullmatch(r"<[a-c]+>", t)),
             "json": (ITEMS, lambda t: jsonschema.validate(json.loads(t), ITEMS) is None)}
    client = _client(server)
    for kind, (value, valid) in cases.items():
        extra = {"structured_outputs": {kind: value}}
        if route == "chat":
            r = client.chat.completions.create(model="ad2", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=MAX, seed=4, temperature=1.0, extra_body=extra)
            text = r.choices[0].message.content
        else:
            r = client.completions.create(model="ad1", prompt="x", max_tokens=MAX, seed=4, temperature=1.0,
                                          extra_body=extra)
            text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", (kind, r)
        assert valid(text), (kind, text)


def test_mixed_concurrent_streams(server):
    """Constrained by two schemas, a regex, or not at all, on the base and two adapters, at once: each
    constrained answer valid, each free one as long as asked (ignore_eos)."""
    jobs = []
    for i in range(18):
        model = (BASE, "ad1", "ad2")[i % 3]
        kind = ("schema", "items", "regex", "free", "free", "free")[i % 6]
        jobs.append((i, model, kind))

    def run(job):
        i, model, kind = job
        body = {"model": model, "prompt": f"request {i}", "max_tokens": MAX, "seed": i, "temperature": 1.0}
        if kind == "free":
            body |= {"max_tokens": 60, "ignore_eos": True}
        else:
            body["structured_outputs"] = {"schema": {"json": SCHEMA}, "items": {"json": ITEMS},
                                          "regex": {"regex": "[0-9]{3}-[a-z]{3}"}}[kind]
        r = httpx.post(server.http_url + "/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return kind, r.json()["choices"][0]

    with ThreadPoolExecutor(18) as pool:
        results = list(pool.map(run, jobs))
    for kind, choice in results:
        if kind == "free":
            assert choice["finish_reason"] == "length"
            continue
        assert choice["finish_reason"] == "stop", choice
        text = choice["text"]
        if kind == "regex":
            assert re.fullmatch("[0-9]{3}-[a-z]{3}", text)
        else:
            jsonschema.validate(json.loads(text), SCHEMA if kind == "schema" else ITEMS)
    assert_clean(server)


# ---- refusals: exact statuses, the field named ------------------------------------------------------------

def test_refusals_name_the_field(server):
    post = lambda body: httpx.post(server.http_url + "/v1/chat/completions", timeout=120,  # noqa: E731
                                   json={"model": BASE, "messages": [{"role": "user", "content": "x"}], **body})
    js = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    _error(post({"response_format": {"type": "json_schema"}}), 400, "response_format.json_schema")
    _error(post({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}), 400,
           "response_format.json_schema")
    _error(post({"response_format": {"type": "yaml"}}), 400, "response_format.type")
    _error(post({"response_format": js, "structured_outputs": {"regex": "a"}}), 400, "structured_outputs")
    _error(post({"structured_outputs": {"regex": "a", "choice": ["a"]}}), 400, "structured_outputs")
    _error(post({"structured_outputs": {}}), 400, "structured_outputs")
    _error(post({"structured_outputs": {"guided_whitespace_pattern": " "}}), 400,
           "structured_outputs.guided_whitespace_pattern")
    _error(post({"structured_outputs": {"choice": []}}), 400, "structured_outputs.choice")
    assert "min_tokens" in _error(post({"response_format": js, "min_tokens": 3}), 400, None)
    deep = json.loads('{"type": "object", "properties": {"a": ' * 20 + '{"type": "string"}' + "}}" * 20)
    assert "nests" in _error(post({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": deep}}}), 400, "response_format.json_schema")
    bad_regex = post({"structured_outputs": {"regex": "(unclosed"}})
    assert "the regex cannot be used" in _error(bad_regex, 400, "structured_outputs")
    bad_grammar = post({"structured_outputs": {"grammar": "root ::= undefined_rule"}})
    assert "the grammar cannot be used" in _error(bad_grammar, 400, "structured_outputs")
    assert_clean(server)


def _compiles_logged(server: InferenceServer) -> int:
    """The front end's compiles so far: each one, whatever its end, logs one "grammar check:" line
    (frontend/grammar_check.py); a check answered from the cache logs none."""
    return server.log().count("grammar check: ")


def _post_slow_schema(server: InferenceServer) -> httpx.Response:
    return httpx.post(server.http_url + "/v1/chat/completions", timeout=120, json={
        "model": BASE, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": _slow_schema()}}})


def test_slow_schema_is_refused_at_its_cpu_bound_and_the_refusal_is_cached(server):
    """Refused by the CPU bound (the message names it; a compile cut by the wall bound instead says
    the server was busy, and is a 503), after one compile; the same schema again is answered from the
    cache: the same refusal, and no compile logged."""
    before = _compiles_logged(server)
    message = _error(_post_slow_schema(server), 400, "response_format")
    assert f"did not compile within {COMPILE_CPU_S:g} CPU seconds" in message, message
    assert _compiles_logged(server) == before + 1, server.log()[-3000:]
    assert _error(_post_slow_schema(server), 400, "response_format") == message
    assert _compiles_logged(server) == before + 1, "the refusal was not cached: the schema compiled again"
    assert_clean(server)


# ---- fuzz: random schemas, valid JSON always or a clear refusal -------------------------------------------

def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const"]
    if depth < 3:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        s: dict = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        if rng.random() < 0.2:
            s = {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]+-[A-Z]$", "^(ab|cd){1,3}$"])}
        if rng.random() < 0.1:
            s = {"type": "string", "format": rng.choice(["date", "email", "uuid"])}
        return s
    if kind == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.5:
            s |= {"minimum": -5, "maximum": rng.randint(-5, 500)}
        return s
    if kind == "number":
        return {"type": "number"}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample(["x", "y", 1, 2.5, True, None, "z\"q"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["c", 7, False])}
    if kind == "anyOf":
        return {"anyOf": [_random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "array":
        s = {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
        if rng.random() < 0.3:
            s["minItems"] = rng.randint(0, s["maxItems"])
        return s
    props = {f"k{i}": _random_schema(rng, depth + 1) for i in range(rng.randint(0, 4))}
    s = {"type": "object", "properties": props, "required": rng.sample(sorted(props), rng.randint(0, len(props))),
         "additionalProperties": False}
    if rng.random() < 0.1:
        s["minProperties"] = 1
    return s


def test_fuzz_random_schemas(server):
    """Every answer ends valid against its schema, or says length (noise may not end), or the request
    is refused with a 400 naming response_format; never a 5xx, never invalid JSON called stop."""
    rng = random.Random(34)
    schemas = [_random_schema(rng) for _ in range(40)]

    def run(item):
        i, schema = item
        r = httpx.post(server.http_url + "/v1/chat/completions", timeout=180, json={
            "model": (BASE, "ad1")[i % 2], "messages": [{"role": "user", "content": f"fuzz {i}"}], "max_tokens": MAX,
            "seed": i, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema,
                                                                       "strict": bool(i % 3)}}})
        return schema, r

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, enumerate(schemas)))
    outcomes = {"stop": 0, "length": 0, "refused": 0}
    for schema, r in results:
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "response_format", r.text
            outcomes["refused"] += 1
            continue
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        outcomes[choice["finish_reason"]] += 1
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema,
                                format_checker=jsonschema.FormatChecker())
    assert outcomes["stop"] >= 0.8 * len(schemas), outcomes
    assert_clean(server)


# ---- isolation: a hostile schema harms no other stream ----------------------------------------------------

def test_hostile_schemas_beside_a_victim(server):
    """A slow-to-compile schema (killed at its bound), a deep one, and a stream of constrained requests
    beside a victim stream: the victim's tokens unchanged and its stream never stalled (harness/isolation.py).
    The compiles run off the HTTP front end's event loop: a plain request sent while they run is
    answered before either of them."""
    base = solo_run(server, max_new_tokens=128)

    def hostile(i: int) -> httpx.Response:
        schema = {**_slow_schema(), "title": f"hostile {i}"}  # new: never a cached answer
        return httpx.post(server.http_url + "/v1/chat/completions", timeout=120, json={
            "model": BASE, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "h", "schema": schema}}})

    with victim_beside(server, base):
        with ThreadPoolExecutor(2) as pool:
            compiles = [pool.submit(hostile, i) for i in range(2)]
            plain = httpx.post(server.http_url + "/v1/completions", timeout=120, json={
                "model": BASE, "prompt": "plain", "max_tokens": 2, "ignore_eos": True})
            assert plain.status_code == 200, plain.text
            assert not any(c.done() for c in compiles), "a compile was answered before the plain request"
            refused = [c.result() for c in compiles]
        for r in refused:
            assert f"did not compile within {COMPILE_CPU_S:g} CPU seconds" in _error(r, 400, "response_format")


def test_schemas_compiling_beside_a_victim(server):
    """Schemas that compile within the bound (~0.4 CPU s each on the byte vocabulary, fresh each time so
    nothing is cached): the front end's check and then the engine's compile run while a victim streams,
    and the victim's tokens are unchanged and its stream never stalls (harness/isolation.py); each answer is valid."""
    base = solo_run(server, max_new_tokens=128)
    schema = {"type": "object", "properties": {"p0": {"type": "string", "pattern": "((x{1,30}){1,30}){1,30}0"}},
              "required": ["p0"], "additionalProperties": False}
    with victim_beside(server, base):
        for i in range(3):
            variant = {**schema, "title": f"compiled {i}"}
            r = httpx.post(server.http_url + "/v1/chat/completions", timeout=120, json={
                "model": BASE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 600,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": variant}}})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(choice["message"]["content"]), variant)


# ---- gRPC: the same constraints as sampling fields ---------------------------------------------------------

def test_grpc_constraints(server):
    with InferenceClient(server.address) as client:
        for field, value, valid in (
                ("json_schema", json.dumps(SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
                ("regex", "[a-f]{4}", lambda t: re.fullmatch("[a-f]{4}", t)),
                ("grammar", 'root ::= "x" | "yy"', lambda t: t in ("x", "yy"))):
            sampling = pb.SamplingParams(temperature=1.0, seed=5, **{field: value})
            request = pb.GenerateRequest(text="grpc", sampling=sampling, max_new_tokens=MAX)
            text = "".join(r.text for r in client.stub.Generate(request, timeout=120))
            assert valid(text), (field, text)
        sampling = pb.SamplingParams(temperature=1.0, seed=5, choice=pb.Choices(choices=["one", "two"]))
        text = "".join(r.text for r in client.stub.Generate(pb.GenerateRequest(text="g", sampling=sampling),
                                                           timeout=120))
        assert text in ("one", "two")
        sampling = pb.SamplingParams(json_object=True, seed=1, temperature=1.0)
        out = list(client.stub.Generate(pb.GenerateRequest(text="g", sampling=sampling, max_new_tokens=3),
                                        timeout=120))
        assert "".join(r.text for r in out).startswith("{")
        for sampling in (pb.SamplingParams(regex="("), pb.SamplingParams(json_schema="[1]"),
                         pb.SamplingParams(json_schema=json.dumps(_slow_schema()))):
            with pytest.raises(grpc.RpcError) as e:
                list(client.stub.Generate(pb.GenerateRequest(text="g", sampling=sampling), timeout=120))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert_clean(server)


# ---- tools: calls generated under their functions' schemas -----------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string", "maxLength": 10},
                                                                          "unit": {"enum": ["C", "F"]}}},
                                            "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def test_named_tool_choice_calls_that_function(server):
    for seed in range(3):
        r = _chat(server, seed=seed, temperature=1.0, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_required_tool_choice_calls_one_of_the_tools(server):
    names = set()
    for seed in range(6):
        r = _chat(server, model=("ad1", BASE)[seed % 2], seed=seed, temperature=1.0, tools=[WEATHER, TIME],
                  tool_choice="required", parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        names.add(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert names <= set(SCHEMAS)


def test_sdk_parse_with_a_pydantic_function_tool(server):
    client = _client(server)
    done = client.chat.completions.parse(model=BASE, messages=[{"role": "user", "content": "Book it."}],
                                         tools=[openai.pydantic_function_tool(Trip)], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=MAX, seed=7, temperature=1.0)
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "Trip" and isinstance(call.function.parsed_arguments, Trip)


def test_tool_choice_refusals(server):
    post = lambda body: httpx.post(server.http_url + "/v1/chat/completions", timeout=120,  # noqa: E731
                                   json={"model": BASE, "messages": [{"role": "user", "content": "x"}], **body})
    _error(post({"tool_choice": "required"}), 400, "tool_choice")
    _error(post({"tool_choice": "auto"}), 400, "tool_choice")
    _error(post({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}), 400,
           "tool_choice.function.name")
    _error(post({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}), 400,
           "tool_choice")
    _error(post({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"}), 400,
           "tools.0.function.name")
    _error(post({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                 "parallel": 1}), 400, "parallel")
    r = post({"tools": [WEATHER], "tool_choice": "none", "max_tokens": 3})  # a text answer
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    r = post({"tools": [WEATHER], "max_tokens": 3})  # auto, the default: free text, parsed for calls
    assert r.status_code == 200, r.text


def _streamed_calls(stream) -> tuple[str, list[dict], str]:
    """A streamed chat answer put together as the SDK's users do: content, calls by index, finish."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["named", "required"])
def test_streamed_tool_calls_through_the_sdk(server, choice):
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    stream = _chat(server, seed=4, temperature=1.0, tools=[WEATHER, TIME], tool_choice=tool_choice,
                   parallel_tool_calls=False, stream=True)
    content, calls, finish = _streamed_calls(stream)
    assert content == "" and finish == ("stop" if choice == "named" else "tool_calls")
    (call,) = calls
    assert call["id"].startswith("call_") and call["name"] in SCHEMAS
    assert choice == "required" or call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


# tool_choice auto parses the model's text; a grammar stands in for a model trained to call tools.
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Oslo|Lima)"\}\}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_models_call(server, stream):
    r = _chat(server, seed=2, temperature=1.0, tools=[WEATHER, TIME], stream=stream,
              extra_body={"structured_outputs": {"regex": "Checking[.] " + HERMES_CALL}})
    if stream:
        content, calls, finish = _streamed_calls(r)
    else:
        message, finish = r.choices[0].message, r.choices[0].finish_reason
        content = message.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert finish == "tool_calls" and content.strip() == "Checking."
    (call,) = calls
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Oslo", "Lima")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_text_that_is_no_valid_call_is_content(server, stream):
    """A call of a tool the request does not offer is not a call: the model's text comes back as content."""
    text = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    r = _chat(server, seed=2, tools=[WEATHER], stream=stream,
              extra_body={"structured_outputs": {"regex": re.escape(text)}})
    if stream:
        content, calls, finish = _streamed_calls(r)
    else:
        choice = r.choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert (content, calls or [], finish) == (text, [], "stop")


def test_agent_loop_calls_a_tool_and_answers_with_its_result(server):
    """An agent framework's loop: the model calls a tool, the tool's result goes back as a `tool`
    message after the assistant's call, and the next answer is text for the user."""
    client = _client(server)
    messages = [{"role": "user", "content": "What time is it in zone 2?"}]
    first = client.chat.completions.create(model=BASE, messages=messages, tools=[WEATHER, TIME], max_tokens=MAX,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           seed=1, temperature=1.0)
    (call,) = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS["get_time"])
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"time": "12:00", **arguments})})
    final = client.chat.completions.create(model=BASE, messages=messages, tools=[WEATHER, TIME], max_tokens=8,
                                           seed=1, temperature=1.0)
    choice = final.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + len("12:00")


def test_logprobs_under_a_constraint(server):
    """Logprobs are of the masked distribution: a token the grammar rules out shows vLLM's -9999.0
    (JSON has no -inf; the answer was a 500 before)."""
    r = httpx.post(server.http_url + "/v1/completions", timeout=120, json={
        "model": BASE, "prompt": "x", "logprobs": 5, "seed": 1, "temperature": 1.0,
        "structured_outputs": {"choice": ["ab", "c"]}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] in ("ab", "c")
    first = choice["logprobs"]["top_logprobs"][0]
    assert sorted(v for v in first.values() if v > -9999.0) == sorted(v for k, v in first.items() if k in "ac")
    assert min(first.values()) == -9999.0


@pytest.mark.parametrize("strict", [True, False])
def test_strict_decides_whether_properties_beyond_the_schema_may_follow(server, strict):
    """A schema that names no properties and leaves additionalProperties unset: with `strict` the only
    object it takes is `{}`, so after `{` the one finite next-token logprob is `}`'s; without it a
    property may begin (`"` is finite too). Read from the masked distribution's top logprobs, so the
    model's noise decides nothing."""
    r = httpx.post(server.http_url + "/v1/chat/completions", timeout=120, json={
        "model": BASE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "seed": 1,
        "logprobs": True, "top_logprobs": 5,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "o", "schema": {"type": "object", "properties": {}},
                                            "strict": strict}}})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "{"
    allowed = {t["token"] for t in content[1]["top_logprobs"] if t["logprob"] > -9999.0}
    assert allowed == ({"}"} if strict else {"}", '"'}), content[1]["top_logprobs"]
