"""Paged decode attention for GPUs in Triton: one query per sequence over its cached K/V, read in
place from the paged cache (the blocks of a table in any order), with grouped-query heads.

Caches are [num_blocks, block_size, Hkv, D] (engine/kv_cache.py); `tables` [B, max_blocks] lists
each sequence's blocks in token order (padding past its length is never read) and `lens` [B] its
context length including this step's token (both may be strided views: a captured step's static
buffers are columns of one tensor). One program per (sequence, query head) walks the
sequence's blocks with an online softmax in fp32 (the flash-decoding recurrence without the split:
the decode contexts here are short enough that one program per head keeps a GPU busy at batch
sizes the scheduler runs). Imported only where triton is (a GPU image, or CPU under
TRITON_INTERPRET=1 in the tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale, head_dim,
    stride_q_seq, stride_q_head, stride_c_block, stride_c_token, stride_c_head, stride_table, stride_lens,
    stride_o_seq, stride_o_head,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    length = tl.load(lens_ptr + seq * stride_lens)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + head * stride_q_head + d, mask=d_ok, other=0.0).to(tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    running_max = -float("inf")
    running_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for index in range(0, (length + BLOCK_SIZE - 1) // BLOCK_SIZE):
        block = tl.load(tables_ptr + seq * stride_table + index).to(tl.int64)
        t_ok = (offs_t < BLOCK_SIZE) & (index * BLOCK_SIZE + offs_t < length)
        at = block * stride_c_block + offs_t[:, None] * stride_c_token + kv_head * stride_c_head + d[None, :]
        mask = t_ok[:, None] & d_ok[None, :]
        keys = tl.load(k_ptr + at, mask=mask, other=0.0).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale
        scores = tl.where(t_ok, scores, -float("inf"))
        new_max = tl.maximum(tl.max(scores, axis=0), running_max)
        weights = tl.exp(scores - new_max)
        correction = tl.exp(running_max - new_max)
        values = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32)
        acc = acc * correction + tl.sum(weights[:, None] * values, axis=0)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor) -> torch.Tensor:
    """Attention output [B, Hq, D] of q [B, Hq, D] over each sequence's first `lens[b]` cached
    tokens (scaled by 1/sqrt(D), as SDPA's default). Every length must be at least 1."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and tables.stride(1) == 1
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, num_heads)](
        q, k_cache, v_cache, tables, lens, out, 1.0 / math.sqrt(head_dim), head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        lens.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
