"""Structured output in the engine core: a token mask per constrained row, after the adapted
forward pass, in mixed batches. The model is builtin:tiny with random weights, so its logits are
noise: every constrained output that ends is valid only because of the mask (the strongest check).

Also the front end's compile check (frontend/grammar_check.py): bounded in CPU time and memory, in a
child process that is killed and restarted, with its answers cached by content hash.
"""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from harness.engine_helpers import load_adapters, make_core, run_to_completion
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine import grammar
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.grammar import GrammarCompiler
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import FinishReason, Request, SamplingParams, WaitReason
from inference_service.frontend import grammar_check
from inference_service.frontend.grammar_check import GrammarChecker
from inference_service.models.loader import builtin_tiny_config
from inference_service.structured import GrammarSpec, choice_spec, json_schema_spec
from inference_service.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green"]}}}}
OTHER = {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "boolean"}}
PROMPT = [256, *b"Give me JSON: "]
MAX = 300


def _texts(outs, tokenizer) -> dict[str, tuple[str, FinishReason, list[int]]]:
    result = {}
    for rid, parts in outs.items():
        ids = [t for o in parts for t in o.new_token_ids]
        result[rid] = ("".join(o.text or "" for o in parts), parts[-1].finish_reason, ids)
    return result


def _specs() -> dict[str, GrammarSpec | None]:
    return {"schema": json_schema_spec(SCHEMA, strict=True), "other": json_schema_spec(OTHER),
            "regex": GrammarSpec("regex", r"[a-z]{2,5}-[0-9]{3}"), "choice": choice_spec(["yes", "no", "m\"aybe"]),
            "grammar": GrammarSpec("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), "free": None}


def _check(kind: str, text: str) -> None:
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "other":
        jsonschema.validate(json.loads(text), OTHER)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text), text
    elif kind == "choice":
        assert text in ("yes", "no", 'm"aybe'), text
    elif kind == "grammar":
        assert re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", text), text


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("a1", "a2")):
        write_peft_adapter(root / name, rank=8, seed=3 + i)
    return {name: root / name for name in ("a1", "a2")}


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_mixed_batch_each_row_follows_its_own_constraint(adapters, async_scheduling):
    """Rows constrained differently (JSON schemas, regex, choice, EBNF) or not at all, on the base
    model and two adapters, in one batch: every constrained output that ends is valid, and the free
    rows' tokens are exactly what they are in a batch with no constraint at all."""
    core = make_core(max_loras=2, async_scheduling=async_scheduling)
    load_adapters(core, adapters)
    free_params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    for adapter in (None, "a1", "a2"):
        core.add_request(Request(f"alone-{adapter}", PROMPT, free_params), adapter)
    alone = _texts(run_to_completion(core), core.tokenizer)
    for seed in range(3):
        for adapter in (None, "a1", "a2"):
            for kind, spec in _specs().items():
                params = free_params if spec is None else SamplingParams(
                    temperature=1.0, seed=seed, max_new_tokens=MAX, grammar=spec)
                core.add_request(Request(f"{kind}-{adapter}-{seed}", PROMPT, params), adapter)
    outs = _texts(run_to_completion(core), core.tokenizer)
    ended = 0
    for rid, (text, reason, ids) in outs.items():
        kind, adapter, _ = rid.split("-")
        if kind == "free":
            assert ids == alone[f"alone-{adapter}"][2], rid
            continue
        assert reason in (FinishReason.EOS, FinishReason.LENGTH), (rid, reason)
        if reason is FinishReason.EOS:
            ended += 1
            assert ids[-1] == ByteTokenizer.EOS
            bytes(ids[:-1]).decode("utf-8")  # strict: no surrogates, no partial characters
            _check(kind, text)
        else:
            assert len(ids) == MAX
    assert ended >= 0.9 * (len(outs) - 9), f"only {ended} constrained outputs ended within {MAX} tokens"
    stats = core.stats()
    assert stats.requests_running == 0 and stats.requests_waiting == {}
    core.shutdown()


def test_constraint_ends_the_request_even_with_ignore_eos_and_length_cuts_it():
    core = make_core()
    choice = choice_spec(["alpha", "beta"])
    core.add_request(Request("ignore", PROMPT, SamplingParams(temperature=1.0, seed=1, max_new_tokens=50,
                                                              ignore_eos=True, grammar=choice)), None)
    core.add_request(Request("cut", PROMPT, SamplingParams(temperature=1.0, seed=1, max_new_tokens=3,
                                                           grammar=json_schema_spec(SCHEMA))), None)
    core.add_request(Request("stop", PROMPT, SamplingParams(temperature=1.0, seed=1, max_new_tokens=MAX,
                                                            stop=('"age"',), grammar=json_schema_spec(SCHEMA))), None)
    outs = _texts(run_to_completion(core), core.tokenizer)
    assert outs["ignore"][0] in ("alpha", "beta") and outs["ignore"][1] is FinishReason.EOS
    assert outs["cut"][1] is FinishReason.LENGTH and len(outs["cut"][2]) == 3
    assert outs["cut"][0].startswith('{"')  # cut, and says so (finish length), not padded or closed
    text, reason, ids = outs["stop"]
    assert '"age"' not in text  # a stop string ends a constrained output too (cut there: documented)
    if reason is FinishReason.STOP:
        assert '"age"' in core.tokenizer.decode(ids)
    else:
        assert reason is FinishReason.EOS and '"age"' not in core.tokenizer.decode(ids)
    core.shutdown()


def test_preemption_keeps_the_matcher_in_step():
    """A constrained request preempted (KV cache full) recomputes prompt + output and goes on under
    the same grammar state: its output stays valid."""
    block_bytes = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
    core = EngineCore(EngineConfig(model="builtin:tiny", device="cpu", max_loras=2, max_lora_rank=8,
                                   kv_cache_bytes=12 * block_bytes))  # 192 tokens for 6 requests of up to 135
    long = GrammarSpec("regex", r"\[[a-z]{100,110}\]")
    for i in range(6):
        core.add_request(Request(f"r{i}", PROMPT, SamplingParams(temperature=1.0, seed=i, max_new_tokens=120,
                                                                 grammar=long)), None)
    outs = _texts(run_to_completion(core), core.tokenizer)
    assert core.scheduler.num_preemptions > 0
    for text, reason, _ in outs.values():
        assert reason is FinishReason.EOS and re.fullmatch(r"\[[a-z]{100,110}\]", text), (reason, text)
    core.shutdown()


def test_bad_constraint_in_the_engine_ends_that_request_alone():
    """Embedders that skip the front end's check: a grammar xgrammar refuses ends its request with
    INVALID_ARGUMENT; the request beside it finishes normally."""
    core = make_core()
    core.add_request(Request("bad", PROMPT, SamplingParams(max_new_tokens=5, grammar=GrammarSpec("grammar",
                                                                                                 "root ::= ("))), None)
    core.add_request(Request("good", PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True)), None)
    outs = run_to_completion(core)
    assert outs["bad"][-1].finish_reason is FinishReason.ERROR and outs["bad"][-1].error.code == "INVALID_ARGUMENT"
    assert outs["good"][-1].finish_reason is FinishReason.LENGTH
    core.shutdown()


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", "[1, 2]"), "JSON object"),
    (GrammarSpec("json_schema", "{"), "not valid JSON"),
    (GrammarSpec("choice", "[]"), "non-empty list"),
    (GrammarSpec("regex", ""), "empty"),
    (GrammarSpec("json_schema", json.dumps({"items": [{"items": {}}] * 1}) + " " * 70000), "longer than"),
    (json_schema_spec(json.loads('{"a":' * 40 + "1" + "}" * 40)), "nests"),
])
def test_spec_bounds_are_checked_before_compiling(spec, message):
    with pytest.raises(Exception) as e:
        SamplingParams(grammar=spec).validate(100)
    assert e.value.code == "INVALID_ARGUMENT" and message in str(e.value)
    with pytest.raises(Exception) as e:
        SamplingParams(grammar=choice_spec(["a"]), min_tokens=2).validate(100)
    assert "min_tokens" in str(e.value)


def _slow_schema() -> dict:
    """Within the size bound, and minutes of compile: many properties, each a nested repetition."""
    pattern = "((x{1,30}){1,30}){1,30}"
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": pattern + str(i)}
                                             for i in range(900)}}


def _count_compiles(monkeypatch) -> list[GrammarSpec]:  # noqa: ANN001
    """Records each spec a compile child is given: a check answered from the cache adds none."""
    compiled: list[GrammarSpec] = []
    real = grammar_check._CompileProcess.compile

    def compile(self, spec, waited_s):  # type: ignore[no-untyped-def]
        compiled.append(spec)
        return real(self, spec, waited_s)

    monkeypatch.setattr(grammar_check._CompileProcess, "compile", compile)
    return compiled


def test_checker_bounds_compile_time_and_restarts(monkeypatch):
    """The CPU bound fires on the child's CPU reading (injected here: each reading 0.5 s more, so
    the verdict does not wait on the host's speed, and the wall bound, 600 s, never decides): the
    child is killed, the refusal names the CPU bound and is cached (the same spec is not compiled
    again), and the next check gets a new child."""
    compiled = _count_compiles(monkeypatch)
    checker = GrammarChecker(ByteTokenizer(), 258, cpu_s=2.0, wall_s=600.0)
    try:
        assert checker.check_blocking(json_schema_spec(SCHEMA)) is None  # starts the child
        (first_child,) = [c._proc for c in checker._children if c._proc is not None]  # the one started
        slow = json_schema_spec(_slow_schema())
        assert len(slow.text) < 64 * 1024
        readings = iter(range(10**6))
        with monkeypatch.context() as patched:  # this check only: the ones below read the real CPU time
            patched.setattr(grammar_check, "_cpu_seconds", lambda pid: 0.5 * next(readings))
            error = checker.check_blocking(slow)
        assert error is not None and "did not compile within 2 CPU seconds" in error, error
        assert first_child.poll() is not None, "the child that passed the bound was not killed"
        assert checker.check_blocking(slow) == error and compiled.count(slow) == 1  # cached
        assert checker.check_blocking(GrammarSpec("regex", "(")) is not None  # xgrammar's own error
        assert checker.check_blocking(GrammarSpec("grammar", 'root ::= "a"')) is None  # a new child works
    finally:
        checker.close()


def test_checker_refuses_by_cpu_time_used_and_caches_only_that(monkeypatch):
    """The CPU bound by itself, on the real CPU reading: a wall bound far away (300 s, a hang bound)
    never decides. The refusal names the CPU bound (a wall-bound answer says the server was busy)
    and is cached: CPU time the spec really used is its own verdict."""
    compiled = _count_compiles(monkeypatch)
    checker = GrammarChecker(ByteTokenizer(), 258, cpu_s=1.0, wall_s=300.0)
    try:
        assert checker.check_blocking(json_schema_spec(SCHEMA)) is None  # starts the child
        slow = json_schema_spec(_slow_schema())
        error = checker.check_blocking(slow)
        assert error is not None and "within 1 CPU seconds" in error, error
        assert checker.check_blocking(slow) == error and compiled.count(slow) == 1  # cached
    finally:
        checker.close()


def test_checker_wall_bound_answers_busy_and_caches_nothing(monkeypatch):
    """The wall bound, on an injected clock (each reading 1 s later) and a CPU reading that never
    moves (a child given no CPU): the answer says the server was busy (UNAVAILABLE, retryable), the
    child is restarted, and nothing is cached: the same spec is compiled again, and compiles."""
    compiled = _count_compiles(monkeypatch)
    checker = GrammarChecker(ByteTokenizer(), 258, cpu_s=1.0, wall_s=20.0)
    try:
        assert checker.check_blocking(json_schema_spec(SCHEMA)) is None  # starts the child
        spec = json_schema_spec({**SCHEMA, "title": "starved"})
        ticks = iter(range(10**6))
        with monkeypatch.context() as patched:
            patched.setattr(grammar_check, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
            patched.setattr(grammar_check, "_cpu_seconds", lambda pid: 0.0)
            patched.setattr(grammar_check, "select", SimpleNamespace(select=lambda r, w, x, t: ([], [], [])))
            error = checker.check_blocking(spec)
        assert error is not None and "no CPU time to check it within 20 s" in error and "retry later" in error, error
        assert checker.check_blocking(spec) is None and compiled.count(spec) == 2  # compiled again: not cached
    finally:
        checker.close()


def test_checker_bounds_memory(monkeypatch):
    """The memory bound fires on the child's RSS reading (4 MiB more injected at each reading, with
    the CPU and wall bounds far away, so the host's speed decides nothing): the refusal names the
    bound in MiB and is cached (the spec's own verdict)."""
    compiled = _count_compiles(monkeypatch)
    checker = GrammarChecker(ByteTokenizer(), 258, cpu_s=600.0, wall_s=600.0, memory_bytes=8 << 20)
    try:
        assert checker.check_blocking(json_schema_spec(SCHEMA)) is None  # starts the child (its base RSS)
        slow = json_schema_spec(_slow_schema())
        readings, real_rss = iter(range(10**6)), grammar_check._rss
        with monkeypatch.context() as patched:
            patched.setattr(grammar_check, "_rss", lambda pid: real_rss(pid) + (4 << 20) * next(readings))
            error = checker.check_blocking(slow)
        assert error is not None and "more than 8 MiB" in error, error
        assert checker.check_blocking(slow) == error and compiled.count(slow) == 1  # cached
    finally:
        checker.close()


def test_compiled_grammars_are_kept_within_a_byte_bound(monkeypatch):
    """Each compiled grammar is measured (xgrammar's memory_size_bytes): the cache keeps what fits the
    byte bound, least recently used out first, and a grammar larger than the whole bound is not kept
    (the requests that hold it still get it). The cache is bounded before a compile's future resolves:
    a measurement held up (as a loaded host deschedules the compile thread) is still seen by the
    waiter, which once found a grammar over the bound cached (its measurement ran after it woke)."""
    specs = [json_schema_spec({**SCHEMA, "title": f"bytes {i}"}) for i in range(3)]
    probe = GrammarCompiler(ByteTokenizer(), 258)
    sizes = [probe.compile(spec).result(timeout=120).memory_size_bytes for spec in specs]
    probe.shutdown()
    assert min(sizes) > 0
    real_measured = GrammarCompiler._measured

    def held_up(self, *args):  # type: ignore[no-untyped-def]
        time.sleep(0.2)
        return real_measured(self, *args)

    monkeypatch.setattr(GrammarCompiler, "_measured", held_up)
    compiler = GrammarCompiler(ByteTokenizer(), 258, max_cached_bytes=sizes[1] + sizes[2])
    try:
        for spec in specs:
            compiler.compile(spec).result(timeout=120)
        assert compiler.cached_keys() == [specs[1].key, specs[2].key]  # the oldest went out
        assert compiler.cached_bytes == sizes[1] + sizes[2] <= compiler.max_cached_bytes
        big = json_schema_spec({"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 40}
                                                                 for i in range(40)}})
        assert compiler.compile(big).result(timeout=120).memory_size_bytes > compiler.max_cached_bytes
        assert big.key not in compiler.cached_keys() and len(compiler.cached_keys()) == 2
    finally:
        compiler.shutdown()


def test_a_slow_compile_does_not_stall_other_streams(monkeypatch):
    """A grammar whose compile takes the core's compile thread for many steps (what the front ends'
    check lets through: under its CPU bound) while other requests decode: the compile runs off the
    step, so every step meanwhile gives each other stream its next token, and the constrained request
    waits (GRAMMAR) without holding the line. How long a compile takes depends on the host, so the
    compile is held (injected) until `held_steps` steps have run beside it, then compiles for real (a
    compile run on the step would never let those steps run).
    (In wall time the compile thread shares the CPU, at a lower priority: docs/http.md, "Structured
    output".)"""
    held_steps = 12
    release = threading.Event()
    real_compile = grammar.compile_spec

    def held_compile(compiler, spec):  # type: ignore[no-untyped-def]
        if '"title":"held"' in spec.text:
            assert release.wait(300), "the test never released the compile"
        return real_compile(compiler, spec)

    monkeypatch.setattr(grammar, "compile_spec", held_compile)
    # KV room for the whole test: a preempted request would miss a step's token for another reason.
    core = EngineCore(EngineConfig(model="builtin:tiny", device="cpu", max_loras=2, max_lora_rank=8,
                                   kv_cache_bytes=128 << 20))
    free = SamplingParams(max_new_tokens=100000, ignore_eos=True)
    for i in range(4):
        core.add_request(Request(f"free{i}", PROMPT, free), None)
    for _ in range(3):
        core.step()
    core.add_request(Request("warm", PROMPT, SamplingParams(max_new_tokens=2, grammar=choice_spec(["w"]))), None)
    while "warm" in core.scheduler.requests:  # xgrammar's import (seconds) and its compiler, once
        core.step()
    slow = json_schema_spec({"type": "object", "title": "held", "properties": {"p0": {"type": "string"}}})
    core.add_request(Request("slow", PROMPT, SamplingParams(max_new_tokens=5, grammar=slow)), None)
    request = core.scheduler.requests["slow"]
    steps = 0
    free_ids = [f"free{i}" for i in range(4)]
    while request.matcher is None and not request.finished:
        outputs = {o.request_id: o for o in core.step()}
        for i, rid in enumerate(free_ids):
            assert len(outputs[rid].new_token_ids) == 1, (rid, outputs.keys())
            if outputs[rid].finished:  # the tiny model's context (1,024) is shorter than some compiles
                free_ids[i] = f"{rid}+"
                core.add_request(Request(free_ids[i], PROMPT, free), None)  # its first step samples too
        if request.matcher is None:
            assert request.wait_reason is WaitReason.GRAMMAR
        steps += 1
        if steps == held_steps:
            release.set()
        assert steps < 100_000, "the compile never finished"
    assert core.scheduler.num_preemptions == 0
    assert steps >= held_steps, f"the request was admitted after {steps} steps, its compile held for {held_steps}"
    outs = run_to_completion_except(core, {"slow"})
    assert outs["slow"][-1].finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
    core.shutdown()


def run_to_completion_except(core, wanted: set[str]) -> dict:
    """Steps until the `wanted` requests end (the others go on); their outputs."""
    outputs: dict = {}
    while any(rid in core.scheduler.requests for rid in wanted):
        for out in core.step():
            if out.request_id in wanted:
                outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_key_order_is_part_of_the_constraint():
    """The schema's key order reaches the compiled grammar (an object's properties in the order
    declared), so it is part of the cache key too."""
    first = json_schema_spec({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}})
    second = json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})
    assert first.key != second.key
    assert list(json.loads(first.text)["properties"]) == ["b", "a"]
