"""Decode against the machine's limit, on the real model.

In one run: measures the machine (a sequential read of as many bytes as the model's weights, with the
engine's threads, on small and on 2 MiB pages, the faster counting; a large bf16 and fp32 GEMM's
FLOP/s), derives the decode roofline per batch size, and times our engine's decode step at batch 1,
8, 32 and 64 for the base model, for 8 mixed adapters all resident (r8/r16 on all 7 modules, the
default pool), and for 16 adapters over 8 fixed slots (2x more adapters than slots).

The roofline of a decode step at batch b is the larger of
  - the time to read the weights once (every matrix of the step, the embedding row gather aside) and
    the KV cache of b sequences at their mean context, at the measured read bandwidth, and
  - the time of the step's matrix FLOPs (2 x matrix parameters x b, attention's 4 x b x context x
    heads x head_dim per layer) at the measured GEMM FLOP/s of the serving dtype (or fp32's, where
    that is faster: a CPU without bf16 arithmetic can widen bf16 weights and compute in fp32).
A step's time is the median over its decode steps (prefill excluded), in-process (EngineCore.step).
The machine is measured again after each batch size's runs and the roofline uses the best figures of
the run (on a shared host a single measurement can land in a slow second and flatter the ratio).

Then, for each quantized weights dtype (`--weights-dtypes`, default q8_0 and q4_0: the same file's
projections and LM head kept as GGUF blocks, kernels/quant_linear.c), the base model's decode step at
batch 1 and 32 against its own roofline: the same formula with the bytes of the quantized weights (blocks
and fp16 scales) in place of the dense ones; the compute side stays the serving dtype's measured GEMM
rate (what a step that dequantizes could reach; the int8 kernel's own peak is not measured).

Model: SmolLM2-135M-Instruct (the Q4_1 GGUF scripts/fetch_model.sh fetches, dequantized at load), or
`--model`. Run it with nothing else on the machine; the load average is printed before and after.
Last lines: RESULT decode_vs_roofline_b32=<step time / roofline at batch 32, base model> and
RESULT lora_mixed_vs_base_resident=<tokens/s with 8 resident adapters / base, batch 32>, and per
quantized dtype RESULT decode_vs_roofline_b1_<dtype>= and RESULT decode_vs_roofline_b32_<dtype>=.
`--batches 1,32` times fewer batch sizes (32 must be among them).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on

from harness.bench import print_result
from harness.engine_helpers import load_adapters
from harness.roofline import (
    BATCHES,
    PROMPT_TOKENS,
    TIMED_STEPS,
    decode_step_s,
    engine,
    matrix_parameters,
    measure_machine,
    mixed_adapters,
    real_model_parser,
    real_model_start,
    roofline_s,
    served_weight_bytes,
)
from inference_service.models.config import ModelConfig
from inference_service.models.quantized import QUANTIZED_DTYPES

QUANTIZED_BATCHES = (1, 32)


def main() -> None:
    parser = real_model_parser(__doc__)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes, comma-separated")
    parser.add_argument("--weights-dtypes", default=",".join(QUANTIZED_DTYPES),
                        help="quantized weights dtypes timed against their own roofline (empty: none)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    quantized = [w for w in args.weights_dtypes.split(",") if w]
    model, dtype = real_model_start(args)
    base = engine(model, args.dtype, "auto")
    config: ModelConfig = base.runner.model.config
    width = torch.finfo(dtype).bits // 8
    machine = measure_machine(matrix_parameters(config) * width)
    print(f"machine: read {machine.read_gbps:.1f} GB/s; GEMM bf16 {machine.gemm_flops[torch.bfloat16] / 1e9:.0f} "
          f"GFLOP/s, fp32 {machine.gemm_flops[torch.float32] / 1e9:.0f} GFLOP/s; model {config.name or model}: "
          f"{matrix_parameters(config) / 1e6:.1f} M matrix parameters ({args.dtype})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = mixed_adapters(Path(tmp), config, 16)
        load_adapters(base, {n: p for n, p in adapters.items() if int(n[2:]) < 8}, pinned=False, preload=True)
        fixed = engine(model, args.dtype, 8)
        load_adapters(fixed, adapters)  # 16 adapters over 8 slots: loaded by the requests
        eight = [f"ad{i}" for i in range(8)]
        steps: dict[int, tuple[float, float, float, float]] = {}
        for batch in batches:
            base_s, base_tps = decode_step_s(base, batch, [None], f"base{batch}")
            mixed_s, mixed_tps = decode_step_s(base, batch, list(eight), f"mixed{batch}")
            _, over_tps = decode_step_s(fixed, batch, list(adapters), f"over{batch}")
            steps[batch] = (base_s, mixed_s, mixed_tps / base_tps, over_tps / base_tps)
            print(f"batch {batch}: base {base_s * 1e3:.2f} ms, 8 resident {mixed_s * 1e3:.2f} ms", flush=True)
            machine = machine.best_with(measure_machine(matrix_parameters(config) * width, quiet=True))
        base.shutdown()
        fixed.shutdown()
    quantized_steps: dict[tuple[str, int], tuple[float, int]] = {}
    for weights in quantized:
        core = engine(model, args.dtype, "auto", weights)
        for batch in QUANTIZED_BATCHES:
            step_s, _ = decode_step_s(core, batch, [None], f"{weights}{batch}")
            quantized_steps[(weights, batch)] = (step_s, served_weight_bytes(core))
            print(f"{weights} batch {batch}: base {step_s * 1e3:.2f} ms, weights "
                  f"{served_weight_bytes(core) / 1e6:.1f} MB", flush=True)
        core.shutdown()
        machine = machine.best_with(measure_machine(matrix_parameters(config) * width, quiet=True))
    measurements = len(batches) + len(quantized) + 1
    print(f"machine, the best of {measurements} measurements through the run: read {machine.read_gbps:.1f} GB/s; "
          f"GEMM bf16 {machine.gemm_flops[torch.bfloat16] / 1e9:.0f} GFLOP/s, fp32 "
          f"{machine.gemm_flops[torch.float32] / 1e9:.0f} GFLOP/s")
    print(f"{'batch':>5} {'roofline ms':>11} {'base ms':>8} {'x roof':>6} {'8 resident ms':>13} "
          f"{'tok/s vs base':>13} {'16 over 8 slots tok/s vs base':>29}")
    for batch, (base_s, mixed_s, mixed_ratio, over_ratio) in steps.items():
        roof = roofline_s(config, machine, dtype, batch, PROMPT_TOKENS + TIMED_STEPS // 2)
        print(f"{batch:>5} {roof * 1e3:>11.2f} {base_s * 1e3:>8.2f} {base_s / roof:>6.2f} {mixed_s * 1e3:>13.2f} "
              f"{mixed_ratio:>13.3f} {over_ratio:>29.3f}")
    for (weights, batch), (step_s, weight_bytes) in quantized_steps.items():
        roof = roofline_s(config, machine, dtype, batch, PROMPT_TOKENS + TIMED_STEPS // 2, weight_bytes)
        print(f"{weights:>5} batch {batch:>2}: roofline {roof * 1e3:.2f} ms ({weight_bytes / 1e6:.1f} MB of weights), "
              f"step {step_s * 1e3:.2f} ms, x roof {step_s / roof:.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    base_s, _, mixed_ratio, _ = steps[32]
    roof = roofline_s(config, machine, dtype, 32, PROMPT_TOKENS + TIMED_STEPS // 2)
    print_result("decode_vs_roofline_b32", base_s / roof)
    print_result("lora_mixed_vs_base_resident", mixed_ratio)
    for (weights, batch), (step_s, weight_bytes) in quantized_steps.items():
        roof = roofline_s(config, machine, dtype, batch, PROMPT_TOKENS + TIMED_STEPS // 2, weight_bytes)
        print_result(f"decode_vs_roofline_b{batch}_{weights}", step_s / roof)


if __name__ == "__main__":
    main()
