"""The batched LoRA ops (torch in fp32 with both B layouts and in bf16/fp16 slots as on a GPU, and
the CPU kernel in fp32 and bf16) against a
per-token reference: any mix of slots (base-model tokens too), slot orders, group sizes, adapter
ranks below the slots' maximum, with and without the slots' ranks known."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.devices import C_KERNELS_OFF
from harness.lora_pages import MAX_RANK, NUM_SLOTS, make_slots, paginate
from inference_service.lora import backend as lora_kernel
from inference_service.lora.ops import LoRAOp, SlicedB, TorchLoRAOp, build_lora_batch

# (input size, output sizes of a fused projection of three modules, like q, k, v with GQA). The
# second has sizes where the kernel's register-blocked paths run, with leftover output columns.
SHAPES = [(12, (6, 4, 4)), (32, (64, 80, 16))]


def reference(x: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], token_slots: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], bs[-1].end)
    for row, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for i, s in enumerate(bs):
            a_i = a[slot, i * MAX_RANK : (i + 1) * MAX_RANK]
            out[row, s.start : s.end] = s.b[slot] @ (a_i @ x[row])
    return out


def make_op(kind: str) -> tuple[LoRAOp, torch.dtype]:
    if kind == "torch":
        return TorchLoRAOp(torch.device("cpu")), torch.float32
    if kind == "torch, B rank-major":
        return TorchLoRAOp(torch.device("cpu"), b_rank_major=True), torch.float32
    if kind.startswith("torch "):  # half-precision slots: what the torch op holds on CUDA
        return TorchLoRAOp(torch.device("cpu")), {"torch bf16": torch.bfloat16, "torch fp16": torch.float16}[kind]
    if C_KERNELS_OFF:
        pytest.skip("the C kernels are turned off in this run (LORAPLEX_CPU_KERNELS)")
    dtype = torch.float32 if kind == "kernel fp32" else torch.bfloat16
    assert lora_kernel.available(dtype), "the LoRA kernel should build with the compiler on these machines"
    return lora_kernel.CpuLoRAOp(dtype), dtype


@pytest.mark.parametrize("kind", ["torch", "torch, B rank-major", "torch bf16", "torch fp16", "kernel fp32",
                                  "kernel bf16"])
@settings(max_examples=200, deadline=None)
@given(
    token_slots=st.lists(st.integers(-1, NUM_SLOTS - 1), min_size=1, max_size=24),
    shape=st.sampled_from(SHAPES),
    ranks=st.lists(st.integers(1, MAX_RANK), min_size=NUM_SLOTS, max_size=NUM_SLOTS),
    sort=st.booleans(),
    known_ranks=st.sampled_from(["all", "some", "none"]),
    seed=st.integers(0, 2**16),
    page_rank=st.sampled_from([1, 3, 8]),
)
def test_op_matches_per_token_reference(kind, token_slots, shape, ranks, sort, known_ranks, seed, page_rank):
    """Over a paged pool: each adapter's rank rows in pages anywhere in the pool (mixed ranks whose
    last pages are partial with pages of 3; one row per page; whole slots with pages of 8)."""
    gen = torch.Generator().manual_seed(seed)
    if sort:  # the model runner's order: base-model tokens first, then by slot
        token_slots = sorted(token_slots)
    op, dtype = make_op(kind)
    size_in, outs = shape
    a, bs = make_slots(ranks, gen, size_in, outs)
    x = torch.randn(len(token_slots), size_in, generator=gen)
    a, x = a.to(dtype), x.to(dtype)
    bs = [SlicedB(s.start, s.end, s.b.to(dtype)) for s in bs]
    slot_ranks = {"all": dict(enumerate(ranks)), "some": {0: ranks[0], 3: ranks[3]}, "none": {}}[known_ranks]
    a_pages, b_pages, slot_pages, zero_page = paginate(a.float(), [SlicedB(s.start, s.end, s.b.float()) for s in bs],
                                                       ranks, page_rank, gen)
    a_pages = a_pages.to(dtype)
    b_pages = [SlicedB(s.start, s.end, s.b.to(dtype)) for s in b_pages]
    batch = build_lora_batch(token_slots, slot_pages, slot_ranks, page_rank, zero_page, torch.device("cpu"))
    out = torch.zeros(len(token_slots), sum(outs), dtype=dtype)
    stored = [SlicedB(s.start, s.end, s.b.transpose(1, 2).contiguous()) for s in b_pages] if op.b_rank_major \
        else b_pages
    if batch is not None:
        op.apply(x, out, a_pages, stored, batch)
    b32 = [SlicedB(s.start, s.end, s.b.float()) for s in bs]
    expected = reference(x.float(), a.float(), b32, token_slots)
    if dtype == torch.float32:
        # The op and the reference sum in different orders, over terms of magnitude ~10 (x·A adds
        # 32-64 products of unit normals): an output that cancels to ~0 can differ by ~1e-5 absolute,
        # while relative to a large output the difference is a few fp32 ulps.
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
        return
    # Half precision (inputs already in it, so exact in the fp32 reference): at most two roundings
    # to the dtype, of x·A (when the op keeps it in the dtype) and of the output, each off by half
    # an eps relative. Bounded by the same sums over absolute values, Σ|B|·|A|·|x|.
    magnitude = reference(x.float().abs(), a.float().abs(), [SlicedB(s.start, s.end, s.b.abs()) for s in b32],
                          token_slots)
    bound = torch.finfo(dtype).eps * magnitude + 1e-6
    excess = (out.float() - expected).abs() - bound
    assert excess.max() <= 0, f"{kind}: off by {excess.max().item()} beyond {torch.finfo(dtype).eps} x |terms|"


def test_transposing_copy_matches_torch():
    """The slot load's scaled B transpose (rank-major slots), at sizes that are not whole tiles."""
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(37, 21).to(dtype)
        dst = torch.zeros(24, 40, dtype=dtype)
        lora_kernel.transpose_into(dst[:21, :37], src, 0.5)
        assert torch.equal(dst[:21, :37], src.t() * 0.5) and not dst[21:].any() and not dst[:, 37:].any()
