"""`Platform.for_device`: probe the host once and choose, for a device and an engine configuration,
everything the model and the runner compute with (the `PlatformPlan`).

Each choice reads the configuration's switches (`--kernels`, `--attention-backend`, `--decode-stack`,
`--huge-pages`, `--dtype`), the CPU's flags and which C kernels load here (each kernel module's own
`available`/`preferred`), in that order of precedence: a switch names a path, the probe says whether
it runs. A path named but absent here is a start-up error, not a silent fallback.
"""

from __future__ import annotations

from typing import Protocol

import torch

from adapter_cache.errors import FailedPreconditionError
from inference_service.kernels import avx2_linear, quant_linear
from inference_service.lora import backend as lora_ops
from inference_service.models import attention
from inference_service.models.decode_stack import DecodeStack
from inference_service.models.linear import WeightPacking
from inference_service.models.llama import LlamaModel
from inference_service.models.registry import CausalLM, family
from inference_service.platform.dtype import choose_dtype
from inference_service.platform.plan import PlatformPlan
from inference_service.platform.probe import FLAGS, CpuKernels, cpu_info


class PlatformSettings(Protocol):
    """What the platform reads of the engine configuration (engine/config.EngineConfig)."""

    model: str
    revision: str | None
    dtype: str
    kernels: str  # auto | off
    attention_backend: str  # auto | c | triton | torch
    decode_stack: str  # auto | off
    huge_pages: bool
    triton_kernels: bool
    overlap_loads: bool
    memory_budget_bytes: int | None

    def decode_graphs_on(self) -> bool: ...


KERNELS = ("auto", "off")
ATTENTION_BACKENDS = ("auto", *attention.BACKENDS)
DECODE_STACK = ("auto", "off")


class Platform:
    @staticmethod
    def for_device(device: torch.device, settings: PlatformSettings) -> PlatformPlan:
        """The plan for `device`; the decode stack's final word needs the loaded model (`with_model`)."""
        if settings.kernels not in KERNELS:
            raise FailedPreconditionError(f"--kernels must be one of {', '.join(KERNELS)}, got {settings.kernels!r}")
        if settings.attention_backend not in ATTENTION_BACKENDS:
            raise FailedPreconditionError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                                          f"got {settings.attention_backend!r}")
        if settings.decode_stack not in DECODE_STACK:
            raise FailedPreconditionError(
                f"--decode-stack must be one of {', '.join(DECODE_STACK)}, got {settings.decode_stack!r}")
        cpu = cpu_info()
        on_cpu = device.type == "cpu"
        kernels_on = on_cpu and settings.kernels == "auto"
        dtype, dtype_why = Platform.dtype(device, settings)
        found = CpuKernels.probe(dtype) if kernels_on else CpuKernels.none()
        graphs = settings.decode_graphs_on()
        huge_pages = on_cpu and settings.huge_pages
        if graphs:  # a captured decode step reads dense weights
            packing = WeightPacking(huge_pages=huge_pages)
        else:
            forms = (("amx",) if found.amx_linear else ()) + (("bf16",) if found.bf16_linear_preferred else ())
            forms += ("avx2",) if found.avx2_linear_preferred else ()
            forms += ("onednn",) if on_cpu else ()
            packing = WeightPacking(forms, quantized=found.quant_linear, huge_pages=huge_pages)
        attention_backend, prefill_kernel = _attention(settings.attention_backend, device, dtype, kernels_on, found)
        lora_op = next(name for name in lora_ops.OPS if (kernels_on or name not in lora_ops.C_KERNEL_OPS) and (
            name != "triton" or settings.triton_kernels) and lora_ops.op_runs(name, device, dtype))
        fused_ops = "c" if found.fused else "torch"
        greedy_pick = "c" if found.greedy else "torch"
        stack, stack_why = _decode_stack(settings, on_cpu, graphs, found, attention_backend, fused_ops)
        overlap = settings.overlap_loads
        copy_engine = "blocking" if not overlap else ("CUDA stream" if device.type == "cuda" else "thread")
        if settings.memory_budget_bytes is not None:
            budget = f"{settings.memory_budget_bytes} bytes (--memory-budget-bytes)"
        else:  # engine/memory.py measures it
            budget = f"measured once the weights are loaded ({'free GPU' if device.type == 'cuda' else 'host'} memory)"
        if settings.kernels == "off":
            kernels = "off (--kernels off)"
        elif not on_cpu:
            kernels = f"none on {device.type}"
        else:
            kernels = ", ".join(name for name, loaded in vars(found).items() if loaded) or "none load here"
        return PlatformPlan(
            device=device, cpu=cpu.model, cpu_flags=tuple(f for f in FLAGS if f in cpu.flags), kernels=kernels,
            dtype=dtype, dtype_why=dtype_why, packing=packing,
            quantized_path=quant_linear.path() if packing.quantized else "none", attention=attention_backend,
            prefill_kernel=prefill_kernel, lora_op=lora_op, fused_ops=fused_ops, greedy_pick=greedy_pick,
            decode_stack=stack, decode_stack_why=stack_why,
            copy_engine=copy_engine, huge_pages=huge_pages, memory_budget=budget,
        )

    @staticmethod
    def dtype(device: torch.device, settings: PlatformSettings) -> tuple[torch.dtype, str]:
        """(the serving dtype, why): `--dtype`, auto as platform/dtype.py says."""
        avx2_kernel = settings.dtype == "auto" and device.type == "cpu" and settings.kernels == "auto" and (
            avx2_linear.preferred())
        return choose_dtype(settings.dtype, settings.model, settings.revision, device, cpu_info(), avx2_kernel)

    @staticmethod
    def with_model(plan: PlatformPlan, model: CausalLM) -> tuple[PlatformPlan, DecodeStack | None]:
        """The plan's last word once the model is loaded (its LoRA op set and buffers attached): the
        decode stack where the plan allows it, the family declares LLaMA's layers
        (models/registry.py) and the packed projections are on one kernel C can call."""
        if not plan.decode_stack:
            return plan, None
        why_not = family(model.config.model_type).no_decode_stack
        if why_not is not None:
            return plan.with_decode_stack(False, why_not), None
        assert isinstance(model, LlamaModel)  # a family without a reason has LLaMA's layers
        stack = DecodeStack.build(model)
        if stack is None:
            return plan.with_decode_stack(False, "the projections are not all packed for one C kernel"), None
        return plan.with_decode_stack(True, "decode-only steps in one C call"), stack


def _attention(requested: str, device: torch.device, dtype: torch.dtype, kernels_on: bool,
               found: CpuKernels) -> tuple[str, bool]:
    """(backend, C prefill kernel): `--attention-backend`, auto the first of models/attention.BACKENDS
    that runs here."""
    def runs(name: str) -> bool:
        return (kernels_on or name not in attention.C_KERNEL_BACKENDS) and attention.backend_runs(name, device, dtype)

    if requested == "auto":
        requested = next(name for name in attention.BACKENDS if runs(name))
    elif not runs(requested):
        raise FailedPreconditionError(f"--attention-backend {requested} does not run on {device}: it needs "
                                      f"{attention.NEEDS[requested]}")
    return requested, requested == "c" and found.prefill_attention_preferred


def _decode_stack(settings: PlatformSettings, on_cpu: bool, graphs: bool, found: CpuKernels, attention: str,
                  fused_ops: str) -> tuple[bool, str]:
    if settings.decode_stack == "off":
        return False, "--decode-stack off"
    if not on_cpu:
        return False, "a CPU path"
    if settings.kernels == "off":
        return False, "--kernels off"
    if graphs:
        return False, "captured decode steps (--decode-graphs)"
    if not found.decode_stack or fused_ops != "c" or attention != "c":
        return False, "its C kernels are not all in use here"
    return True, "decode-only steps in one C call, where the family's layers are LLaMA's"
