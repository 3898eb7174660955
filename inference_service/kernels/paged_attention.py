"""Paged attention on CPU, in C, read in place from the blocks: decode (`paged_decode_attention.c`)
and a prefill chunk's causal attention (`paged_prefill_attention.c`).

Built and loaded by `kernels.build`; where they cannot be (no compiler, `LORAPLEX_CPU_KERNELS=0`)
`decode_attention` and `prefill_attention` return None and the model keeps its torch path (gather
the blocks, then SDPA).
"""

from __future__ import annotations

import functools

import torch

from inference_service.kernels.bindings import CFunction, address, function

_SYMBOLS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
_PREFILL_SYMBOLS = {torch.float32: "paged_prefill_attention_f32", torch.bfloat16: "paged_prefill_attention_bf16"}


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True if decode attention on this device and dtype will use the kernel (builds it now if
    needed: the model runner asks at start-up, not in the first request's decode step)."""
    return device.type == "cpu" and dtype in _SYMBOLS and _kernel(dtype) is not None


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor | None:
    """softmax(q Kᵀ/√d) V per sequence over its first `context_lens[b]` cached tokens.

    q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] and
    context_lens [B] int64. None where the kernel cannot run (caller falls back)."""
    if not _layout_taken(q, k_cache, v_cache, block_tables, context_lens):
        return None
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    kernel = _choose(q.dtype, q_heads, kv_heads, head_dim, block_size)
    if kernel is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    status = kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), batch, q_heads, kv_heads, head_dim, block_size, block_tables.shape[1], head_dim**-0.5,
    )
    if status != 0:
        raise MemoryError("paged decode attention kernel: out of memory for its scratch buffers")
    return out


def prefill_preferred(device: torch.device, dtype: torch.dtype) -> bool:
    """True if a prefill chunk's attention should run on the C kernel here (built now if needed): a
    CPU without AVX-512, where torch's SDPA is the slower (on AVX-512 and AMX CPUs torch's is kept)."""
    if device.type != "cpu" or dtype not in _PREFILL_SYMBOLS or _prefill_kernel(dtype) is None:
        return False
    preferred = function("paged_prefill_attention", "paged_prefill_attention_preferred")
    return preferred is not None and bool(preferred())


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, start: int
) -> torch.Tensor | None:
    """Causal attention of one prefill chunk: q [T, Hq, D] at positions start .. start + T - 1 over the
    sequence's cached tokens 0 .. start + T - 1 (the chunk's own K/V already written), its blocks
    listed in block_table [n] (int64). None where the kernel cannot run (caller falls back)."""
    count, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if not (
        _layout_taken(q, k_cache, v_cache, block_table)
        and head_dim % 8 == 0
        and block_table.numel() * block_size >= start + count
    ):
        return None
    kernel = _prefill_kernel(q.dtype)
    if kernel is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    if count == 0:
        return out
    status = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(), out.data_ptr(),
                    count, start, q_heads, kv_heads, head_dim, block_size, head_dim**-0.5)
    if status == -1:  # a shape it does not take (a query group of more than 64 heads)
        return None
    if status != 0:
        raise MemoryError("paged prefill attention kernel: out of memory for its scratch buffers")
    return out


def kernel_address(dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> int | None:
    """The address of the C function `decode_attention` calls for these shapes (same arguments), or None."""
    if dtype not in _SYMBOLS or q_heads % kv_heads:
        return None
    kernel = _choose(dtype, q_heads, kv_heads, head_dim, block_size)
    return None if kernel is None else address(kernel)


def _choose(dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> CFunction | None:
    """The AMX kernel where it fits, else the portable one for the dtype."""
    kernel = _amx_kernel(q_heads, kv_heads, head_dim, block_size) if dtype == torch.bfloat16 else None
    return kernel or _kernel(dtype)


def _layout_taken(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *indices: torch.Tensor) -> bool:
    """What both kernels need: CPU tensors of one dtype they are built for (fp32, bf16), contiguous
    caches, contiguous int64 tables and lengths, whole query groups per KV head."""
    return (
        q.device.type == "cpu"
        and q.dtype in _SYMBOLS
        and k_cache.dtype == v_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in indices)
        and q.shape[1] % k_cache.shape[2] == 0
    )


@functools.cache
def _kernel(dtype: torch.dtype) -> CFunction | None:
    return function("paged_decode_attention", _SYMBOLS[dtype])


@functools.cache
def _amx_kernel(q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> CFunction | None:
    """The bf16 kernel on AMX tile products, where the CPU has AMX and the shapes fit it."""
    fits = function("paged_decode_attention", "paged_decode_attention_bf16_amx_fits")
    if fits is None or not fits(q_heads, kv_heads, head_dim, block_size):
        return None
    return function("paged_decode_attention", "paged_decode_attention_bf16_amx")


@functools.cache
def _prefill_kernel(dtype: torch.dtype) -> CFunction | None:
    return function("paged_prefill_attention", _PREFILL_SYMBOLS[dtype])
