"""CUDA paths: side-stream slot copies with events, page-locked staged files, the engine on a GPU.

They keep the interfaces of their CPU twins (tested everywhere else) and skip on machines
without CUDA.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from adapter_cache.adapter_format import load_adapter_dir, parse_adapter_config, parse_adapter_tensors
from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, run_to_completion
from inference_service.config import EngineConfig
from inference_service.device import CudaCopyEngine, register_host_memory, unregister_host_memory
from inference_service.engine_core import EngineCore
from inference_service.lora.mem_pool import LoRAMemoryPool
from inference_service.models.loader import builtin_tiny_config
from inference_service.request import Request, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODULES = ("q_proj", "v_proj", "down_proj")


def test_side_stream_copy_completes_through_its_event(tmp_path: Path):
    shapes = builtin_tiny_config().lora_shapes()
    adapter = load_adapter_dir(write_tiny_adapter(tmp_path / "a", rank=4, seed=1, modules=MODULES), shapes, 8)
    device = torch.device("cuda")
    pool = LoRAMemoryPool(2, 8, shapes, device, torch.float32)
    pool.buffers[(0, "k_proj")][0][1].fill_(7.0)  # stale data of a previous adapter
    engine = CudaCopyEngine(device)
    handle = engine.submit(pool.copy_into_slot(1, adapter))
    handle.wait()
    assert handle.done()
    handle.before_use()
    a, b, scaling = adapter.modules[(0, "q_proj")]
    a_buf, b_buf = pool.buffers[(0, "q_proj")]
    torch.testing.assert_close(a_buf[1, :4].cpu(), a)
    torch.testing.assert_close(b_buf[1, :, :4].cpu(), b * scaling)
    assert not a_buf[1, 4:].any() and not pool.buffers[(0, "k_proj")][0][1].any()


def test_read_only_staged_file_is_page_locked(tmp_path: Path):
    path = write_tiny_adapter(tmp_path / "a", rank=4, seed=2, modules=MODULES)
    with open(path / "adapter_model.safetensors", "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    assert register_host_memory(whole)
    try:
        config = parse_adapter_config((path / "adapter_config.json").read_bytes(), 8)
        tensors = parse_adapter_tensors(mapped, config, 8)
        name = next(iter(tensors))
        on_device = tensors[name].to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        torch.testing.assert_close(on_device.cpu(), tensors[name])
    finally:
        unregister_host_memory(whole)


def test_engine_on_cuda_matches_cpu(tmp_path: Path):
    adapters = {f"a{i}": write_tiny_adapter(tmp_path / f"a{i}", rank=4 + 2 * i, seed=i) for i in range(3)}
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, return_logits=True)
    logits = {}
    for device in ("cpu", "cuda"):
        core = EngineCore(EngineConfig(device=device, max_loras=2, max_lora_rank=8, kv_cache_bytes=4 << 20))
        load_adapters(core, adapters)
        for i, name in enumerate([*adapters, None]):
            core.add_request(Request(f"r{i}", [256, 72 + i, 101, 108], params), name)
        outputs = run_to_completion(core)
        logits[device] = {rid: torch.stack([x.cpu() for o in outs for x in (o.logits or [])])
                          for rid, outs in outputs.items()}
        assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
        core.shutdown()
    for rid, cpu_logits in logits["cpu"].items():
        torch.testing.assert_close(logits["cuda"][rid], cpu_logits, atol=1e-3, rtol=1e-3)
