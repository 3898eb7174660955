"""Fused per-token decoder ops on CPU, in C (`fused.c`): RMSNorm with its residual add, RoPE with
the K/V cache write, SiLU-and-multiply. Each function returns None (or False) where the kernel
cannot run (not CPU, another dtype, no compiler, `LORAPLEX_CPU_KERNELS=0`) and the model then
runs its torch ops, which compute the same thing.
"""

from __future__ import annotations

import functools

import torch

from inference_service.kernels.bindings import CFunction, address, function

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True if the model on this device and dtype will use the kernels (builds them now if needed)."""
    return device.type == "cpu" and dtype in _SUFFIX and _function("silu_mul", dtype) is not None


def add_rms_norm_(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """residual += delta (in place, when given), then weight * rms_norm(residual). [T, H] each."""
    fn = _function("add_rms_norm", residual.dtype) if _fits(residual, delta, weight) else None
    if fn is None:
        return None
    out = torch.empty_like(residual)
    rows, cols = residual.shape
    fn(residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows,
       cols, eps)
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """Rotate q and k in place in the fused qkv [T, (Hq + 2 Hkv) D] and write k, v to the caches at
    `cache_rows` (flat token positions). False (nothing done) where the kernel cannot run."""
    fn = _function("rope_and_cache", qkv.dtype) if _fits(qkv, cos, sin, k_cache, v_cache) else None
    if fn is None or cache_rows.dtype != torch.int64 or not cache_rows.is_contiguous():
        return False
    fn(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), q_heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
       cache_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2 I] = [gate | up]; None where the kernel cannot run."""
    fn = _function("silu_mul", gate_up.dtype) if _fits(gate_up) else None
    if fn is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    fn(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def kernel_address(name: str, dtype: torch.dtype) -> int | None:
    """The address of the C function `name` (add_rms_norm, rope_and_cache, silu_mul) for dtype, or None."""
    fn = _function(name, dtype) if dtype in _SUFFIX else None
    return None if fn is None else address(fn)


def _fits(*tensors: torch.Tensor | None) -> bool:
    if torch.compiler.is_compiling():  # a C call is opaque to the compiler: a compiled step runs torch's ops
        return False
    first = tensors[0]
    assert first is not None
    return all(
        t is None or (t.device.type == "cpu" and t.dtype == first.dtype and t.is_contiguous()) for t in tensors
    ) and first.dtype in _SUFFIX


@functools.cache
def _function(name: str, dtype: torch.dtype) -> CFunction | None:
    return function("fused", f"{name}_{_SUFFIX[dtype]}")
