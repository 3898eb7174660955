"""The engine's memory: a budget from the memory the machine has available, split so that the context
the server advertises always fits one request, and a request that can never fit refused with the
real limit (HTTP 400 / INVALID_ARGUMENT, never a retryable 429) on both front ends."""

from __future__ import annotations

import grpc
import httpx2 as httpx  # the HTTP client the openai SDK is built on
import pytest
import torch

from harness.inference_server import start_inference_server
from inference_service.client import InferenceClient
from inference_service.engine import memory
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.lora.mem_pool import bytes_per_page, pages_for
from inference_service.models.loader import BUILTIN_TINY, builtin_tiny_config

CPU = torch.device("cpu")
CONTEXT = builtin_tiny_config().max_position_embeddings  # 1024
PER_BLOCK = kv_bytes_per_block(builtin_tiny_config(), 16, torch.float32)
SMALL_KV_BLOCKS = 40  # a KV cache of 640 tokens, less than the model's context


def test_default_budget_is_a_share_of_the_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 400 << 20)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    budget, how = memory.default_budget(CPU)
    assert budget == 100 << 20 and "MemAvailable" in how
    monkeypatch.setattr(memory, "_cgroup_room", lambda: 200 << 20)  # a container: its limit less its usage
    budget, how = memory.default_budget(CPU)
    assert budget == 50 << 20 and "cgroup" in how


def test_cgroup_room_is_the_limit_less_the_usage(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_CGROUP", tmp_path)
    assert memory._cgroup_room() is None  # no cgroup files
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text(f"{300 << 20}\n")
    assert memory._cgroup_room() == (1 << 30) - (300 << 20)
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_room() is None


def test_engine_takes_its_budget_from_the_available_memory(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """No --memory-budget-bytes: the pool and the KV cache fit a quarter of what is available, the KV
    cache holds the whole context, and the split is logged."""
    monkeypatch.setattr(memory, "_meminfo_available", lambda: 64 << 20)
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    caplog.set_level("INFO", logger="inference_service.engine.core")
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu"))
    try:
        kv, lora = core.runner.kv, core.lora
        assert 0 < lora.slots_nbytes and lora.slots_nbytes + kv.nbytes <= 16 << 20
        assert kv.num_blocks * kv.block_size >= CONTEXT and core.model_info.max_context == CONTEXT
        assert "memory budget 16 MiB: 0.25 of 64 MiB (MemAvailable)" in caplog.text
        assert f"context {CONTEXT} tokens" in caplog.text
    finally:
        core.shutdown()


def test_the_pool_leaves_the_kv_cache_one_whole_context() -> None:
    """A budget where the pool's usual half would leave the KV cache short of the context: the pool
    takes less, and the whole context stays advertised."""
    shapes = builtin_tiny_config().lora_shapes()
    per_page = bytes_per_page(shapes, 8, torch.float32)
    context_bytes = CONTEXT // 16 * PER_BLOCK
    budget = context_bytes + (pages_for(16, 8) + 2) * per_page
    assert budget // 2 > budget - context_bytes  # half the budget would leave less than a context
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu", memory_budget_bytes=budget))
    try:
        assert core.model_info.max_context == CONTEXT
        assert core.lora.slots_nbytes + core.runner.kv.nbytes <= budget
    finally:
        core.shutdown()


def test_default_max_lora_rank_takes_rank_32_adapters() -> None:
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu", memory_budget_bytes=64 << 20))
    try:
        assert core.model_info.max_lora_rank >= 32
    finally:
        core.shutdown()


@pytest.fixture(scope="module")
def small_kv_server():
    """The real CLI with a KV cache of 640 tokens (less than the model's 1024) and the server's own
    default for max_tokens (0: the rest of the context; the harness otherwise asks for 64)."""
    server = start_inference_server(["--kv-cache-bytes", str(SMALL_KV_BLOCKS * PER_BLOCK),
                                     "--default-max-new-tokens", "0"], http=True)
    yield server
    server.stop()


def test_the_context_advertised_is_what_the_kv_cache_holds(small_kv_server) -> None:
    limit = SMALL_KV_BLOCKS * 16
    models = httpx.get(small_kv_server.http_url + "/v1/models", timeout=30).json()["data"]
    assert {m["max_model_len"] for m in models} == {limit}
    assert models[0]["root"] == BUILTIN_TINY  # the model's name, not where the server keeps it
    with InferenceClient(small_kv_server.address) as client:
        assert client.model_info().max_context == limit
    log = small_kv_server.log()
    assert f"context {limit} tokens" in log and "memory: LoRA pool" in log


def test_a_request_that_never_fits_is_400_and_invalid_argument_naming_the_limit(small_kv_server) -> None:
    limit = SMALL_KV_BLOCKS * 16
    over = [65] * (limit + 60)
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=60,
                   json={"model": BUILTIN_TINY, "prompt": over, "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and f"context of {limit} tokens" in error["message"]
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=60,
                   json={"model": BUILTIN_TINY, "prompt": [65] * (limit - 10), "max_tokens": 11})
    assert r.status_code == 400 and "at most 10 new tokens" in r.json()["error"]["message"], r.text
    with InferenceClient(small_kv_server.address) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(over, max_new_tokens=4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"context of {limit} tokens" in info.value.details()
    # the server is unharmed: a request that fits is answered
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=60,
                   json={"model": BUILTIN_TINY, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_max_tokens_omitted_runs_to_the_end_of_the_context(small_kv_server) -> None:
    limit, prompt = SMALL_KV_BLOCKS * 16, [65] * (SMALL_KV_BLOCKS * 16 - 24)
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=300,
                   json={"model": BUILTIN_TINY, "prompt": prompt, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == limit - len(prompt) == 24


def test_an_unknown_model_is_a_model_that_does_not_exist(small_kv_server) -> None:
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=60,
                   json={"model": "tiny.gguf", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "model 'tiny.gguf' does not exist" in error["message"]
    assert "adapter" not in error["message"]


def test_max_tokens_errors_name_the_fields_of_the_api(small_kv_server) -> None:
    """Over HTTP the limit is named as the request named it (max_tokens, max_completion_tokens), never
    the engine's max_new_tokens."""
    limit = SMALL_KV_BLOCKS * 16
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=60,
                   json={"model": BUILTIN_TINY, "prompt": "hi", "max_tokens": 100000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and f"max_tokens must be in [1, {limit}]" in error["message"]
    assert "max_new_tokens" not in error["message"]
    r = httpx.post(small_kv_server.http_url + "/v1/completions", timeout=60,
                   json={"model": BUILTIN_TINY, "prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
