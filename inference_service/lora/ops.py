"""The batched LoRA op: `out += s_a · (x A_aᵀ) B_aᵀ` with `a` the adapter of each token's request.

Adapters live in a paged pool (`mem_pool.LoRAMemoryPool`): pages of `page_rank` rank rows, an
adapter of rank r in ceil(r / page_rank) of them, in any order. Per fused projection the pool holds
A [pages, n·page_rank, in] (the rows of its n modules stacked) and one B per module,
[pages, out, page_rank] (PEFT's layout) or rank-major [pages, page_rank, out] as the op asks
(`b_rank_major`), possibly in a wider dtype than the model's (the torch op's fp32 on CPU, where
small bf16 matmuls are slow): x is cast to it and the delta is added in the model's dtype.

Tokens are grouped by adapter once per step (`LoRABatch`, shared by every layer and module), each
group with its adapter's page list. The torch op gathers each group's pages (padding shorter lists
with the pool's zero page) and runs one batched shrink matmul over the groups and one expand per
module: gather-per-token for decode and segments for prefill fall out of the same grouping (the
S-LoRA / Punica gather; a CUDA kernel takes the same page table). Rank rows past an adapter's
rank are zeros in its last page, so the result is exact. Scaling is folded into B at load time, so
the op needs no per-adapter scale. Faster kernels (the C kernel on CPU, `lora/backend.py`, which
reads each run's pages directly) plug in behind `LoRAOp` with the same `LoRABatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SlicedB:
    """One module of a fused projection: its output columns [start, end) and its B slot buffer."""

    start: int
    end: int
    b: torch.Tensor  # [slots, end - start, r], or [slots, r, end - start] for a rank-major op


@dataclass(frozen=True)
class LoRABatch:
    """Per-step token grouping by adapter, with each group's pages. Tokens of the base model
    (slot -1) are in no group.

    The model runner orders a batch by slot (base-model tokens first), so in the common decode
    case the adapter tokens form contiguous, equally long groups: then `gather_rows` is None and
    x[first_row:] is viewed as [G, M, in] without any copy.
    """

    pages: torch.Tensor  # [G, P] each group's pages in rank order, padded with the pool's zero page
    gather_rows: torch.Tensor | None  # [G*M] row of x per padded position (T = the zero row)
    dest_rows: torch.Tensor | None  # [N] output row of each real position
    src_positions: torch.Tensor | None  # [N] its index in the padded [G*M] layout
    num_groups: int
    max_group_len: int
    num_tokens: int
    first_row: int = 0  # contiguous layout: rows before it are base-model tokens
    # Runs of consecutive rows on one adapter, [first row, end row, offset of its pages in
    # `run_pages`, adapter rank] each (int64, on the batch's device), and those pages: what the
    # CPU kernel and the Triton kernels take.
    runs: torch.Tensor | None = None
    run_pages: torch.Tensor | None = None
    max_rank: int = 0  # the largest rank among the runs (the kernel's scratch width)


def build_lora_batch(
    token_slots: list[int], slot_pages: dict[int, tuple[int, ...]], slot_ranks: dict[int, int], page_rank: int,
    zero_page: int, device: torch.device,
) -> LoRABatch | None:
    """Group token rows by slot; None when no token uses an adapter (pure base-model step).

    `slot_pages`: the pages of each slot's adapter; `slot_ranks`: its rank where known (else its
    pages' whole rank)."""
    groups: dict[int, list[int]] = {}
    runs: list[list[int]] = []
    offsets: dict[int, int] = {}
    page_list: list[int] = []
    run_slots: list[int] = []
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        groups.setdefault(slot, []).append(row)
        if runs and run_slots[-1] == slot and runs[-1][1] == row:
            runs[-1][1] += 1
            continue
        run_slots.append(slot)
        if slot not in offsets:
            offsets[slot] = len(page_list)
            page_list.extend(slot_pages[slot])
        rank = min(slot_ranks.get(slot) or page_rank * len(slot_pages[slot]), page_rank * len(slot_pages[slot]))
        runs.append([row, row + 1, offsets[slot], rank])
    if not groups:
        return None
    run_table = torch.tensor(runs, dtype=torch.long).to(device, non_blocking=True)
    num_tokens = len(token_slots)
    max_len = max(len(rows) for rows in groups.values())
    width = max(len(slot_pages[slot]) for slot in groups)
    table = [list(slot_pages[slot]) + [zero_page] * (width - len(slot_pages[slot])) for slot in groups]
    common = dict(runs=run_table, run_pages=torch.tensor(page_list, dtype=torch.long).to(device, non_blocking=True),
                  max_rank=max(run[3] for run in runs))

    def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    rows_in_order = [row for rows in groups.values() for row in rows]
    first_row = num_tokens - len(groups) * max_len
    if rows_in_order == list(range(first_row, num_tokens)):
        return LoRABatch(as_tensor(table), None, None, None, len(groups), max_len, num_tokens, first_row, **common)
    gather, dest, src = [], [], []
    for g, rows in enumerate(groups.values()):
        gather.extend(rows + [num_tokens] * (max_len - len(rows)))
        dest.extend(rows)
        src.extend(range(g * max_len, g * max_len + len(rows)))
    return LoRABatch(
        pages=as_tensor(table),
        gather_rows=as_tensor(gather),
        dest_rows=as_tensor(dest),
        src_positions=as_tensor(src),
        num_groups=len(groups),
        max_group_len=max_len,
        num_tokens=num_tokens,
        **common,
    )


class LoRAOp(Protocol):
    b_rank_major: bool  # the B layout it reads: [pages, page_rank, out] if true, else [pages, out, page_rank]

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the pool's pages should hold for a model of this dtype."""

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        """Add the LoRA deltas of one fused projection into out [T, Σout].

        `a` [pages, n·page_rank, in] holds the A rows of its n modules stacked along the rank axis;
        `bs` gives each module's output columns and B pages. Each group reads its own pages."""


class TorchLoRAOp:
    """Gather-then-batched-matmul implementation (Punica/S-LoRA's gather over a paged pool, as
    torch ops); runs on any device torch supports."""

    def __init__(self, device: torch.device, b_rank_major: bool = False) -> None:
        self.device, self.b_rank_major = device, b_rank_major

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        # CPUs have no fast kernels for the small half-precision matmuls here (rank-16 bmms ran 3x
        # slower in bf16 than in fp32), so pages stay fp32 there; adapters are small.
        return torch.float32 if self.device.type == "cpu" else model_dtype

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        groups, group_len = batch.num_groups, batch.max_group_len
        num_modules, page_rank = len(bs), a.shape[1] // len(bs)
        num_pages = batch.pages.shape[1]
        rank = num_pages * page_rank  # each group's rank rows in order; past its rank they are zeros
        flat = batch.pages.reshape(-1)
        # Gather each group's pages: [G, P, n, R, in] -> [G, n, P·R, in], module-major like a slot.
        a = a.index_select(0, flat).view(groups, num_pages, num_modules, page_rank, a.shape[2])
        a = a.transpose(1, 2).reshape(groups, num_modules * rank, -1)
        if batch.gather_rows is None:
            padded_x = x[batch.first_row :].view(groups, group_len, x.shape[1])
        else:
            padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])[batch.gather_rows]
            padded_x = padded_x.view(groups, group_len, x.shape[1])
        # One shrink for every module of the projection (they share x), then one expand each.
        shrunk = torch.bmm(padded_x.to(a.dtype), a.transpose(1, 2))  # [G, M, n·rank]
        expanded = [
            torch.bmm(shrunk[:, :, i * rank : (i + 1) * rank], self._gather_b(s.b, flat, groups, num_pages))
            for i, s in enumerate(bs)
        ]
        if batch.gather_rows is None:
            rows = out[batch.first_row :]
            for s, delta in zip(bs, expanded, strict=True):
                rows[:, s.start : s.end].view(groups, group_len, s.end - s.start).add_(delta)
            return
        delta = torch.cat(expanded, dim=2) if len(expanded) > 1 else expanded[0]
        delta = delta.view(-1, out.shape[1]).index_select(0, batch.src_positions).to(out.dtype)
        out.index_add_(0, batch.dest_rows, delta)

    def _gather_b(self, b: torch.Tensor, flat: torch.Tensor, groups: int, num_pages: int) -> torch.Tensor:
        """Each group's B pages as [G, P·page_rank, out], for the expand matmul."""
        b = b.index_select(0, flat)
        if self.b_rank_major:  # [G·P, R, out]
            return b.view(groups, num_pages * b.shape[1], b.shape[2])
        b = b.view(groups, num_pages, b.shape[1], b.shape[2]).transpose(2, 3)  # [G, P, R, out]
        return b.reshape(groups, num_pages * b.shape[2], b.shape[3])
