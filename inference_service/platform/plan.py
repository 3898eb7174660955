"""The platform plan: every choice of what computes what on this host, made once at start-up
(`Platform.for_device`) and handed to the model and the runner, which decide nothing themselves.

Frozen; `rows()` is what start-up logs as one table, `GetModelInfo` returns and the
`loraplex_platform_info` gauge carries.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from inference_service.lora.backend import make_lora_op
from inference_service.lora.ops import LoRAOp
from inference_service.models.attention import make_attention_backend
from inference_service.models.compute import ModelCompute
from inference_service.models.fused_ops import TORCH_FUSED_OPS, CFusedOps, FusedOps
from inference_service.models.linear import WeightPacking

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlatformPlan:
    device: torch.device
    cpu: str  # the CPU's model name
    cpu_flags: tuple[str, ...]  # the instruction-set flags the choices read (probe.FLAGS present here)
    kernels: str  # the C kernels loaded (--kernels auto), or why none
    dtype: torch.dtype
    dtype_why: str
    packing: WeightPacking
    quantized_path: str  # kernels/quant_linear.PATHS: what computes quantized projections, where packing.quantized
    attention: str  # models/attention.BACKENDS
    prefill_kernel: bool  # the C attention backend runs prefill chunks too
    lora_op: str  # lora/backend.OPS
    fused_ops: str  # "c" | "torch"
    greedy_pick: str  # "c" (kernels/greedy.c) | "torch": a sampled row's argmax
    decode_stack: bool  # the runner's fast path (models/decode_stack.py) for decode-only steps
    decode_stack_why: str
    copy_engine: str
    huge_pages: bool
    memory_budget: str

    def model_compute(self) -> ModelCompute:
        """A model's attention backend (its own: it keeps scratch), fused ops and weight packing."""
        fused: FusedOps = CFusedOps() if self.fused_ops == "c" else TORCH_FUSED_OPS
        return ModelCompute(make_attention_backend(self.attention, self.prefill_kernel), fused, self.packing)

    def make_lora_op(self) -> LoRAOp:
        return make_lora_op(self.lora_op, self.device, self.dtype)

    def with_decode_stack(self, on: bool, why: str) -> PlatformPlan:
        return dataclasses.replace(self, decode_stack=on, decode_stack_why=why)

    def rows(self) -> list[tuple[str, str]]:
        """(what, chosen) in a fixed order: the plan as a table."""
        forms = [*self.packing.forms, "F.linear"]
        quantized = f"Q8_0/Q4_0 kernel: {self.quantized_path}" if self.packing.quantized else "dequantized"
        prefill = "C kernel" if self.prefill_kernel else "torch SDPA"
        return [
            ("device", str(self.device)),
            ("cpu", self.cpu),
            ("cpu flags", " ".join(self.cpu_flags) or "-"),
            ("kernels", self.kernels),
            ("dtype", f"{str(self.dtype).removeprefix('torch.')} ({self.dtype_why})"),
            ("linear packing", " > ".join(forms)),
            ("quantized weights", quantized),
            ("attention decode", self.attention),
            ("attention prefill", prefill if self.attention == "c" else "torch SDPA"),
            ("lora op", self.lora_op),
            ("fused ops", self.fused_ops),
            ("greedy pick", self.greedy_pick),
            ("decode stack", f"{'on' if self.decode_stack else 'off'} ({self.decode_stack_why})"),
            ("copy engine", self.copy_engine),
            ("huge pages", "on" if self.huge_pages else "off"),
            ("memory budget", self.memory_budget),
        ]

    def table(self) -> str:
        rows = self.rows()
        width = max(len(key) for key, _ in rows)
        return "\n".join(f"  {key:<{width}}  {value}" for key, value in rows)

    def log(self) -> None:
        log.info("platform plan:\n%s", self.table())
