"""CUDA paths: side-stream slot copies with events, page-locked staged files, the engine on a GPU.

They keep the interfaces of their CPU twins (tested everywhere else) and skip, with the reason, on
machines without CUDA; scripts/gpu_check.sh runs them on a GPU.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adapter_cache.adapter_format import load_adapter_dir, parse_adapter_config, parse_adapter_tensors
from harness.adapters import write_tiny_adapter
from harness.devices import requires_cuda
from harness.engine_helpers import load_adapters, run_to_completion
from inference_service.device import CudaCopyEngine, register_host_memory, unregister_host_memory
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.lora.mem_pool import LoRAMemoryPool
from inference_service.models.loader import builtin_tiny_config

pytestmark = requires_cuda

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


def test_compute_stream_waits_on_the_copy_event():
    """The event completes only after the side stream's work, and compute ordered by `before_use`
    sees the copy: a read before it still sees the old bytes, so the ordering is the event's."""
    engine = CudaCopyEngine(torch.device("cuda"))
    src = engine.pin(torch.arange(1 << 20, dtype=torch.float32))
    dst = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()

    def copy() -> None:
        torch.cuda._sleep(100_000_000)  # ~50 ms of spinning on the side stream, then the copy
        dst.copy_(src, non_blocking=True)

    handle = engine.submit(copy)
    early = dst[:1024].cpu()  # on the compute stream, not ordered after the copy
    assert not handle.done() and not early.any()
    handle.before_use()
    assert torch.equal(dst.cpu(), src)  # ordered after the event by the stream wait
    assert handle.done()
    engine.close()


def _seconds(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def test_side_stream_copy_overlaps_compute():
    """A host-to-device copy on the side stream runs while the compute stream multiplies (the
    matmuls stand in for a forward pass): together they take well under the sum of their times."""
    engine = CudaCopyEngine(torch.device("cuda"))
    src = engine.pin(torch.empty(256 << 20, dtype=torch.uint8))
    dst = torch.empty_like(src, device="cuda")
    x = torch.randn(4096, 4096, device="cuda")

    def copy() -> None:
        engine.submit(lambda: dst.copy_(src, non_blocking=True))

    def forward(n: int) -> None:
        for _ in range(n):
            torch.mm(x, x)

    copy_s = min(_seconds(copy) for _ in range(3))
    n = max(1, round(copy_s / min(_seconds(lambda: forward(1)) for _ in range(3))))
    forward_s = min(_seconds(lambda: forward(n)) for _ in range(3))
    both_s = min(_seconds(lambda: (copy(), forward(n))) for _ in range(3))
    assert both_s < 0.8 * (copy_s + forward_s), f"copy {copy_s:.4f} s, compute {forward_s:.4f} s, both {both_s:.4f} s"
    engine.close()
