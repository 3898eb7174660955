"""What this host offers, read once: the CPU's model and the instruction-set flags the kernels care
about, and which C kernels load here (through each kernel module's own `available`/`preferred`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from inference_service.kernels import amx_linear, avx2_linear, bf16_linear, fused, quant_linear, variants
from inference_service.kernels import paged_attention as attention_kernels
from inference_service.kernels.build import load_library
from inference_service.lora import backend as lora_kernels

# The flags a choice here depends on (/proc/cpuinfo's names).
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware (AVX512-BF16 or AMX): bf16 is then no slower than fp32."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)


@functools.cache
def cpu_info() -> CpuInfo:
    """The CPU's model, and its flags as the kernels' variant choice reads them (variants.cpu_flags:
    none off Linux, so no choice that needs one; capped by LORAPLEX_CPU_VARIANT)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
                break
    except OSError:
        pass
    return CpuInfo(model, variants.cpu_flags() & frozenset(FLAGS))


@dataclass(frozen=True)
class CpuKernels:
    """Which C kernels load here for a model dtype (each built now where it is not yet)."""

    amx_linear: bool
    bf16_linear_preferred: bool
    avx2_linear_preferred: bool
    quant_linear: bool
    fused: bool
    attention: bool
    prefill_attention_preferred: bool
    lora: bool
    decode_stack: bool
    greedy: bool

    @classmethod
    def probe(cls, dtype: torch.dtype) -> CpuKernels:
        cpu = torch.device("cpu")
        return cls(
            amx_linear=amx_linear.available(),
            bf16_linear_preferred=bf16_linear.preferred(),
            avx2_linear_preferred=avx2_linear.preferred(),
            quant_linear=quant_linear.available(),
            fused=fused.available(cpu, dtype),
            attention=attention_kernels.available(cpu, dtype),
            prefill_attention_preferred=attention_kernels.prefill_preferred(cpu, dtype),
            lora=lora_kernels.available(dtype),
            decode_stack=load_library("decode_stack") is not None,
            greedy=load_library("greedy") is not None,
        )

    @classmethod
    def none(cls) -> CpuKernels:
        return cls(False, False, False, False, False, False, False, False, False, False)
