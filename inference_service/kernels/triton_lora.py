"""Batched multi-LoRA for GPUs in Triton: the shrink and expand of one fused projection over the
paged adapter pool, segmented by adapter (the layout `kernels/lora.c` takes, see lora/ops.py).

Runs of consecutive rows on one adapter come as `runs` [S, 4] = (first row, end row, offset of its
pages in `run_pages`, adapter rank); rank row j of a run's adapter is row j % R of page
`run_pages[offset + j // R]` (R = page_rank). Each program reads its adapter's pages once per
tile of rows and only up to the adapter's rank (the masked loads skip the rest), as the C kernel
does; a run with first == end does nothing, so a captured graph can launch over a fixed number
of runs with the unused ones empty.

- shrink: y[row, i, j] = x[row] · A_i rank row j, for every module i of the projection at once
  (the pool stacks their A rows: a [pages, n·R, in]); y is fp32 scratch [T, n, W], W >= ranks.
- expand: out[row, cols of module i] += Σ_j y[row, i, j] · B_i rank row j, summed in fp32 and
  rounded once into out's dtype; B either rank-major [pages, R, out] or PEFT's [pages, out, R]
  (strides say which).

The tiles multiply by broadcast and sum rather than `tl.dot`: page ranks (8 by default) are below
`tl.dot`'s 16-wide minimum, and a decode step is bound by reading the adapters, not by FLOPs.
Imported only where triton is (a GPU image, or CPU under TRITON_INTERPRET=1 in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16  # rows of a run per tile (a decode run is often 1-4 rows: masked)
BLOCK_IN = 64  # input features per step of the shrink's reduction
BLOCK_OUT = 64  # output columns per expand program


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, y_ptr, runs_ptr, run_pages_ptr,
    in_features, stride_x, stride_a_page, stride_a_row, stride_y_row, stride_y_module,
    PAGE_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    run = tl.program_id(0)
    module = tl.program_id(1)
    first = tl.load(runs_ptr + run * 4)
    end = tl.load(runs_ptr + run * 4 + 1)
    pages_at = tl.load(runs_ptr + run * 4 + 2)
    rank = tl.load(runs_ptr + run * 4 + 3)
    offs_r = tl.arange(0, BLOCK_R)
    for m0 in range(first, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        for k in range(0, (rank + PAGE_RANK - 1) // PAGE_RANK):
            page = tl.load(run_pages_ptr + pages_at + k).to(tl.int64)
            rank_rows = k * PAGE_RANK + offs_r
            r_ok = (offs_r < PAGE_RANK) & (rank_rows < rank)
            a_rows = a_ptr + page * stride_a_page + (module * PAGE_RANK + offs_r) * stride_a_row
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, in_features, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_ok = cols < in_features
                xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :],
                             mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
                at = tl.load(a_rows[:, None] + cols[None, :], mask=r_ok[:, None] & col_ok[None, :],
                             other=0.0).to(tl.float32)
                acc += tl.sum(xt[:, None, :] * at[None, :, :], axis=2)
            y_at = y_ptr + rows[:, None].to(tl.int64) * stride_y_row + module * stride_y_module + rank_rows[None, :]
            tl.store(y_at, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, runs_ptr, run_pages_ptr,
    out_features, col_start, module, stride_y_row, stride_y_module, stride_b_page, stride_b_rank, stride_b_col,
    stride_out,
    PAGE_RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    run = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    first = tl.load(runs_ptr + run * 4)
    end = tl.load(runs_ptr + run * 4 + 1)
    pages_at = tl.load(runs_ptr + run * 4 + 2)
    rank = tl.load(runs_ptr + run * 4 + 3)
    offs_r = tl.arange(0, BLOCK_R)
    for m0 in range(first, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, (rank + PAGE_RANK - 1) // PAGE_RANK):
            page = tl.load(run_pages_ptr + pages_at + k).to(tl.int64)
            rank_rows = k * PAGE_RANK + offs_r
            r_ok = (offs_r < PAGE_RANK) & (rank_rows < rank)
            yk = tl.load(y_ptr + rows[:, None].to(tl.int64) * stride_y_row + module * stride_y_module
                         + rank_rows[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
            bk = tl.load(b_ptr + page * stride_b_page + offs_r[:, None] * stride_b_rank + cols[None, :] * stride_b_col,
                         mask=r_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(yk[:, :, None] * bk[None, :, :], axis=1)
        out_at = out_ptr + rows[:, None].to(tl.int64) * stride_out + col_start + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        previous = tl.load(out_at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_at, (previous + acc).to(out_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, runs: torch.Tensor, run_pages: torch.Tensor,
                num_modules: int) -> None:
    """y [T, n, W] (fp32) = each run's rows of x [T, in] times its adapter's A rows, up to its rank.

    `a` [pages, n·R, in] with rows contiguous; `runs`, `run_pages` on x's device."""
    page_rank = a.shape[1] // num_modules
    assert x.stride(1) == 1 and a.stride(2) == 1 and y.stride(2) == 1 and y.dtype == torch.float32
    grid = (runs.shape[0], num_modules)
    _shrink_kernel[grid](
        x, a, y, runs, run_pages, x.shape[1], x.stride(0), a.stride(0), a.stride(1), y.stride(0), y.stride(1),
        PAGE_RANK=page_rank, BLOCK_R=triton.next_power_of_2(page_rank), BLOCK_M=BLOCK_ROWS, BLOCK_K=BLOCK_IN,
    )


def lora_expand(y: torch.Tensor, b: torch.Tensor, out: torch.Tensor, runs: torch.Tensor, run_pages: torch.Tensor,
                module: int, col_start: int, b_rank_major: bool) -> None:
    """out[:, col_start : col_start + out_i] += y[:, module] times the runs' B pages of this module.

    `b`: [pages, R, out_i] if `b_rank_major`, else [pages, out_i, R]."""
    if b_rank_major:
        page_rank, out_features, stride_rank, stride_col = b.shape[1], b.shape[2], b.stride(1), b.stride(2)
    else:
        page_rank, out_features, stride_rank, stride_col = b.shape[2], b.shape[1], b.stride(2), b.stride(1)
    assert out.stride(1) == 1
    grid = (runs.shape[0], triton.cdiv(out_features, BLOCK_OUT))
    _expand_kernel[grid](
        y, b, out, runs, run_pages, out_features, col_start, module, y.stride(0), y.stride(1), b.stride(0),
        stride_rank, stride_col, out.stride(0),
        PAGE_RANK=page_rank, BLOCK_R=triton.next_power_of_2(page_rank), BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_OUT,
    )
