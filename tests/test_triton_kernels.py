"""The Triton kernels (LoRA shrink/expand over the paged pool, paged decode attention) against the
torch ops they stand in for. Without a GPU, on CPU under Triton's interpreter: the same kernel
source a GPU compiles, run program by program with numpy. With one (scripts/gpu_check.sh), compiled
for it, on CUDA tensors. Small shapes (the interpreter is slow); mixed ranks with partial last
pages, base-model rows, runs in any order, block tables shuffled, GQA.

TRITON_INTERPRET must be set before triton is imported. It is set here; where triton was imported
earlier in this process without it (another module of the run), the tests run in a child process
instead (`test_in_a_child_process`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# triton imported already, without the interpreter: its language functions are GPU builds here.
PRELOADED = not ON_GPU and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (it comes with the structured-output extra)")

from harness.lora_pages import make_slots, paginate  # noqa: E402
from inference_service.kernels import triton_attention, triton_lora  # noqa: E402
from inference_service.lora.ops import SlicedB, TorchLoRAOp, build_lora_batch  # noqa: E402
from inference_service.lora.triton_op import TritonLoRAOp  # noqa: E402
from inference_service.models.attention import TorchPagedAttention  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
in_process = pytest.mark.skipif(PRELOADED, reason="triton was imported earlier in this process without its "
                                "interpreter: test_in_a_child_process runs these tests")


def on_device(a_pages: torch.Tensor, b_pages: list[SlicedB], slot_pages: dict, zero_page: int):
    """`paginate`'s pool on the device the kernels run on."""
    return a_pages.to(DEVICE), [SlicedB(s.start, s.end, s.b.to(DEVICE)) for s in b_pages], slot_pages, zero_page


if PRELOADED:  # defined only then: a GPU run must skip nothing

    def test_in_a_child_process():
        root = Path(__file__).resolve().parents[1]
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                               cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                               timeout=600)
        assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]


@in_process
def test_kernels_run_as_intended():
    """The premise of every test here: on CPU the kernels are the interpreter's; on a GPU, compiled."""
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (triton_lora._shrink_kernel, triton_lora._expand_kernel, triton_attention._paged_decode_kernel):
        assert isinstance(kernel, InterpretedFunction) != ON_GPU


@in_process
@pytest.mark.parametrize(("page_rank", "shape", "token_slots"), [
    # base-model rows first, then runs by slot (the model runner's order); ranks 1-8 in pages of 3
    (3, (12, (6, 4, 4)), [-1, -1, 0, 0, 0, 2, 3, 3, 4]),
    # rows in any order: runs of one row, an adapter in two runs, base rows between
    (3, (12, (6, 4, 4)), [4, -1, 1, 1, 0, 4, -1, 2, 1]),
    # a projection of one module with more output columns than one expand tile; whole-rank pages
    (8, (32, (80,)), [0, 1, 1, -1, 3, 2, 2, 2]),
])
def test_triton_lora_matches_torch_op(page_rank, shape, token_slots):
    gen = torch.Generator().manual_seed(len(token_slots) * page_rank)
    size_in, outs = shape
    ranks = [1, 8, 5, 3, 7]  # below, at and between page boundaries
    a, bs = make_slots(ranks, gen, size_in, outs)
    a_pages, b_pages, slot_pages, zero_page = on_device(*paginate(a, bs, ranks, page_rank, gen))
    batch = build_lora_batch(token_slots, slot_pages, dict(enumerate(ranks)), page_rank, zero_page, DEVICE)
    assert batch is not None
    x = torch.randn(len(token_slots), size_in, generator=gen).to(DEVICE)
    start = torch.randn(len(token_slots), sum(outs), generator=gen).to(DEVICE)  # deltas add to what is there
    expected = start.clone()
    TorchLoRAOp(DEVICE).apply(x, expected, a_pages, b_pages, batch)
    rank_major = [SlicedB(s.start, s.end, s.b.transpose(1, 2).contiguous()) for s in b_pages]
    out = start.clone()
    TritonLoRAOp(DEVICE).apply(x, out, a_pages, rank_major, batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    base_rows = [row for row, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(out[base_rows], start[base_rows])  # base-model rows untouched


@in_process
def test_triton_expand_reads_peft_layout_and_skips_empty_runs():
    """B in PEFT's [pages, out, R] layout (strides), and runs with first == end (a captured graph's
    unused runs) doing nothing."""
    gen = torch.Generator().manual_seed(7)
    ranks = [4, 6, 2, 8, 1]
    a, bs = make_slots(ranks, gen, 12, (6, 4, 4))
    a_pages, b_pages, slot_pages, zero_page = on_device(*paginate(a, bs, ranks, 4, gen))
    token_slots = [1, 1, 3, -1, 0]
    batch = build_lora_batch(token_slots, slot_pages, dict(enumerate(ranks)), 4, zero_page, DEVICE)
    assert batch is not None and batch.runs is not None and batch.run_pages is not None
    x = torch.randn(len(token_slots), 12, generator=gen).to(DEVICE)
    expected = torch.zeros(len(token_slots), 14, device=DEVICE)
    TorchLoRAOp(DEVICE).apply(x, expected, a_pages, b_pages, batch)
    runs = torch.cat([batch.runs, torch.zeros(3, 4, dtype=torch.long, device=DEVICE)])  # three empty runs after
    # only rows of runs are read: NaN anywhere else would show
    shrunk = torch.full((len(token_slots), 3, batch.max_rank), float("nan"), device=DEVICE)
    triton_lora.lora_shrink(x, a_pages, shrunk, runs, batch.run_pages, 3)
    out = torch.zeros_like(expected)
    for module, s in enumerate(b_pages):
        triton_lora.lora_expand(shrunk, s.b, out, runs, batch.run_pages, module, s.start, b_rank_major=False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@in_process
@pytest.mark.parametrize(("block_size", "num_heads", "num_kv_heads", "head_dim"), [
    (4, 4, 2, 16),  # GQA, groups of two
    (3, 6, 1, 12),  # a block size and head size that are not powers of two (masked), one KV head
])
def test_triton_paged_decode_matches_torch(block_size, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, lens = 24, [1, block_size, block_size + 1, 9, 17]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    width = max(-(-n // block_size) for n in lens)
    shuffled = torch.randperm(num_blocks, generator=gen)  # each sequence's blocks anywhere, in any order
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for row, n in enumerate(lens):
        count = -(-n // block_size)
        tables[row, :count] = shuffled[used : used + count]
        used += count
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    q, k_cache, v_cache, tables, lens_t = (t.to(DEVICE) for t in (q, k_cache, v_cache, tables, torch.tensor(lens)))
    expected = TorchPagedAttention().decode(q, k_cache, v_cache, tables, lens_t)
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens_t)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Lengths and tables as columns of one tensor, as a captured step's static buffers hold them.
    packed = torch.cat([lens_t[:, None], tables], dim=1)
    strided = triton_attention.paged_decode_attention(q, k_cache, v_cache, packed[:, 1:], packed[:, 0])
    torch.testing.assert_close(strided, expected, atol=1e-5, rtol=1e-5)


@in_process
def test_selectors_pick_the_triton_kernels_on_cuda_only():
    """The platform plan's op and backend: Triton on CUDA (the torch op when asked), never on CPU. Making
    them touches no device, so this holds without a GPU."""
    from harness.platform import plan_for
    from inference_service.models.attention import TritonPagedAttention

    cuda = plan_for("cuda", torch.bfloat16)
    assert isinstance(cuda.make_lora_op(), TritonLoRAOp)
    assert isinstance(plan_for("cuda", torch.bfloat16, triton_kernels=False).make_lora_op(), TorchLoRAOp)
    assert isinstance(cuda.model_compute().attention, TritonPagedAttention)
    assert isinstance(plan_for("cuda", torch.bfloat16, attention_backend="torch").model_compute().attention,
                      TorchPagedAttention)
    cpu = plan_for("cpu", torch.float32)
    assert not isinstance(cpu.make_lora_op(), TritonLoRAOp)
    assert not isinstance(cpu.model_compute().attention, TritonPagedAttention)
