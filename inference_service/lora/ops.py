"""The batched LoRA op: `out += s_a · (x A_aᵀ) B_aᵀ` with `a` the slot of each token's request.

Slot buffers are A [slots, n·r, in] (the modules of one fused projection stacked) and one
B per module, [slots, out, r] (PEFT's layout) or rank-major [slots, r, out] as the op asks
(`b_rank_major`), possibly in a wider dtype than the model's (the torch op's fp32 on CPU, where
small bf16 matmuls are slow): x is cast to it and the delta is added in the model's dtype.

Tokens are grouped by slot once per step (`LoRABatch`, shared by every layer and module), then
each fused projection runs one batched shrink matmul over the groups and one expand per module:
gather-per-token for decode and segments for prefill fall out of the same grouping. When a batch's
adapters all have ranks below the slots' maximum, only that many rank rows are gathered and
multiplied (slots are zero-padded past each adapter's rank, so the result is the same). Scaling is
folded into the slot's B buffer at load time, so the op needs no per-slot scale. Faster kernels
(the C kernel on CPU, `lora/backend.py`; Triton on CUDA) plug in behind `LoRAOp` with the same
`LoRABatch`.
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
    """Per-step token grouping by slot. Tokens of the base model (slot -1) are in no group.

    The model runner orders a batch by slot (base-model tokens first), so in the common decode
    case the adapter tokens form contiguous, equally long groups: then `gather_rows` is None and
    x[first_row:] is viewed as [G, M, in] without any copy. When the groups are exactly slots 0..n-1, `slots`
    is None and the slot buffers are used as they are instead of gathered.
    """

    slots: torch.Tensor | None  # [G] slot of each group; None: all slots, in order
    gather_rows: torch.Tensor | None  # [G*M] row of x per padded position (T = the zero row)
    dest_rows: torch.Tensor | None  # [N] output row of each real position
    src_positions: torch.Tensor | None  # [N] its index in the padded [G*M] layout
    num_groups: int
    max_group_len: int
    num_tokens: int
    first_row: int = 0  # contiguous layout: rows before it are base-model tokens
    rank: int | None = None  # largest adapter rank among the groups; None: the slots' maximum
    # Runs of consecutive rows on one slot, [first row, end row, slot, adapter rank] each (CPU,
    # int64; the rank is UNKNOWN_RANK where not known): what the CPU kernel takes.
    runs: torch.Tensor | None = None


UNKNOWN_RANK = 2**31  # a run's rank when not known: the kernel uses the slots' whole rank


def build_lora_batch(
    token_slots: list[int], num_slots: int, device: torch.device, slot_ranks: dict[int, int] | None = None
) -> LoRABatch | None:
    """Group token rows by slot; None when no token uses an adapter (pure base-model step).

    `slot_ranks`: the rank of the adapter in each slot, where known."""
    slot_ranks = slot_ranks or {}
    groups: dict[int, list[int]] = {}
    runs: list[list[int]] = []
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        groups.setdefault(slot, []).append(row)
        if runs and runs[-1][2] == slot and runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1, slot, slot_ranks.get(slot, UNKNOWN_RANK)])
    if not groups:
        return None
    known = [slot_ranks.get(slot) for slot in groups]
    rank = None if None in known else max(known)  # type: ignore[type-var]
    run_table = torch.tensor(runs, dtype=torch.long)
    num_tokens = len(token_slots)
    max_len = max(len(rows) for rows in groups.values())

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

    all_slots = list(groups) == list(range(num_slots))
    slots = None if all_slots else as_tensor(list(groups))
    rows_in_order = [row for rows in groups.values() for row in rows]
    first_row = num_tokens - len(groups) * max_len
    if rows_in_order == list(range(first_row, num_tokens)):
        return LoRABatch(slots, None, None, None, len(groups), max_len, num_tokens, first_row, rank, run_table)
    gather, dest, src = [], [], []
    for g, rows in enumerate(groups.values()):
        gather.extend(rows + [num_tokens] * (max_len - len(rows)))
        dest.extend(rows)
        src.extend(range(g * max_len, g * max_len + len(rows)))
    return LoRABatch(
        slots=slots,
        gather_rows=as_tensor(gather),
        dest_rows=as_tensor(dest),
        src_positions=as_tensor(src),
        num_groups=len(groups),
        max_group_len=max_len,
        num_tokens=num_tokens,
        rank=rank,
        runs=run_table,
    )


class LoRAOp(Protocol):
    b_rank_major: bool  # the B layout it reads: [slots, r, out] if true, else [slots, out, r]

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the slot buffers should hold for a model of this dtype."""

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        """Add the LoRA deltas of one fused projection into out [T, Σout].

        `a` [slots, n·r, in] holds the A of its n modules stacked along the rank axis; `bs` gives
        each module's output columns and B [slots, out, r]."""


class TorchLoRAOp:
    """Grouped batched-matmul implementation; runs on any device torch supports."""

    def __init__(self, device: torch.device, b_rank_major: bool = False) -> None:
        self.device, self.b_rank_major = device, b_rank_major

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        # CPUs have no fast kernels for the small half-precision matmuls here (rank-16 bmms ran 3x
        # slower in bf16 than in fp32), so slots stay fp32 there; adapters are small.
        return torch.float32 if self.device.type == "cpu" else model_dtype

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        groups, group_len = batch.num_groups, batch.max_group_len
        num_modules, slot_rank = len(bs), a.shape[1] // len(bs)
        rank = min(batch.rank or slot_rank, slot_rank)
        if batch.slots is not None:
            # Gather the groups' slots, and of each only the rank rows some adapter here uses.
            a = a.view(a.shape[0], num_modules, slot_rank, a.shape[2])[:, :, :rank].index_select(0, batch.slots)
            a = a.view(groups, num_modules * rank, -1)
            bs = [SlicedB(s.start, s.end, self._rank_rows(s.b, rank).index_select(0, batch.slots)) for s in bs]
            slot_rank = rank
        if batch.gather_rows is None:
            padded_x = x[batch.first_row :].view(groups, group_len, x.shape[1])
        else:
            padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])[batch.gather_rows]
            padded_x = padded_x.view(groups, group_len, x.shape[1])
        # One shrink for every module of the projection (they share x), then one expand each.
        shrunk = torch.bmm(padded_x.to(a.dtype), a.transpose(1, 2))  # [G, M, n·r]
        expanded = [
            torch.bmm(shrunk[:, :, i * slot_rank : i * slot_rank + rank], self._rank_major(s.b, rank))
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

    def _rank_rows(self, b: torch.Tensor, rank: int) -> torch.Tensor:
        """B of the first `rank` ranks, in its stored layout."""
        return b[:, :rank] if self.b_rank_major else b[:, :, :rank]

    def _rank_major(self, b: torch.Tensor, rank: int) -> torch.Tensor:
        """B of the first `rank` ranks as [slots, rank, out], for the expand matmul."""
        return b[:, :rank] if self.b_rank_major else b[:, :, :rank].transpose(1, 2)
