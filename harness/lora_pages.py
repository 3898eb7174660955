"""Paged LoRA pools for op tests: adapters of mixed ranks as the memory pool writes them, their
pages scattered over the pool (tests of the torch op, the C kernel and the Triton kernels)."""

from __future__ import annotations

import torch

from inference_service.lora.ops import SlicedB

NUM_SLOTS, MAX_RANK = 5, 8


def make_slots(ranks: list[int], gen: torch.Generator, size_in: int, outs: tuple[int, ...]):
    """Slot buffers as the memory pool writes them: each adapter's rank, zero-padded to the max."""
    a = torch.zeros(NUM_SLOTS, len(outs) * MAX_RANK, size_in)
    bs, col = [], 0
    for i, out in enumerate(outs):
        b = torch.zeros(NUM_SLOTS, out, MAX_RANK)
        for slot, rank in enumerate(ranks):
            a[slot, i * MAX_RANK : i * MAX_RANK + rank] = torch.randn(rank, size_in, generator=gen)
            b[slot, :, :rank] = torch.randn(out, rank, generator=gen)
        bs.append(SlicedB(col, col + out, b))
        col += out
    return a, bs


def paginate(a: torch.Tensor, bs: list[SlicedB], ranks: list[int], page_rank: int, gen: torch.Generator):
    """The slots as the paged pool holds them: each slot's rank in ceil(rank / page_rank) pages of
    page_rank rows, at random places in the pool (rows past its rank zeros), and a zero page last."""
    n = len(bs)
    counts = [-(-rank // page_rank) for rank in ranks]
    order = torch.randperm(sum(counts), generator=gen).tolist()
    zero_page = len(order)
    padded = max(counts) * page_rank
    a_pages = torch.zeros(zero_page + 1, n * page_rank, a.shape[2])
    b_pages = [torch.zeros(zero_page + 1, s.b.shape[1], page_rank) for s in bs]
    slot_pages: dict[int, tuple[int, ...]] = {}
    for slot, count in enumerate(counts):
        pages = tuple(order[:count])
        order = order[count:]
        slot_pages[slot] = pages
        for i, s in enumerate(bs):
            rows_a = torch.zeros(padded, a.shape[2])
            rows_a[: min(MAX_RANK, padded)] = a[slot, i * MAX_RANK : i * MAX_RANK + min(MAX_RANK, padded)]
            rows_b = torch.zeros(s.b.shape[1], padded)
            rows_b[:, : min(MAX_RANK, padded)] = s.b[slot, :, : min(MAX_RANK, padded)]
            for k, page in enumerate(pages):
                part = slice(k * page_rank, (k + 1) * page_rank)
                a_pages[page, i * page_rank : (i + 1) * page_rank] = rows_a[part]
                b_pages[i][page] = rows_b[:, part]
    return a_pages, [SlicedB(s.start, s.end, b) for s, b in zip(bs, b_pages, strict=True)], slot_pages, zero_page
