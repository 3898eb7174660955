"""A sidecar whose cache is momentarily full (RESOURCE_EXHAUSTED on Stage) must not fail the adapter.

The refusal is injected with a source wrapper: a real sidecar only refuses when every cached
entry is leased at that instant, which a test cannot time reliably.
"""

from __future__ import annotations

from pathlib import Path

from adapter_cache.adapter_format import HostAdapter
from adapter_cache.errors import ResourceExhaustedError
from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, run_to_completion
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.lora.registry import AdapterState


class RefuseFirstStages:
    def __init__(self, inner, refusals: int) -> None:
        self.inner, self.refusals = inner, refusals

    def fetch(self, uri: str, sha256: str | None, host_form=None) -> HostAdapter:
        if self.refusals > 0:
            self.refusals -= 1
            raise ResourceExhaustedError("adapter cache: every entry is leased")
        return self.inner.fetch(uri, sha256, host_form)


def test_cache_full_on_stage_is_retried_not_failed(tmp_path: Path):
    core = EngineCore(EngineConfig(device="cpu", max_loras=2, max_lora_rank=8, kv_cache_bytes=4 << 20))
    adapter = write_tiny_adapter(tmp_path / "a", rank=4, seed=1)
    load_adapters(core, {"a": adapter})  # registered; no host copy kept
    core.lora._source = RefuseFirstStages(core.lora._source, refusals=2)
    core.add_request(Request("r", [256, 70, 71], SamplingParams(max_new_tokens=4, ignore_eos=True)), "a")
    outputs = run_to_completion(core, timeout=30)
    assert outputs["r"][-1].finish_reason is FinishReason.LENGTH
    assert core.lora._source.refusals == 0
    uid = core.lora.uid_of("a")
    assert core.lora.state(uid) is AdapterState.LOADED


def test_cache_full_on_load_adapter_is_reported(tmp_path: Path):
    """An admin LoadAdapter has nobody waiting: the refusal goes back to the caller."""
    core = EngineCore(EngineConfig(device="cpu", max_loras=2, max_lora_rank=8, kv_cache_bytes=4 << 20))
    core.lora._source = RefuseFirstStages(core.lora._source, refusals=1)
    future = core.lora.load_adapter("a", str(write_tiny_adapter(tmp_path / "a", rank=4, seed=1)))
    while not future.done():
        core.lora.drain()
    assert isinstance(future.exception(), ResourceExhaustedError)
    assert not core.lora._registry.versions
