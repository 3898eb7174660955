"""Where a decode step's time goes, by op, on the real model.

Runs batch-B decode steps of the base model (and of 8 resident adapters with `--adapters`) in-process
under torch.profiler and prints, per op, its self CPU time per step and its share of the step's wall
time. Our C kernels (called through ctypes, invisible to the profiler) and the engine's stages are
labelled with record_function for the run (`[name]` rows: the time inside them that no torch op
under them accounts for); what nothing accounts for is the rest of the step loop's Python. Where
the decode stack runs (all layers in one C call, models/decode_stack.py), it is one row, and its
own clock splits it by op (`stack:` rows, summed over the layers; the final norm is in the first).
Same engine set-up as bench/roofline.py (SmolLM2-135M-Instruct, bf16 by default).

    .venv/bin/python -m bench.decode_profile [--batch 32] [--adapters] [--dtype bfloat16] [--weights-dtype q4_0]
        [--top 18]

Last line: RESULT decode_profile_ops_share=<ops' self time / step wall time> (no target: a profile).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on
from torch.profiler import ProfilerActivity, profile, record_function

from harness.bench import print_result
from harness.engine_helpers import load_adapters
from harness.roofline import engine, mixed_adapters, real_model_parser, real_model_start, submit
from inference_service.engine.core import EngineCore
from inference_service.models.decode_stack import OPS, DecodeStack

STEPS = 16


def label(owner: object, attr: str, name: str) -> None:
    """Run `owner.attr` under record_function(`[name]`) (a module function or a class's method)."""
    inner = getattr(owner, attr)

    def labelled(*args: object, **kwargs: object) -> object:
        with record_function(f"[{name}]"):
            return inner(*args, **kwargs)

    setattr(owner, attr, labelled)


def label_engine() -> None:
    from inference_service.engine import model_runner
    from inference_service.engine.output_processor import OutputProcessor
    from inference_service.engine.scheduler import Scheduler
    from inference_service.kernels import amx_linear, fused, paged_attention
    from inference_service.kernels.projection_rows import PanelWeight
    from inference_service.lora.backend import CpuLoRAOp

    for owner, attr, name in (
        (fused, "add_rms_norm_", "C: add + RMS norm"), (fused, "rope_and_cache", "C: RoPE + KV write"),
        (amx_linear.AMXWeight, "__call__", "C: AMX linear"), (fused, "silu_mul", "C: SiLU x mul"),
        (amx_linear.AMXWeight, "float_output", "C: AMX linear, LM head"),
        (amx_linear.AMXWeight, "argmax", "C: AMX LM head, greedy pick"),
        (PanelWeight, "__call__", "C: panel linear (AVX2, AVX-512 BF16, Q8_0/Q4_0)"),
        (PanelWeight, "float_output", "C: panel linear, LM head"),
        (paged_attention, "decode_attention", "C: paged decode attention"),
        (DecodeStack, "run", "C: decode stack, all layers"),
        (CpuLoRAOp, "apply", "C: LoRA shrink + expand"), (Scheduler, "schedule", "py: schedule"),
        (Scheduler, "postprocess", "py: postprocess"), (OutputProcessor, "on_token", "py: output processing"),
        (model_runner.ModelRunner, "plan", "py: plan"), (model_runner.ModelRunner, "_tensors", "py: input tensors"),
        (model_runner, "process_logits", "logits processors"), (model_runner, "sample", "sampling"),
        (model_runner, "step_logprobs", "logprobs"),
    ):
        label(owner, attr, name)


def profiled_steps(core: EngineCore, batch: int, names: list[str | None]) -> tuple[float, list[tuple[str, float]]]:
    """Wall seconds per decode step and (op, self CPU seconds per step), largest first."""
    submit(core, batch, names, "p", STEPS + 12)
    produced: set[str] = set()
    while len(produced) < batch:  # every prompt prefilled, then a few decode steps to warm up
        produced |= {out.request_id for out in core.step() if out.new_token_ids}
    for _ in range(3):
        core.step()
    stack = core.runner.decode_stack
    if stack is not None:
        stack.profile = torch.zeros(len(OPS), dtype=torch.float64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(STEPS):
            core.step()
        wall = (time.perf_counter() - start) / STEPS
    in_stack: dict[str, float] = {}
    if stack is not None and stack.profile is not None:
        seconds = (stack.profile / STEPS).tolist()
        stack.profile = None
        for name, s in zip(OPS, seconds, strict=True):
            in_stack[name] = in_stack.get(name, 0.0) + s
    while core.has_work():
        core.step()
    ops = [(e.key, e.self_cpu_time_total / 1e6 / STEPS) for e in prof.key_averages()]
    ops += [(f"  stack: {name}", s) for name, s in in_stack.items() if s > 0]
    return wall, sorted(ops, key=lambda op: -op[1])


def main() -> None:
    parser = real_model_parser(__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", action="store_true", help="8 resident adapters (r8/r16, all modules) mixed")
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--weights-dtype", default="auto", help="auto (the dtype), or a quantized one: q8_0, q4_0")
    args = parser.parse_args()
    model, _ = real_model_start(args)
    label_engine()
    core = engine(model, args.dtype, "auto", args.weights_dtype)
    names: list[str | None] = [None]
    with tempfile.TemporaryDirectory() as tmp:
        if args.adapters:
            config = core.runner.model.config
            adapters = mixed_adapters(Path(tmp), config, 8)
            load_adapters(core, adapters, preload=True)
            names = list(adapters)
        wall, ops = profiled_steps(core, args.batch, names)
    core.shutdown()
    accounted = sum(seconds for name, seconds in ops if not name.startswith("  stack:"))  # within the stack's row
    print(f"batch {args.batch}{' over 8 adapters' if args.adapters else ''}, {args.dtype}, weights "
          f"{args.weights_dtype}: "
          f"{wall * 1e3:.2f} ms a step (profiled), ops {accounted * 1e3:.2f} ms")
    print(f"{'op':<44} {'ms/step':>8} {'share':>6}")
    for name, seconds in ops[:args.top]:
        print(f"{name[:44]:<44} {seconds * 1e3:>8.3f} {seconds / wall:>6.1%}")
    rest = accounted - sum(seconds for name, seconds in ops[:args.top] if not name.startswith("  stack:"))
    print(f"{'(other ops)':<44} {rest * 1e3:>8.3f} {rest / wall:>6.1%}")
    print(f"{'(no op: Python, waits)':<44} {(wall - accounted) * 1e3:>8.3f} {(wall - accounted) / wall:>6.1%}")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print_result("decode_profile_ops_share", accounted / wall)


if __name__ == "__main__":
    main()
