"""The batched LoRA op against a per-token reference: any mix of slots (base-model tokens too),
slot orders, group sizes, adapter ranks below the slots' maximum, and the batch's rank hint."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_service.lora.ops import SlicedB, TorchLoRAOp, build_lora_batch

NUM_SLOTS, MAX_RANK, IN = 5, 8, 12
OUTS = (6, 4, 4)  # a fused projection of three modules, like q, k, v with GQA


def make_slots(ranks: list[int], gen: torch.Generator) -> tuple[torch.Tensor, list[SlicedB]]:
    """Slot buffers as the memory pool writes them: each adapter's rank, zero-padded to the max."""
    a = torch.zeros(NUM_SLOTS, len(OUTS) * MAX_RANK, IN)
    bs, col = [], 0
    for i, out in enumerate(OUTS):
        b = torch.zeros(NUM_SLOTS, out, MAX_RANK)
        for slot, rank in enumerate(ranks):
            a[slot, i * MAX_RANK : i * MAX_RANK + rank] = torch.randn(rank, IN, generator=gen)
            b[slot, :, :rank] = torch.randn(out, rank, generator=gen)
        bs.append(SlicedB(col, col + out, b))
        col += out
    return a, bs


def reference(x: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], token_slots: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], sum(OUTS))
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for i, s in enumerate(bs):
            a_i = a[slot, i * MAX_RANK : (i + 1) * MAX_RANK]
            out[row, s.start : s.end] = s.b[slot] @ (a_i @ x[row])
    return out


@settings(max_examples=150, deadline=None)
@given(
    token_slots=st.lists(st.integers(-1, NUM_SLOTS - 1), min_size=1, max_size=14),
    ranks=st.lists(st.integers(1, MAX_RANK), min_size=NUM_SLOTS, max_size=NUM_SLOTS),
    sort=st.booleans(),
    pass_rank=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_op_matches_per_token_reference(token_slots, ranks, sort, pass_rank, seed):
    gen = torch.Generator().manual_seed(seed)
    if sort:  # the model runner's order: base-model tokens first, then by slot
        token_slots = sorted(token_slots)
    a, bs = make_slots(ranks, gen)
    x = torch.randn(len(token_slots), IN, generator=gen)
    used = [ranks[s] for s in token_slots if s >= 0]
    rank = max(used) if pass_rank and used else None
    batch = build_lora_batch(token_slots, NUM_SLOTS, torch.device("cpu"), rank)
    out = torch.zeros(len(token_slots), sum(OUTS))
    if batch is not None:
        TorchLoRAOp().apply(x, out, a, bs, batch)
    torch.testing.assert_close(out, reference(x, a, bs, token_slots), atol=1e-5, rtol=1e-5)
