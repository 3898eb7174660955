"""The machine's limits and the real model's in-process decode engine, for the decode benches
(bench/roofline.py, bench/prefill.py, bench/decode_profile.py, bench/quantized.py): a sequential read's
rate and a large GEMM's FLOP/s, the decode roofline they give, and the engine, requests and adapters
those benches time."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# isort: off
import inference_service  # first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on

from harness.bench import best_of
from harness.real_model import FETCH_HINT, real_model_path
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.kernels import hugepages
from inference_service.models.config import ModelConfig

BATCHES = (1, 8, 32, 64)
PROMPT_TOKENS = 32
TIMED_STEPS = 24


@dataclass(frozen=True)
class Machine:
    read_gbps: float  # sequential read, GB/s
    gemm_flops: dict[torch.dtype, float]  # achieved FLOP/s of a large GEMM

    def best_with(self, other: Machine) -> Machine:
        """The faster of two measurements, each figure on its own: the machine's limit is the best it
        reached during the run (on a shared host one measurement can land in a slow second)."""
        return Machine(max(self.read_gbps, other.read_gbps),
                       {dtype: max(flops, other.gemm_flops[dtype]) for dtype, flops in self.gemm_flops.items()})


def read_gbps(weight_bytes: int, huge_pages: bool) -> float:
    """A sequential read's rate (torch's sum on the engine's threads) over as many bytes as the weights."""
    numel = max(weight_bytes // 4, 1 << 20)
    buffer = hugepages.empty((numel,), torch.float32) if huge_pages else torch.empty(numel)
    buffer.fill_(1.0)
    buffer.sum()
    return buffer.numel() * 4 / best_of(buffer.sum, 7) / 1e9


def measure_machine(weight_bytes: int, quiet: bool = False) -> Machine:
    # The faster of small and 2 MiB pages (the engine holds weights, KV and adapters on the latter where
    # the kernel allows: inference_service/kernels/hugepages.py); on a host with THP in `madvise` mode a plain
    # buffer reads ~30% slower, a roofline that our own step can beat.
    reads = {huge: read_gbps(weight_bytes, huge) for huge in (False, True)}
    if not quiet:
        print(f"sequential read: {reads[False]:.1f} GB/s on 4 KiB pages, {reads[True]:.1f} GB/s on 2 MiB pages",
          flush=True)
    read = max(reads.values())
    return Machine(read, {dtype: gemm_flops(dtype) for dtype in (torch.bfloat16, torch.float32)})


def gemm_flops(dtype: torch.dtype) -> float:
    """A square GEMM's FLOP/s at 2048, or at 512 where a 2048 one would take minutes (bf16 on a CPU
    without bf16 arithmetic: torch's scalar fallback, whose time grows faster than n^3: 0.12 s at 512
    and 2.5 s at 1024 with torch held to AVX2, so 64x the 512 time is a low guess of the 2048 one)."""
    for n in (512, 2048):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        first = best_of(lambda a=a, b=b: a @ b, 1)
        if n == 512 and first * 64 > 2:
            break
    return 2 * n**3 / best_of(lambda a=a, b=b: a @ b, 5 if n == 2048 else 2)


def matrix_parameters(config: ModelConfig) -> int:
    """Parameters a decode step multiplies by (every layer's projections and the LM head)."""
    h, i = config.hidden_size, config.intermediate_size
    per_layer = h * config.q_size + 2 * h * config.kv_size + config.q_size * h + 3 * h * i
    return config.num_layers * per_layer + h * config.vocab_size


def roofline_s(config: ModelConfig, machine: Machine, dtype: torch.dtype, batch: int, context: int,
               weight_bytes: int | None = None) -> float:
    """The decode step's roofline at `batch`: `weight_bytes` the matrices' bytes as served (quantized
    weights' blocks and scales), by default the dense ones in `dtype`."""
    width = torch.finfo(dtype).bits // 8
    params = matrix_parameters(config)
    kv_bytes = batch * context * config.num_layers * 2 * config.kv_size * width
    weights = params * width if weight_bytes is None else weight_bytes
    memory = (weights + kv_bytes) / (machine.read_gbps * 1e9)
    attention_flops = 4 * batch * context * config.num_heads * config.head_dim * config.num_layers
    compute = (2 * params * batch + attention_flops) / compute_flops(machine, dtype)
    return max(memory, compute)


def served_weight_bytes(core: EngineCore) -> int:
    """The bytes of the matrices a decode step of `core` reads: dense ones in the serving dtype, less what
    the weights kept quantized save (their blocks and scales are what is read)."""
    model = core.runner.model
    return matrix_parameters(model.config) * model.dtype.itemsize - model.weight_bytes_saved


def compute_flops(machine: Machine, dtype: torch.dtype) -> float:
    """The FLOP/s a step in `dtype` can reach: its own GEMM's, or fp32's where that is faster. Where the
    CPU has no bf16 arithmetic (AVX2 only) torch's bf16 GEMM runs a scalar path (~0.1 GFLOP/s against
    fp32's ~70 here), and bf16 weights widened to fp32 compute at fp32's rate: the roofline is that."""
    return max(machine.gemm_flops[dtype], machine.gemm_flops[torch.float32])


def submit(core: EngineCore, batch: int, names: list[str | None], tag: str, new_tokens: int) -> None:
    """`batch` greedy requests of PROMPT_TOKENS random tokens, over `names` (None: the base model) in turn."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(10, 1000, (PROMPT_TOKENS,), generator=gen).tolist()
        core.add_request(Request(f"{tag}-{i}", prompt, params), names[i % len(names)])


def mixed_adapters(root: Path, config: ModelConfig, count: int) -> dict[str, Path]:
    """PEFT adapters ad0..ad{count-1} of ranks 16 and 8 alternating, on all modules."""
    return {f"ad{i}": write_peft_adapter(root / f"ad{i}", config, rank=8 if i % 2 else 16, alpha=16.0, seed=i,
                                         scale=0.05) for i in range(count)}


def decode_step_s(core: EngineCore, batch: int, names: list[str | None], tag: str) -> tuple[float, float]:
    """The median decode step with `batch` requests submitted (prefill steps excluded), and the tokens
    per second over those steps (with more adapters than slots not every request runs in a step)."""
    submit(core, batch, names, tag, TIMED_STEPS + 8)
    produced: dict[str, int] = {}
    while len(produced) < batch or min(produced.values()) < 1:  # every prompt prefilled
        for out in core.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
    times, tokens = [], 0
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        tokens += sum(len(out.new_token_ids) for out in core.step())
        times.append(time.perf_counter() - start)
    while core.has_work():
        core.step()
    return statistics.median(times), tokens / sum(times)


def engine(model: str, dtype: str, max_loras: int | str, weights_dtype: str = "auto") -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", dtype=dtype, weights_dtype=weights_dtype,
                                   max_loras=max_loras, max_lora_rank=16,
                                   max_num_seqs=max(BATCHES), max_num_batched_tokens=4096,
                                   kv_cache_bytes=512 << 20))


def real_model_parser(doc: str) -> argparse.ArgumentParser:
    """The real-model benches' flags: --model and --dtype."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="a .gguf file or checkpoint directory (default: SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    return parser


def real_model_start(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """The model to run (exits with the fetch hint without one) and its dtype; prints the load first."""
    logging.basicConfig(level=logging.WARNING)
    model = args.model or str(real_model_path() or "")
    if not model:
        sys.exit(f"the real model is missing: {FETCH_HINT}")
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}; OpenMP wait: {inference_service.openmp_wait_policy()}", flush=True)
    return model, getattr(torch, args.dtype)
