"""One intake: inference_service/frontend/intake.py checks what either API asks of the engine,
and its errors mean the same on both front ends (a gRPC status by name, an HTTP status from the one
table in http/errors.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import grpc
import pytest

from adapter_cache.errors import (
    InvalidArgumentError,
    LoraplexError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from adapter_cache.uri_policy import UriPolicy
from inference_service.api import inference_pb2 as pb
from inference_service.engine.request import FinishReason, RequestOutput, SamplingParams
from inference_service.engine.types import ModelInfo
from inference_service.frontend.http.errors import HTTP_STATUS, status_of
from inference_service.frontend.intake import (
    Intake,
    adapter_load,
    adapter_name,
    engine_end_error,
    optional_adapter,
    sha256_digest,
)
from inference_service.limits import RequestLimits
from inference_service.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
INFO = ModelInfo(name="t", max_context=64, vocab_size=258, max_loras=2, max_lora_rank=8, max_new_tokens_limit=32,
                 limits=RequestLimits(max_prompt_chars=40), kv_cache_blocks=16, kv_block_size=16)
DIGEST = "ab" * 32


@pytest.fixture
def intake() -> Intake:
    return Intake(INFO, ByteTokenizer(), default_max_new_tokens=16)


def test_sha256_digest():
    assert sha256_digest(None) is None and sha256_digest("") is None
    assert sha256_digest(DIGEST.upper()) == DIGEST
    for bad in ("ab", DIGEST + "a", "zz" * 32):
        with pytest.raises(InvalidArgumentError, match="sha256 must be 64 hex characters"):
            sha256_digest(bad)


def test_adapter_names_and_loads():
    assert adapter_name("acme-v1.2_x") == "acme-v1.2_x"
    assert optional_adapter("") is None and optional_adapter(None) is None
    for bad in ("", "../etc", "a b", "x" * 300):
        with pytest.raises(InvalidArgumentError):
            adapter_name(bad)
    policy = UriPolicy(("file:///srv/adapters/",))
    load = adapter_load("a", "file:///srv/adapters/a", DIGEST.upper(), policy)
    assert (load.name, load.uri, load.sha256) == ("a", "file:///srv/adapters/a", DIGEST)
    with pytest.raises(InvalidArgumentError):  # the name first, before the URI or the digest
        adapter_load("bad name", "s3://elsewhere/a", "nothex", policy)
    with pytest.raises(PermissionDeniedError):  # then the URI, before the digest
        adapter_load("a", "s3://elsewhere/a", "nothex", policy)


def test_from_grpc(intake):
    request = pb.GenerateRequest(request_id="r1", adapter="acme", text="hi", max_new_tokens=4, stop=["."])
    request.sampling.temperature = 0.5
    got = intake.from_grpc(request)
    assert (got.request_id, got.adapter, got.prompt_token_ids) == ("r1", "acme", ByteTokenizer().encode("hi"))
    assert (got.params.max_new_tokens, got.params.stop, got.params.temperature) == (4, (".",), 0.5)
    default = intake.from_grpc(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), "given-id")
    assert (default.request_id, default.adapter, default.params.max_new_tokens) == ("given-id", None, 16)
    assert default.prompt_token_ids == [1, 2]


@pytest.mark.parametrize(("request_", "error"), [
    (pb.GenerateRequest(), InvalidArgumentError),  # no prompt
    (pb.GenerateRequest(text=""), InvalidArgumentError),
    (pb.GenerateRequest(text="x" * 41), InvalidArgumentError),  # --max-prompt-chars, before tokenizing
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 64)), InvalidArgumentError),  # the context: never fits
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300])), InvalidArgumentError),  # the vocabulary
    (pb.GenerateRequest(text="hi", adapter="a b"), InvalidArgumentError),
    (pb.GenerateRequest(text="hi", request_id="has space"), InvalidArgumentError),
    (pb.GenerateRequest(text="hi", max_new_tokens=33), InvalidArgumentError),  # max_new_tokens_limit
    (pb.GenerateRequest(text="hi", stop=["s"] * 1000), InvalidArgumentError),
], ids=["no-prompt", "empty", "long-text", "context", "vocab", "adapter", "request-id", "max-new", "stops"])
def test_from_grpc_refuses(intake, request_, error):
    with pytest.raises(error):
        intake.from_grpc(request_)


def test_shared_pieces(intake):
    assert intake.max_new_tokens(None, prompt_len=60) == 4  # the room the context leaves
    assert intake.max_new_tokens(None, 0) == 16 and intake.max_new_tokens(7, 60) == 7
    # Without a server default: the rest of the context (OpenAI's and vLLM's), within the limit.
    to_the_end = Intake(INFO, ByteTokenizer(), default_max_new_tokens=None)
    assert to_the_end.max_new_tokens(None, 50) == 14 and to_the_end.max_new_tokens(None, 10) == 32
    assert intake.decodable_ids([1, 2]) == [1, 2]
    with pytest.raises(InvalidArgumentError, match="at most 64 token ids"):
        intake.decodable_ids([1] * 65)
    with pytest.raises(InvalidArgumentError, match=r"token ids must be in \[0, 258\)"):
        intake.decodable_ids([-1])
    with pytest.raises(InvalidArgumentError, match="text is longer than 40 characters"):
        intake.bounded_text("x" * 41, "text")
    with pytest.raises(InvalidArgumentError, match="at most 24 new tokens"):  # the whole request against the context
        intake.engine_request([1] * 40, SamplingParams(max_new_tokens=30), None)
    assert intake.engine_request([1], SamplingParams(max_new_tokens=3), "acme").adapter == "acme"


def test_every_error_code_has_a_grpc_status_and_an_http_one():
    codes = {cls.code for cls in _subclasses(LoraplexError)}
    assert codes <= set(grpc.StatusCode.__members__)
    assert codes <= set(HTTP_STATUS)
    assert status_of(ResourceExhaustedError("prompt of 9 tokens does not fit the context of 8 tokens")) == 400
    assert status_of(ResourceExhaustedError("queue full")) == 429


def test_a_request_the_engine_ended_gets_one_error_on_both_front_ends():
    def ended(reason: FinishReason, error: Exception | None = None) -> LoraplexError:
        return engine_end_error(RequestOutput("r", [], finished=True, finish_reason=reason, error=error))

    assert (ended(FinishReason.DEADLINE).code, str(ended(FinishReason.DEADLINE))) == (
        "DEADLINE_EXCEEDED", "request deadline")
    assert ended(FinishReason.CANCELLED).code == "CANCELLED"
    gone = UnavailableError("the engine core process has exited")
    assert ended(FinishReason.ERROR, gone) is gone
    bug = ended(FinishReason.ERROR, RuntimeError("secret detail"))
    assert (bug.code, str(bug)) == ("INTERNAL", "request error")  # a bug's text is not shown to clients


def _subclasses(cls: type) -> set[type]:
    return {cls} | {s for sub in cls.__subclasses__() for s in _subclasses(sub)}


def _calls(name: str) -> list[str]:
    found = []
    for path in sorted((ROOT / "inference_service").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == name
                                               or getattr(node.func, "attr", None) == name):
                found.append(str(path.relative_to(ROOT)))
    return found


def test_names_and_digests_are_checked_in_the_intake_alone():
    assert _calls("check_adapter_name") == ["inference_service/limits.py"]  # in limits.adapter_name, used by all
    digest_checks = [str(p.relative_to(ROOT)) for p in (ROOT / "inference_service").rglob("*.py")
                     if "0123456789abcdef" in p.read_text()]
    assert digest_checks == ["inference_service/frontend/intake.py"]


@pytest.fixture
def check_counts(monkeypatch) -> dict[str, int]:
    """How often stop conditions and sampling ranges are checked: every module's `check_stop` and
    `SamplingParams.validate` wrapped with a counter (the real checks still run)."""
    import sys

    counts = {"stop": 0, "params": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    for module in [m for name, m in list(sys.modules.items()) if name.startswith("inference_service")]:
        if callable(getattr(module, "check_stop", None)):
            monkeypatch.setattr(module, "check_stop", counted(module.check_stop, "stop"))
    monkeypatch.setattr(SamplingParams, "validate", counted(SamplingParams.validate, "params"))
    return counts


def test_the_front_door_checks_a_grpc_request_once(intake, check_counts):
    request = pb.GenerateRequest(text="hi", max_new_tokens=4, stop=[".", "!"], stop_token_ids=[3])
    request.sampling.temperature = 0.5
    intake.from_grpc(request)
    assert check_counts == {"stop": 1, "params": 1}


def test_the_front_door_checks_an_http_request_once(check_counts):
    from types import SimpleNamespace

    from inference_service.frontend.http.mapping import OpenAIMapping
    from inference_service.frontend.http.protocol import CompletionRequest

    mapping = OpenAIMapping(SimpleNamespace(model_info=INFO, tokenizer=ByteTokenizer()), ("base",), 16, None)
    request = mapping.prepare(CompletionRequest(model="base", prompt="hi", max_tokens=4, stop=[".", "!"]), "cmpl-1")
    assert (request.request_id, request.params.stop) == ("cmpl-1", (".", "!"))
    assert check_counts == {"stop": 1, "params": 1}
