"""Prefill against the machine's limit, and what a long prompt does to the streams decoding beside it
on the real model, in-process.

1. TTFT of one 512- and one 2048-token prompt (random tokens, greedy, the whole prompt in one step:
   `--max-num-batched-tokens` 4096), the median of REPEATS, against the prefill's roofline: its
   matrix FLOPs (2 x matrix parameters x prompt tokens, the LM head once: only the last position's
   logits are computed) plus causal attention's (2 x n^2 x heads x head_dim per layer: QK^T and PV
   over half the square) at the GEMM FLOP/s bench/roofline.py measures (the dtype's own, or fp32's
   where that is faster: `compute_flops`), or the weights' read time if that is longer.
2. STREAMS requests decode; a 2048-token prompt arrives; every step's time is an inter-token gap for
   the decoding streams. Chunked prefill at the default 512-token step budget (and `--budgets`)
   against the whole prompt in one step: the p99 and the worst gap while the prompt is prefilled,
   the prompt's own prefill time, and the median gap with no prompt at all.

Model: SmolLM2-135M-Instruct (scripts/fetch_model.sh), or `--model`. Run it with nothing else on the
machine; the load average is printed before and after. Last lines:
RESULT prefill_ttft_vs_roofline_512=<TTFT / roofline>, RESULT prefill_ttft_vs_roofline_2048=...,
RESULT chunked_prefill_itl_p99_ms=<the decode streams' p99 gap, chunked>, and
RESULT chunked_prefill_itl_p99_vs_whole=<that p99 / the p99 with the prompt in one step>.
"""

from __future__ import annotations

import os
import statistics
import time

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import percentile, print_result
from harness.roofline import (
    Machine,
    compute_flops,
    matrix_parameters,
    measure_machine,
    real_model_parser,
    real_model_start,
)
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.models.config import ModelConfig

PROMPTS = (512, 2048)
REPEATS = 3
STREAMS = 8
CHUNK = 512  # EngineConfig's default step budget
WHOLE = 4096


def engine(model: str, dtype: str, budget: int) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", dtype=dtype, max_loras=1, max_num_seqs=STREAMS + 1,
                                   max_num_batched_tokens=budget, kv_cache_bytes=512 << 20,
                                   prefix_cache=False))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(10, 30000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_roofline_s(config: ModelConfig, machine: Machine, dtype: torch.dtype, tokens: int) -> float:
    width = torch.finfo(dtype).bits // 8
    head = config.hidden_size * config.vocab_size
    body = matrix_parameters(config) - head
    attention = 2 * tokens * tokens * config.num_heads * config.head_dim * config.num_layers
    compute = (2 * body * tokens + 2 * head + attention) / compute_flops(machine, dtype)
    memory = matrix_parameters(config) * width / (machine.read_gbps * 1e9)
    return max(compute, memory)


def ttft_s(core: EngineCore, length: int, tag: str) -> float:
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    times = []
    for r in range(REPEATS + 1):  # the first warms the shapes up
        start = time.perf_counter()
        core.add_request(Request(f"{tag}-{r}", prompt(length, r), params), None)
        while not any(out.new_token_ids for out in core.step()):
            pass
        times.append(time.perf_counter() - start)
        while core.has_work():
            core.step()
    return statistics.median(times[1:])


def decode_gaps(core: EngineCore, long_prompt: int | None, tag: str) -> list[float]:
    """Every step's time while STREAMS requests decode and a `long_prompt`-token prompt (if any) is
    prefilled beside them: from its arrival to its first token."""
    params = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
    for i in range(STREAMS):
        core.add_request(Request(f"{tag}-s{i}", prompt(32, 100 + i), params), None)
    started: set[str] = set()
    while len(started) < STREAMS:  # every stream past its prefill
        started.update(out.request_id for out in core.step() if out.new_token_ids)
    for _ in range(4):
        core.step()
    gaps: list[float] = []
    if long_prompt is None:
        for _ in range(24):
            start = time.perf_counter()
            core.step()
            gaps.append(time.perf_counter() - start)
    else:
        core.add_request(Request(f"{tag}-long", prompt(long_prompt, 7), SamplingParams(max_new_tokens=1,
                                                                                         ignore_eos=True)), None)
        done = False
        while not done:
            start = time.perf_counter()
            outs = core.step()
            gaps.append(time.perf_counter() - start)
            assert sum(1 for out in outs if out.request_id.startswith(f"{tag}-s") and out.new_token_ids) == STREAMS, \
                "a decoding stream missed a step"
            done = any(out.request_id == f"{tag}-long" and out.new_token_ids for out in outs)
    for i in range(STREAMS):
        core.abort(f"{tag}-s{i}")
    while core.has_work():
        core.step()
    return gaps


def main() -> None:
    parser = real_model_parser(__doc__)
    parser.add_argument("--budgets", default="128,256", type=lambda v: [int(b) for b in v.split(",")],
                        help="step token budgets to run the long prompt's chunked prefill with, besides "
                             f"the default {CHUNK} and the whole prompt ({WHOLE})")
    args = parser.parse_args()
    model, dtype = real_model_start(args)
    whole = engine(model, args.dtype, WHOLE)
    config: ModelConfig = whole.runner.model.config
    machine = measure_machine(matrix_parameters(config) * (torch.finfo(dtype).bits // 8))
    print(f"machine: read {machine.read_gbps:.1f} GB/s; GEMM {args.dtype} {machine.gemm_flops[dtype] / 1e9:.0f} "
          f"GFLOP/s (the roofline's: {compute_flops(machine, dtype) / 1e9:.0f})", flush=True)
    results: dict[str, float] = {}
    for length in PROMPTS:
        ttft = ttft_s(whole, length, f"ttft{length}")
        roof = prefill_roofline_s(config, machine, dtype, length)
        results[f"prefill_ttft_vs_roofline_{length}"] = ttft / roof
        print(f"prompt {length:>5}: TTFT {ttft * 1e3:8.1f} ms, roofline {roof * 1e3:7.1f} ms, {ttft / roof:.2f}x "
              f"({2 * matrix_parameters(config) * length / ttft / 1e9:.0f} GFLOP/s of matrix work)", flush=True)
    quiet = decode_gaps(whole, None, "quiet")
    print(f"{STREAMS} streams decoding, no prompt: median gap {statistics.median(quiet) * 1e3:.1f} ms, "
          f"p99 {percentile(quiet, 0.99) * 1e3:.1f} ms", flush=True)
    gaps: dict[int, list[float]] = {}
    for budget in sorted({*args.budgets, CHUNK, WHOLE}):
        core = whole if budget == WHOLE else engine(model, args.dtype, budget)
        gaps[budget] = values = decode_gaps(core, max(PROMPTS), f"budget{budget}")
        print(f"beside a {max(PROMPTS)}-token prompt, {budget:>4}-token steps: {len(values):>3} steps, p99 gap "
              f"{percentile(values, 0.99) * 1e3:6.1f} ms, worst {max(values) * 1e3:6.1f} ms, prompt prefilled in "
              f"{sum(values) * 1e3:5.0f} ms", flush=True)
        core.shutdown()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    for name, value in results.items():
        print_result(name, value)
    print_result("chunked_prefill_itl_p99_ms", percentile(gaps[CHUNK], 0.99) * 1e3, ".1f")
    print_result("chunked_prefill_itl_p99_vs_whole", percentile(gaps[CHUNK], 0.99) / percentile(gaps[WHOLE], 0.99))


if __name__ == "__main__":
    main()
