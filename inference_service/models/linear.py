"""Dense projections, with weights prepacked once for the CPU GEMM.

Packed forms, tried per weight in the order the platform plan gives (`WeightPacking`):
- AMX (`kernels/amx_linear`): bf16 on CPUs with AMX. A decode step's projections only stream their
  weights, and this kernel reads them at ~1.5x oneDNN's rate there (docs/performance.md, "Decode
  against the machine's roofline"); from 64 rows up to the 512 of a default prefill chunk it is
  level with oneDNN, and ~0.85 of its rate at 2048 rows in one step.
- AVX-512 BF16 (`kernels/bf16_linear`): bf16 on CPUs with AVX-512 BF16 and no AMX (AMD Zen 4-5),
  where torch's bf16 projections are a oneDNN call from Python per op and no C-callable kernel was
  left for the decode stack; at 1-32 rows it runs 1.1-2.4x oneDNN's rate, at 512 rows 1.0-1.9x.
- AVX2 (`kernels/avx2_linear`): fp32 on CPUs with AVX2 but no AVX-512 (AMD Zen 1-3), where
  oneDNN's kernels read a decode step's weights at a third of a plain read's rate.
- Q8_0 / Q4_0 (`kernels/quant_linear`): a weight kept in GGUF's 8- or 4-bit blocks (`--weights-dtype`,
  models/quantized.py), read as blocks + fp16 scales against activations rounded per block to int8
  (integer dot products, summed in fp32), on any CPU (`pack_quantized`).
- oneDNN (`torch.ops.mkldnn._linear_pointwise`): everywhere else on CPU. MKL's GEMM behind
  `F.linear` repacks the weight on every call; at decode batch sizes that repacking is 15-30% of
  a projection (more in bf16). A oneDNN-packed weight (what torch's own inductor uses when it
  freezes a CPU model) skips it. The packing op is private to torch, so it is probed once per
  process and the plain path is kept wherever it is missing or disagrees with `F.linear`.
Each replaces the dense weight, which the caller then drops (held once).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from inference_service.kernels import amx_linear, avx2_linear, bf16_linear, quant_linear
from inference_service.kernels.hugepages import Arena
from inference_service.models.quantized import QuantizedWeight

log = logging.getLogger(__name__)


class PackedWeight(Protocol):
    """A projection's weight in a GEMM's own layout: out = x @ W^T (+ bias)."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def float_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`self(x, bias).float()` (the LM head's logits), in one pass where the GEMM can."""
        ...


class QuantizedPackedWeight(PackedWeight, Protocol):
    """A packed copy of a quantized weight."""

    @property
    def nbytes(self) -> int: ...


class OneDNNWeight:
    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def float_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self(x, bias).float()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return packed(x, bias)


def linear_float(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
) -> torch.Tensor:
    """`linear(...).float()`: the product rounded to the weight's dtype, as fp32."""
    if packed is None:
        return F.linear(x, weight, bias).float()
    return packed.float_output(x, bias)


def greedy_pick(x: torch.Tensor, bias: torch.Tensor | None,
                packed: PackedWeight | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first argmax, maximum finite) per row of `linear_float(x, ...)` without the products, where
    the packed GEMM can fuse the pick (AMX); else None and the caller takes the logits."""
    return packed.argmax(x, bias) if isinstance(packed, amx_linear.AMXWeight) else None


# The packed forms, in the order a weight tries them (the platform plan keeps those this host has).
PACKED_FORMS = ("amx", "bf16", "avx2", "onednn")


@dataclass(frozen=True)
class WeightPacking:
    """How the model's weights are packed, chosen once by the platform plan (inference_service/platform):
    the dense forms a weight tries in order (each still declines a weight it cannot take: AMX wants bf16
    and multiples of 32, the AVX2 kernel multiples of 16), whether quantized weights keep their kernel
    copy, and whether the packed copies sit on 2 MiB pages. No form: `F.linear` on the dense weight."""

    forms: tuple[str, ...] = ()
    quantized: bool = False
    huge_pages: bool = False

    def pack(self, weight: torch.Tensor, arena: Arena | None = None) -> PackedWeight | None:
        """The packed copy of weight [out, in], or None where the plain path should be used. An AMX copy
        is cut from `arena` (`arena_for` the model's weights) when given."""
        if weight.device.type != "cpu":
            return None
        for form in self.forms:
            packed: PackedWeight | None
            if form == "amx":
                packed = amx_linear.pack(weight, arena)
            elif form == "bf16":
                packed = bf16_linear.pack(weight, arena)
            elif form == "avx2":
                packed = avx2_linear.pack(weight)
            else:
                packed = OneDNNWeight(weight) if _packing_works(weight.dtype) else None
            if packed is not None:
                return packed
        return None

    def pack_quantized(self, weight: QuantizedWeight, dtype: torch.dtype,
                       arena: Arena | None = None) -> QuantizedPackedWeight | None:
        """A kernel's copy of a quantized weight for activations of `dtype` (cut from `arena`, from
        `quantized_arena_for`, when given), or None where no kernel takes it here (the caller then serves
        it dequantized)."""
        if not self.quantized:
            return None
        return quant_linear.pack(weight.type_name, weight.blocks, weight.out_features, weight.in_features, dtype,
                                 arena)

    def quantized_arena_for(self, weights: list[QuantizedWeight], dtype: torch.dtype) -> Arena | None:
        """One huge-page arena for the kernel copies of those quantized `weights` a kernel takes (None if
        none, or small pages asked for). Quantized weights are streamed like dense ones, and more of a
        batch-1 step is the reading: on 2 MiB pages a Q4_0 gate_up at 1 row took 19% less time, the Q8_0
        LM head 15% (AMD Zen 4)."""
        if not (self.quantized and self.huge_pages):
            return None
        taken = [w for w in weights if quant_linear.takes(w.type_name, w.out_features, w.in_features, dtype)]
        total = sum(quant_linear.panel_bytes(w.type_name, w.out_features, w.in_features) for w in taken)
        return Arena(total, torch.uint8) if total else None

    def arena_for(self, weights: list[torch.Tensor]) -> Arena | None:
        """One huge-page arena for the packed copies of those `weights` the first bf16 kernel of the forms
        (AMX's, else AVX-512 BF16's) takes (None if none)."""
        takes = amx_linear.packable if "amx" in self.forms else bf16_linear.takes if "bf16" in self.forms else None
        if takes is None:
            return None
        numel = sum(w.numel() for w in weights if takes(w))
        return Arena(numel, torch.bfloat16) if numel and self.huge_pages else None


# Every form, tried in order: what a test or bench that packs one weight by hand asks for.
EVERY_FORM = WeightPacking(PACKED_FORMS, quantized=True, huge_pages=True)


def arena_for(weights: list[torch.Tensor]) -> Arena | None:
    return EVERY_FORM.arena_for(weights)


def pack(weight: torch.Tensor, arena: Arena | None = None) -> PackedWeight | None:
    """`EVERY_FORM.pack`: the first packed form this host has that takes the weight."""
    return EVERY_FORM.pack(weight, arena)


def pack_quantized(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedPackedWeight | None:
    return EVERY_FORM.pack_quantized(weight, dtype)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        bias = torch.randn(48, generator=gen).to(dtype)
        expected = F.linear(x, weight, bias)
        got = linear(x, weight, bias, OneDNNWeight(weight))
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        if got.dtype == dtype and torch.allclose(got, expected, atol=tolerance, rtol=tolerance):
            return True
        log.warning("oneDNN prepacked linear disagrees with F.linear in %s: using F.linear", dtype)
    except (AttributeError, RuntimeError) as exc:
        log.info("oneDNN prepacked linear unavailable in %s (%s): using F.linear", dtype, exc)
    return False
