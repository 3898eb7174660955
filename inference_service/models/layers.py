"""Layers every decoder family here shares: RoPE, RMSNorm, LoRA-aware fused projections, the gated MLP.

Base projections are fused (q/k/v, gate/up) for fewer matmuls; each fused projection carries the
LoRA slices of the HF modules it stands for, so the deltas land in slices of the fused output.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from adapter_cache.errors import FailedPreconditionError
from inference_service.kernels.hugepages import Arena
from inference_service.lora.ops import LoRABatch, LoRAOp, SlicedB
from inference_service.models import linear as dense
from inference_service.models.config import ModelConfig
from inference_service.models.fused_ops import FusedOps
from inference_service.models.quantized import QuantizedWeight


class RotaryEmbedding(nn.Module):
    """RoPE with HF's rotate-half convention; linear and Llama-3 frequency scaling."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = config.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise FailedPreconditionError(f"unsupported rope scaling {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos/sin [T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype, ops: FusedOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.add_rms_norm(x, None, self.weight, self.eps)[1]

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm); with the C ops one kernel pass, which adds into `residual` in place."""
        return self.ops.add_rms_norm(residual, delta, self.weight, self.eps)


class LoRASlices:
    """LoRA of the modules that share one fused base projection.

    `targets` lists (module, output slice start, end). Once attached, `buffers` are the group's
    slot buffers (A of every module stacked along the rank axis, and each module's B with its
    output columns), so one op adds the deltas of all of them to the whole fused output.
    """

    def __init__(self, targets: list[tuple[str, int, int]]) -> None:
        self.targets = targets
        self.modules = tuple(module for module, _, _ in targets)
        self.buffers: tuple[torch.Tensor, list[SlicedB]] | None = None

    def apply(self, op: LoRAOp, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch | None) -> None:
        if lora is None or self.buffers is None:
            return
        op.apply(x, out, *self.buffers, lora)


def frozen_param(rows: int, cols: int | None, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    shape = (rows,) if cols is None else (rows, cols)
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class LoRALinear(nn.Module):
    """A base projection, possibly several HF modules fused along its output, plus their LoRA.

    `outputs` lists (HF module name, output features) in column order. The weight is prepacked
    for the CPU GEMM once loaded (`pack`), and the dense copy dropped, so it is held once.
    """

    def __init__(self, in_features: int, outputs: list[tuple[str, int]], bias: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        targets, start = [], 0
        for module, size in outputs:
            targets.append((module, start, start + size))
            start += size
        self.weight = frozen_param(start, in_features, device, dtype)
        self.bias = frozen_param(start, None, device, dtype) if bias else None
        self.lora = LoRASlices(targets)
        self.packed: dense.PackedWeight | None = None
        # Set by the loader when the weight is kept quantized (models/quantized.py) until `pack`.
        self.quantized: QuantizedWeight | None = None

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Keep the weight as quantized blocks: the dense parameter is never filled (held empty)."""
        assert (weight.out_features, weight.in_features) == tuple(self.weight.shape)
        self.quantized = weight
        self.weight.data = self.weight.data.new_empty(0)

    def pack_quantized(self, packing: dense.WeightPacking, arena: Arena | None = None) -> int:
        """A kept quantized weight into its kernel's layout (cut from `arena` when given), or dequantized
        into the dense weight where no kernel takes it here (then `pack` packs it). Returns the bytes
        saved against the dense weight."""
        quantized, self.quantized = self.quantized, None
        if quantized is None:
            return 0
        dtype = self.weight.dtype
        self.packed = packing.pack_quantized(quantized, dtype, arena)
        if self.packed is None:
            self.weight.data = quantized.dequantize().to(dtype)
            return 0
        return quantized.out_features * quantized.in_features * dtype.itemsize - self.packed.nbytes

    def pack(self, packing: dense.WeightPacking, arena: Arena | None = None) -> None:
        if self.packed is not None:  # a quantized weight's kernel copy
            return
        self.packed = packing.pack(self.weight.data, arena)
        if self.packed is not None:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor, op: LoRAOp, lora: LoRABatch | None) -> torch.Tensor:
        out = dense.linear(x, self.weight, self.bias, self.packed)
        self.lora.apply(op, x, out, lora)
        return out


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, ops: FusedOps) -> None:
        super().__init__()
        self.ops = ops
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up = LoRALinear(h, [("gate_proj", i), ("up_proj", i)], config.mlp_bias, device, dtype)
        self.down = LoRALinear(i, [("down_proj", h)], config.mlp_bias, device, dtype)

    def forward(self, x: torch.Tensor, op: LoRAOp, lora: LoRABatch | None) -> torch.Tensor:
        return self.down(self.ops.silu_mul(self.gate_up(x, op, lora)), op, lora)
