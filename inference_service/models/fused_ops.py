"""The per-token decoder ops a layer runs between its projections, behind one interface (`FusedOps`):
RMSNorm with its residual add, RoPE with the K/V cache write, SiLU-and-multiply.

Two implementations compute the same thing: `TorchFusedOps` on any device, `CFusedOps` through the
fused C kernels (`kernels/fused.c`), which fall back to the torch op per call where a kernel cannot
take the tensors (another dtype, not contiguous, inside a compiled step). The platform plan
(inference_service/platform) picks one for the model; call sites never check for a missing kernel.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from inference_service.kernels import fused


class FusedOps(Protocol):
    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, weight * rms_norm(residual + delta)), [T, H] each; `delta` None: no add.
        The sum may be written into `residual` in place."""
        ...

    def rope_and_cache(
        self, qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
        cache_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> bool:
        """Rotate q and k in place in the fused qkv and write k, v to the caches at `cache_rows`; False
        (nothing done) leaves both to the caller (`apply_rope` and the attention backend's cache write)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 I] = [gate | up]."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's order: normalise in fp32, cast back, then scale. One fused op for the first part.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchFusedOps:
    """torch's ops, on any device."""

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is not None:
            residual = residual + delta
        return residual, rms_norm(residual, weight, eps)

    def rope_and_cache(
        self, qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
        cache_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> bool:
        return False

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


class CFusedOps:
    """The fused C kernels on CPU; torch's op for a call whose tensors a kernel cannot take."""

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = fused.add_rms_norm_(residual, delta, weight, eps)
        if normed is not None:
            return residual, normed
        if delta is not None:  # the add in torch, the norm alone still in C where it fits
            residual = residual + delta
            normed = fused.add_rms_norm_(residual, None, weight, eps)
        return residual, normed if normed is not None else rms_norm(residual, weight, eps)

    def rope_and_cache(
        self, qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
        cache_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> bool:
        return fused.rope_and_cache(qkv, q_heads, kv_heads, head_dim, cos, sin, cache_rows, k_cache, v_cache)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = fused.silu_mul(gate_up)
        return out if out is not None else silu_mul(gate_up)


TORCH_FUSED_OPS = TorchFusedOps()
