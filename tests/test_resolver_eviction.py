"""--adapter-resolver at --max-registered-adapters: the registry is a cache for the resolver's
registrations. A new name unregisters the least recently used idle one (no request, no load in
flight), as vLLM's --max-cpu-loras and LoRAX do, instead of refusing every new name until a restart.
A registry that only an operator can free (LoadAdapter / preload adapters) answers a status that
clients do not retry (FAILED_PRECONDITION, HTTP 400); one whose resolver adapters are all in use
answers RESOURCE_EXHAUSTED (HTTP 429): that passes once their requests end.

Real server subprocesses, real adapter files, the real openai SDK (with its retries off, so a 429 or
400 reaches the test as the SDK's own error class)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from harness.inference_server import InferenceServer, start_inference_server
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

NAMES = ("od-1", "od-2", "od-3", "op-1", "op-2")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resolver-lru")
    for i, name in enumerate(NAMES):
        write_peft_adapter(root / "adapters" / name, rank=4, seed=90 + i)
    return root


def _start(root: Path, env: dict[str, str] | None = None) -> InferenceServer:
    base = (root / "adapters").as_uri()
    return start_inference_server(["--model", "builtin:tiny", "--max-loras", "2", "--max-registered-adapters", "2",
                                   "--adapter-source-allow", base + "/", "--adapter-resolver", base + "/{name}"],
                                  env=env, log_dir=root, http=True)


@pytest.fixture
def server(root: Path) -> Iterator[InferenceServer]:
    s = _start(root)
    yield s
    s.stop()


@pytest.fixture
def slow_server(root: Path) -> Iterator[InferenceServer]:
    """Every step 20 ms slower (the test-only hook): a long request stays in flight for seconds."""
    s = _start(root, env={"LORAPLEX_TEST_FAULT_STEP_DELAY_S": "0.02"})
    yield s
    s.stop()


def generate(server: InferenceServer, adapter: str) -> str:
    with InferenceClient(server.address) as client:
        return client.generate_text("Hello there", adapter=adapter, max_new_tokens=2, timeout=60)


def registered(server: InferenceServer) -> set[str]:
    with InferenceClient(server.address) as client:
        return {a.name for a in client.list_adapters(timeout=30)}


def sdk(server: InferenceServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_new_names_replace_the_least_recently_used_idle_ones(server: InferenceServer, root: Path) -> None:
    assert generate(server, "od-1") and generate(server, "od-2")
    assert registered(server) == {"od-1", "od-2"}
    # The registry is full: a third name takes the place of the least recently used one (od-1)...
    assert generate(server, "od-3")
    assert registered(server) == {"od-2", "od-3"}
    # ...and use counts: od-2 used again, so the next new name takes od-3's place, not od-2's.
    assert generate(server, "od-2")
    completion = sdk(server).completions.create(model="od-1", prompt="Hello", max_tokens=2)
    assert completion.usage.completion_tokens == 2
    assert registered(server) == {"od-1", "od-2"}
    # An operator's LoadAdapter of a new name makes room the same way (od-2 is now the oldest).
    with InferenceClient(server.address) as client:
        client.load_adapter("op-1", (root / "adapters" / "op-1").as_uri(), timeout=60)
    assert registered(server) == {"od-1", "op-1"}
    assert "unregistering idle on-demand adapter od-1@1" in server.log()


def test_full_of_operator_adapters_is_not_retryable(server: InferenceServer, root: Path) -> None:
    with InferenceClient(server.address) as client:
        for name in ("op-1", "op-2"):
            client.load_adapter(name, (root / "adapters" / name).as_uri(), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text("Hello", adapter="od-1", max_new_tokens=2, timeout=60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            client.load_adapter("od-2", (root / "adapters" / "od-2").as_uri(), timeout=60)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
    with pytest.raises(openai.BadRequestError) as http:
        sdk(server).completions.create(model="od-1", prompt="Hello", max_tokens=2)
    assert http.value.status_code == 400
    assert registered(server) == {"op-1", "op-2"}
    # The operator frees a name: the resolver can use it again.
    with InferenceClient(server.address) as client:
        client.unload_adapter("op-2", timeout=60)
    assert generate(server, "od-1")


def test_resolver_adapters_in_use_are_kept_and_the_refusal_is_retryable(slow_server: InferenceServer,
                                                                       root: Path) -> None:
    server = slow_server
    with InferenceClient(server.address) as client:
        client.load_adapter("op-1", (root / "adapters" / "op-1").as_uri(), timeout=60)
        # od-1 holds the other name, with a request streaming on it (ignore_eos: it runs until cancelled).
        info = client.model_info()
        stream = client.generate("Hello", adapter="od-1", ignore_eos=True, timeout=120,
                                 max_new_tokens=min(info.max_new_tokens_limit, info.max_context - 16))
        next(stream)
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text("Hello", adapter="od-2", max_new_tokens=2, timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
        with pytest.raises(openai.RateLimitError):
            sdk(server).completions.create(model="od-2", prompt="Hello", max_tokens=2)
        assert registered(server) == {"op-1", "od-1"}
        stream.cancel()
        # Its request ends within a step of the cancel; then od-1 is idle and a retry gets od-2 in.
        deadline = time.monotonic() + 30
        while {a.name: a.active_requests for a in client.list_adapters(timeout=30)}["od-1"]:
            assert time.monotonic() < deadline, "the cancelled request still holds od-1"
            time.sleep(0.05)
        assert client.generate_text("Hello", adapter="od-2", max_new_tokens=2, timeout=60)
    assert registered(server) == {"op-1", "od-2"}
