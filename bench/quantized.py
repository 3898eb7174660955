"""Quantized base weights against bf16 on the same GGUF file, in one process (`--weights-dtype`).

The real model's file (SmolLM2-135M-Instruct, Q4_1) is served three times: `bf16`, every weight
dequantized to bf16 at load (what the engine did before), and `q8_0` / `q4_0`, every projection and
the LM head quantized to that type at load by gguf-py (llama.cpp's rounding) and read as blocks by
kernels/quant_linear.c. The engines take turns (ROUNDS rounds, each timing batch 1 and 32 on the base model and batch 32
over 8 resident adapters), so a busy host's slow seconds fall on both; each figure is the median
decode step (prefill excluded, in-process EngineCore.step, as bench/roofline.py times it), and the
ratios compare the medians over the rounds. Run it with nothing else on the machine; the load
average is printed before and after.

RESULT q8_vs_bf16_batch1=<bf16 step time / q8_0 step time at batch 1> (above 1: Q8_0 is faster),
RESULT q8_vs_bf16_batch32=, RESULT q8_vs_bf16_lora8_batch32=, and the same for q4.

`--projection` instead times one projection (SmolLM2's gate_up, 3072 x 576, bf16 activations, random
weights) at 1, 8 and 32 rows in every build of the kernel this CPU runs (x86-64-v3: AVX2; avx512-bf16:
AVX-512 VNNI), each compiled here, against oneDNN's packed bf16 GEMM: the best of 30 calls each.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import tempfile
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import best_of, print_result
from harness.engine_helpers import load_adapters
from harness.roofline import decode_step_s, mixed_adapters, real_model_parser, real_model_start
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.kernels import bindings, build, quant_linear, variants
from inference_service.models.linear import OneDNNWeight
from inference_service.models.quantized import quantize_blocks

ROUNDS = 3
WEIGHTS = ("bf16", "q8_0", "q4_0")
WORKLOADS = (("batch1", 1, False), ("batch32", 32, False), ("lora8_batch32", 32, True))
ADAPTERS = 8


def engine(model: str, dtype: str, weights_dtype: str) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", dtype=dtype, weights_dtype=weights_dtype,
                                   max_loras="auto", max_lora_rank=16, max_num_seqs=32,
                                   max_num_batched_tokens=4096, kv_cache_bytes=256 << 20))


PROJECTION = (3072, 576)  # gate_up's out and in features
PROJECTION_ROWS = (1, 8, 32)
PROJECTION_BUILDS = ("x86-64-v3", "avx512-bf16")


def time_projection() -> None:
    """One projection in each kernel build this CPU runs, against oneDNN's bf16 GEMM."""
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}", flush=True)
    n, k = PROJECTION
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    dense = OneDNNWeight(weight.bfloat16())
    compiler = build.find_compiler()
    assert compiler is not None, "no C compiler"
    flags = variants.cpu_flags()
    with tempfile.TemporaryDirectory() as tmp:
        for type_name in quant_linear.TYPES:
            blocks = quantize_blocks(weight.numpy(), type_name).blocks
            packed = quant_linear.pack(type_name, blocks, n, k, torch.bfloat16)
            assert packed is not None
            for variant in (v for v in variants.X86_64 if v.name in PROJECTION_BUILDS and v.requires <= flags):
                library = Path(tmp) / f"{variant.name}.so"
                build.compile_library(compiler, "quant_linear", variant.flags, library)
                symbol = f"quant_linear_{type_name.lower()}_bf16"
                fn = getattr(ctypes.CDLL(str(library)), symbol)
                signature = bindings.LIBRARIES["quant_linear"][symbol]
                fn.restype, fn.argtypes = signature.restype, list(signature.argtypes)
                for rows in PROJECTION_ROWS:
                    x = torch.randn(rows, k).bfloat16()
                    out = torch.empty(rows, n, dtype=torch.bfloat16)

                    def call(x=x, out=out, rows=rows, fn=fn, packed=packed) -> None:
                        fn(x.data_ptr(), packed.storage.data_ptr(), None, out.data_ptr(), rows, n, k, 0)

                    call()
                    ours, theirs = best_of(call, 30), best_of(lambda x=x: dense(x, None), 30)
                    print(f"{type_name} {variant.name:>12} rows {rows:>2}: {ours * 1e6:7.0f} us, oneDNN bf16 "
                          f"{theirs * 1e6:7.0f} us ({theirs / ours:.2f}x)", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = real_model_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--projection", action="store_true", help="time one projection per kernel build instead")
    args = parser.parse_args()
    if args.projection:
        time_projection()
        return
    model, _ = real_model_start(args)
    engines = {weights: engine(model, args.dtype, weights) for weights in WEIGHTS}
    for weights, core in engines.items():
        saved = core.runner.model.weight_bytes_saved
        print(f"{weights}: decode stack {'on' if core.runner.decode_stack else 'off'}, "
              f"weights {saved / 2**20:.1f} MiB smaller than dense", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = mixed_adapters(Path(tmp), engines["bf16"].runner.model.config, ADAPTERS)
        for core in engines.values():
            load_adapters(core, adapters)
        steps: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for name, batch, lora in WORKLOADS:
                names: list[str | None] = list(adapters) if lora else [None]
                for weights, core in engines.items():
                    step, _ = decode_step_s(core, batch, names, f"{weights}-{name}-{round_}")
                    steps.setdefault((weights, name), []).append(step)
                    print(f"round {round_} {name:>14} {weights:>5}: {step * 1e3:7.2f} ms/step, "
                          f"{batch / step:7.1f} tok/s", flush=True)
    for core in engines.values():
        core.shutdown()
    print(f"load average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}")
    for weights in WEIGHTS[1:]:
        for name, _, _ in WORKLOADS:
            ratio = statistics.median(steps[("bf16", name)]) / statistics.median(steps[(weights, name)])
            print_result(f"{weights[:2]}_vs_bf16_{name}", ratio, ".2f")


if __name__ == "__main__":
    main()
