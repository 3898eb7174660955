"""The model's CPU fast paths against their plain torch equivalents: oneDNN-prepacked projections,
the reused block-gather buffers, and the C paged decode attention kernel (with its fallback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, run_to_completion
from harness.platform import compute_for
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.kernels import amx_linear, avx2_linear, bf16_linear, bindings, build, fused, greedy, variants
from inference_service.kernels import paged_attention as cpu_kernels
from inference_service.lora import backend as lora_kernel
from inference_service.models import linear as dense
from inference_service.models.attention import CpuPagedAttention, GatherScratch, TorchPagedAttention
from inference_service.models.batch import AttentionBatch, PrefillSegment
from inference_service.models.loader import BUILTIN_TINY, load_model

CPU = torch.device("cpu")
needs_amx = pytest.mark.skipif(not amx_linear.available(), reason="needs a CPU with AMX (and a compiler)")
needs_avx2_kernel = pytest.mark.skipif(not avx2_linear.available(),
                                       reason="needs a CPU with AVX2 and FMA (and a compiler)")
# Whether this CPU lets oneDNN pack bf16 weights (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not an AVX2-only
# CPU such as AMD Zen 1, where `pack` keeps bf16 on F.linear).
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_bf16_kernel = pytest.mark.skipif(not bf16_linear.available(),
                                       reason="needs a CPU with AVX-512 BF16 (and a compiler)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_linear_matches_f_linear(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    packed = dense.pack(weight)
    if dtype == torch.bfloat16 and not ONEDNN_BF16:
        # oneDNN packs bf16 only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU the
        # AVX2 kernel takes it (where built), else the plain path
        assert isinstance(packed, avx2_linear.AVX2Weight if avx2_linear.preferred() else type(None))
    else:
        assert packed is not None, "oneDNN packing should be available in torch's CPU build"
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(dense.linear(x, weight, bias, packed), F.linear(x, weight, bias),
                               atol=tolerance, rtol=tolerance)


def test_loaded_model_holds_each_weight_once():
    """Prepacking replaces the dense projection weights instead of doubling the model's memory."""
    model, _ = load_model(BUILTIN_TINY, CPU, torch.float32, compute=compute_for(CPU, torch.float32))
    projections = model.layers[0].projections()
    assert len(projections) == 4 and all(p.packed is not None for p in projections)
    assert model.packed_lm_head is not None
    assert all(p.weight.numel() == 0 for p in projections) and model.lm_head.numel() == 0


def test_gather_scratch_reuses_its_buffer_and_gathers_whole_blocks():
    cache = torch.randn(20, 4, 2, 8)  # [num_blocks, block_size, kv_heads, head_dim]
    scratch = GatherScratch()
    big = torch.tensor([[3, 1, 7], [0, 19, 2]])
    first = scratch.gather(0, cache, big)
    torch.testing.assert_close(first, cache[big], rtol=0, atol=0)
    small = torch.tensor([[5], [6]])
    second = scratch.gather(0, cache, small)
    torch.testing.assert_close(second, cache[small], rtol=0, atol=0)
    assert second.data_ptr() == first.data_ptr(), "a smaller gather must reuse the buffer"
    other = scratch.gather(1, cache, small)
    assert other.data_ptr() != second.data_ptr(), "K and V need separate buffers"


def _gather_sdpa(q, k_cache, v_cache, tables, lens):
    """The model's torch path for decode attention, as the reference."""
    batch, kv_heads, head_dim = tables.shape[0], k_cache.shape[2], k_cache.shape[3]
    keys = k_cache[tables].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_cache[tables].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(keys.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    return out.squeeze(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Query groups of 1, 2, 3, 4 and 9 heads (the vector path takes them 4 at a time, then 3, 2 or 1), head
# dims that are multiples of 16, of 8 only (a last 8-wide step), and of neither (the scalar path).
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 32), (6, 3, 8), (9, 3, 64), (18, 2, 24),
                                                      (4, 2, 12)])
@pytest.mark.parametrize("batch", [6, 1])  # a task per sequence; a task per KV head (fewer sequences than threads)
def test_paged_decode_kernel_matches_gather_and_sdpa(dtype, q_heads, kv_heads, head_dim, batch):
    gen = torch.Generator().manual_seed(q_heads * 100 + head_dim)
    num_blocks, block_size = 40, 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor([13, 4, 5, 1, 16, 2])[:batch]  # one token, exact and partial blocks
    width = -(-int(lens.max()) // block_size)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.long)  # padded with block 0, as the runner does
    for b, n in enumerate(lens.tolist()):
        used = -(-n // block_size)
        tables[b, :used] = torch.tensor([order.pop() for _ in range(used)])
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen).to(dtype)
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens)
    assert got is not None, "the kernel should build with the compiler on these machines"
    expected = _gather_sdpa(q.float(), k_cache.float(), v_cache.float(), tables, lens)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def _bf16_contexts(q_heads: int, kv_heads: int, head_dim: int, block_size: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k_cache, v_cache, tables, lens) in bf16 for 8 sequences of 1, 15, 16, 17, 33, 100, 0 and 64
    tokens: contexts ending inside a 16-token chunk, on one's edge, past several, and an empty one."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([1, 15, 16, 17, 33, 100, 0, 64])
    width = -(-int(lens.max()) // block_size)
    num_blocks = width * len(lens) + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, tables, lens


# Groups of 1-8 query heads (P V takes 4 at a time for 64 dims and under, 2 for more), head dims 32-128.
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 32), (14, 2, 64), (8, 1, 128),
                                                      (12, 4, 96), (4, 4, 128)])
def test_bf16_decode_attention_over_contexts_of_many_16_token_chunks_matches_gather_and_sdpa(q_heads, kv_heads,
                                                                                             head_dim):
    """bf16 caches, contexts ending inside, on and past 16-token chunks (the AVX-512 BF16 path sums 16
    tokens' scores at once), an empty one among them; more sequences than threads and fewer."""
    q, k_cache, v_cache, tables, lens = _bf16_contexts(q_heads, kv_heads, head_dim, 16, seed=q_heads * 1000 + head_dim)
    for rows in (slice(None), slice(5, 6)):
        got = cpu_kernels.decode_attention(q[rows], k_cache, v_cache, tables[rows], lens[rows])
        assert got is not None
        live = lens[rows] > 0
        assert not got[~live].any(), "an empty context attends to nothing"
        expected = _gather_sdpa(q[rows].float()[live], k_cache.float(), v_cache.float(), tables[rows][live],
                                lens[rows][live])
        torch.testing.assert_close(got[live].float(), expected, atol=2e-2, rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 64), (12, 2, 64), (4, 2, 128),
                                                      (16, 1, 128)])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_amx_decode_attention_matches_gather_and_sdpa(q_heads, kv_heads, head_dim, block_size):
    """The AMX variant (bf16, head_dim 64 and 128): query groups of 1 to 16 heads (in sub-blocks of
    its registers), contexts ending inside a tile, on a tile's edge and past several blocks."""
    assert cpu_kernels._amx_kernel(q_heads, kv_heads, head_dim, block_size) is not None
    q, k_cache, v_cache, tables, lens = _bf16_contexts(q_heads, kv_heads, head_dim, block_size,
                                                       seed=q_heads * 1000 + head_dim + block_size)
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens)
    assert got is not None
    assert not got[6].any(), "an empty context attends to nothing"
    live = lens > 0
    expected = _gather_sdpa(q.float()[live], k_cache.float(), v_cache.float(), tables[live], lens[live])
    torch.testing.assert_close(got[live].float(), expected, atol=2e-2, rtol=2e-2)


def _paged_causal_sdpa(q, k_cache, v_cache, table, start):
    """A prefill chunk's attention as the torch path computes it: the sequence's blocks gathered, SDPA
    with each query at position start + i seeing keys 0 .. start + i."""
    count, _, head_dim = q.shape
    kv_heads, length = k_cache.shape[2], start + count
    keys = k_cache[table].reshape(-1, kv_heads, head_dim)[:length]
    values = v_cache[table].reshape(-1, kv_heads, head_dim)[:length]
    mask = torch.arange(length)[None, :] <= (start + torch.arange(count))[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         values.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Query groups of 1, 3, 4, 9 and 64 heads (one position a task), head dims that are multiples of 16 and
# of 8 only (a last 8-wide step), and a group whose rows are not a multiple of 16 (a last 8-row vector).
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 24), (18, 2, 8), (64, 1, 32),
                                                      (3, 1, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_prefill_kernel_matches_gather_and_sdpa(dtype, q_heads, kv_heads, head_dim, block_size):
    """Chunks of one and several positions, first chunks and chunks after cached context, ending inside a
    key tile, on its edge and past several tiles (64 keys), over blocks in any order."""
    for start, count in [(0, 1), (0, 5), (0, 70), (3, 1), (6, 3), (64, 64), (100, 37), (0, 200)]:
        gen = torch.Generator().manual_seed(q_heads * 1000 + head_dim * 10 + block_size + start + count)
        length = start + count
        used = -(-length // block_size)
        k_cache, v_cache = (torch.randn(used + 3, block_size, kv_heads, head_dim, generator=gen).to(dtype)
                            for _ in range(2))
        table = torch.randperm(used + 3, generator=gen)[:used]
        q = torch.randn(count, q_heads, head_dim, generator=gen).to(dtype)
        got = cpu_kernels.prefill_attention(q, k_cache, v_cache, table, start)
        assert got is not None, "the kernel should build with the compiler on these machines"
        expected = _paged_causal_sdpa(q.float(), k_cache.float(), v_cache.float(), table, start)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance,
                                   msg=lambda m, s=start, c=count: f"chunk of {c} after {s}: {m}")


def test_paged_prefill_kernel_declines_what_it_does_not_take():
    """None (the caller's torch path runs) for a head dim that is not a multiple of 8, a table too short
    for the chunk, other dtypes and a cache of another dtype than q; an empty chunk is an empty output."""
    k_cache = torch.randn(4, 4, 2, 12)
    q = torch.randn(3, 4, 12)
    assert cpu_kernels.prefill_attention(q, k_cache, k_cache, torch.arange(4), 0) is None
    k_cache, q = torch.randn(4, 4, 2, 16), torch.randn(3, 4, 16)
    assert cpu_kernels.prefill_attention(q, k_cache, k_cache, torch.arange(1), 2) is None  # 5 tokens, 4 slots
    assert cpu_kernels.prefill_attention(q.half(), k_cache.half(), k_cache.half(), torch.arange(4), 0) is None
    assert cpu_kernels.prefill_attention(q, k_cache.bfloat16(), k_cache.bfloat16(), torch.arange(4), 0) is None
    assert cpu_kernels.prefill_attention(q, k_cache, k_cache, torch.arange(4), 0) is not None
    assert cpu_kernels.prefill_attention(q[:0], k_cache, k_cache, torch.arange(4), 0).shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill_kernel", [False, True])
def test_attention_backends_agree_on_a_mixed_step(dtype, prefill_kernel):
    """The C backend (decode in place; prefill chunks on the C kernel or as torch) and the torch
    backend (gather + SDPA) on one step with decode rows, a first prefill chunk and a later chunk over
    cached context."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, q_heads, kv_heads, head_dim = 32, 4, 4, 2, 16
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    # Rows: 0-1 decodes (contexts 7 and 3), 2-6 a first chunk of 5, 7-9 a chunk of 3 after 6 cached.
    tables = [[5, 9], [11], [2, 3], [20, 21, 22]]
    slot_mapping = [9 * block_size + 2, 11 * block_size + 2, *range(2 * block_size, 2 * block_size + 4),
                    3 * block_size, *(21 * block_size + p for p in (2, 3)), 22 * block_size]
    batch = AttentionBatch(
        slot_mapping=torch.tensor(slot_mapping),
        decode_rows=torch.tensor([0, 1]),
        decode_block_tables=torch.tensor([tables[0], tables[1] + [0]]),
        decode_lens=torch.tensor([7, 3]),
        prefills=[PrefillSegment(2, 7, 0, torch.tensor(tables[2])), PrefillSegment(7, 10, 6, torch.tensor(tables[3]))],
    )
    q = torch.randn(10, q_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(10, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    outs = []
    for backend in (TorchPagedAttention(), CpuPagedAttention(prefill_kernel)):
        kv = (caches[0].clone(), caches[1].clone())
        outs.append((backend.forward(q, k, v, kv, batch, cached=False), kv))
    (torch_out, torch_kv), (c_out, c_kv) = outs
    assert torch.equal(torch_kv[0], c_kv[0]) and torch.equal(torch_kv[1], c_kv[1])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(c_out.float(), torch_out.float(), atol=tolerance, rtol=tolerance)


def generate(adapters: dict[str, Path] | None = None, dtype: str = "float32",
             **settings: str) -> tuple[list[list[int]], str]:
    """Greedy tokens of 6 requests of different lengths (cycling through base model and the
    adapters), and the names of the LoRA op and attention backend the engine used. `settings`:
    the platform's switches (kernels="off", attention_backend="torch")."""
    adapters = adapters or {}
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu", dtype=dtype, max_num_seqs=8, max_loras=2,
                                   max_lora_rank=8, **settings))
    load_adapters(core, adapters, preload=True)
    names = [None, *adapters]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for i in range(6):
        core.add_request(Request(f"r{i}", list(range(3, 3 + 5 * i + 1)), params), names[i % len(names)])
    outputs = run_to_completion(core)
    ops = f"{type(core.runner.model.lora_op).__name__}, {type(core.runner.model.attention).__name__}"
    core.shutdown()
    return [[t for o in outputs[f"r{i}"] for t in o.new_token_ids] for i in range(6)], ops


def test_engine_output_is_the_same_with_and_without_the_kernel(monkeypatch):
    """The torch fallback (GPU, or a CPU without a compiler) and the kernel agree end to end."""
    with_kernel, _ = generate()
    calls = []
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *args: calls.append(1))
    assert generate()[0] == with_kernel
    assert calls, "the fallback run should have asked for the kernel and been refused"


def test_engine_output_is_the_same_without_prepacked_weights(monkeypatch, tmp_path):
    """Where oneDNN's packing is missing or disagrees (`linear._packing_works` false: `pack` gives
    None), every projection and the LM head take F.linear, with adapters and without."""
    adapters = {"a": write_tiny_adapter(tmp_path / "a", seed=1, rank=4)}
    packed, _ = generate(adapters)
    monkeypatch.setattr(dense, "_packing_works", lambda dtype: False)
    monkeypatch.setattr(avx2_linear, "available", lambda: False)
    model, _ = load_model(BUILTIN_TINY, CPU, torch.float32, compute=compute_for(CPU, torch.float32))
    assert model.packed_lm_head is None and all(p.packed is None for p in model.layers[0].projections())
    assert generate(adapters)[0] == packed


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 100, 300, 530, 1100])
def test_amx_linear_is_the_fp32_product_rounded_once(rows, bias):
    """Every row count (a partial 16-row tile, two, several 32-row blocks, more than one block
    chunk, and the many-rows path that splits rows between threads, with a partial last block)
    against the fp32 product rounded to bf16: equal but where fp32 summation order moves a value
    across a rounding boundary: within one bf16 step plus fp32 summation's own error bound."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 1536, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 1536, generator=gen).to(torch.bfloat16)
    packed = dense.pack(weight)
    assert isinstance(packed, amx_linear.AMXWeight)
    got = dense.linear(x, weight, b, packed)
    expected = x.float() @ weight.float().T + (b.float() if bias else 0)
    rounded = expected.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    summation = 1536 * 2**-24 * (x.float().abs() @ weight.float().abs().T)  # fp32's order error bound
    assert ((got.float() - expected).abs() <= expected.abs() * 2**-7 + summation).all()
    assert (got == rounded).float().mean() > 0.99


@needs_amx
def test_amx_float_output_is_the_bf16_product_widened():
    """The LM head's fp32 logits in one pass: exactly `.float()` of the bf16 product."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(320, 64, generator=gen).to(torch.bfloat16)
    packed = dense.pack(weight)
    assert isinstance(packed, amx_linear.AMXWeight)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        got = dense.linear_float(x, weight, None, packed)
        assert got.dtype == torch.float32 and torch.equal(got, packed(x, None).float())


@needs_amx
@pytest.mark.parametrize("vocab", [32, 320, 4096])
@pytest.mark.parametrize("rows", [1, 5, 17, 32, 33, 100, 300])
def test_amx_greedy_pick_is_the_pick_from_the_logits(rows, vocab):
    """The LM head's fused pick (no logits written) against the pick from its fp32 logits: small
    integers make exact ties within a thread's columns and, with the weight's second half a copy of
    its first, between the threads' halves; a NaN in one row's input, an overflow to +inf in
    another's, a NaN bias column (every row) and a +inf bias column. One column block (one thread
    idle), several, and more rows than one 256-row chunk."""
    gen = torch.Generator().manual_seed(rows * vocab)
    weight = torch.randint(-2, 3, (vocab, 64), generator=gen).to(torch.bfloat16)
    weight[vocab // 2:] = weight[: vocab - vocab // 2]
    x = torch.randint(-2, 3, (rows, 64), generator=gen).to(torch.bfloat16)
    if rows > 2:
        x[1, 5] = float("nan")
        x[2] = 3e38
    packed = dense.pack(weight)
    assert isinstance(packed, amx_linear.AMXWeight)
    plain = torch.randint(-3, 3, (vocab,), generator=gen).to(torch.bfloat16)
    nan_column, inf_column = plain.clone(), plain.clone()
    nan_column[vocab // 3] = float("nan")
    inf_column[vocab - 1] = float("inf")
    for bias in (None, plain, nan_column, inf_column):
        expected = greedy.argmax_rows(packed.float_output(x, bias))
        assert expected is not None
        got = dense.greedy_pick(x, bias, packed)
        assert got is not None and got[0].dtype == torch.int64 and got[1].dtype == torch.bool
        assert torch.equal(got[1], expected[1])
        assert torch.equal(got[0][expected[1]], expected[0][expected[1]])
        if bias is plain:
            assert expected[1][3:].all() and (rows <= 2 or not expected[1][1:3].any())
    assert not expected[1].any()  # the +inf column is every row's maximum


@needs_amx
def test_engine_greedy_tokens_are_the_same_with_the_fused_pick(monkeypatch, tmp_path):
    """SmolLM2 in bf16 (its LM head on AMX), base and an adapter: the tokens of greedy requests
    picked in the LM head equal those picked from the logits (the fused pick refused), and a batch
    with a row that reads its logits (logprobs) takes the logits for the whole step."""
    from harness.real_model import require_real_model
    from inference_service.demo_adapters import write_peft_adapter

    core = EngineCore(EngineConfig(model=str(require_real_model()), device="cpu", dtype="bfloat16",
                                   max_num_seqs=8, max_loras=1, max_lora_rank=8))
    model = core.runner.model
    adapter = write_peft_adapter(tmp_path / "r8", model.config, rank=8, alpha=16.0, seed=8, scale=0.05)
    load_adapters(core, {"r8": adapter}, preload=True)
    fused = model.greedy
    picks: list[int] = []

    def counted(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        picks.append(hidden.shape[0])
        return fused(hidden)

    def run(tag: str, params: SamplingParams) -> list[list[int]]:
        for i in range(4):
            core.add_request(Request(f"{tag}{i}", list(range(100, 106 + 5 * i)), params), [None, "r8"][i % 2])
        outputs = run_to_completion(core)
        return [[t for o in outputs[f"{tag}{i}"] for t in o.new_token_ids] for i in range(4)]

    greedy_params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    monkeypatch.setattr(model, "greedy", counted)
    on_head = run("a", greedy_params)
    assert sum(picks) >= 4 * 12  # every sampled row of every step
    monkeypatch.setattr(model, "greedy", lambda hidden: None)
    assert run("b", greedy_params) == on_head
    picks.clear()
    monkeypatch.setattr(model, "greedy", counted)
    assert run("c", SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=1)) == on_head
    assert picks == []
    core.shutdown()


def test_greedy_pick_is_none_without_amx():
    """oneDNN's packed weight and a plain weight have no fused pick: the runner takes the logits."""
    x = torch.randn(3, 64)
    assert dense.greedy_pick(x, None, dense.pack(torch.randn(64, 64))) is None
    assert dense.greedy_pick(x, None, None) is None


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_greedy_pick_is_torch_max(vocab):
    """First argmax and the row's finiteness as `max(dim=-1)` gives them: ties (small integers), a
    NaN anywhere, a +inf maximum, an all -inf row, -inf entries beside finite ones."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(-3, 3, (8, vocab), generator=gen).float()
    logits[1, vocab // 2] = float("nan")
    logits[2] = float("-inf")
    logits[3, vocab - 1] = float("inf")
    logits[4, : vocab // 2] = float("-inf")
    picked = greedy.argmax_rows(logits)
    assert picked is not None, "the kernel should build with the compiler on these machines"
    best = logits.max(dim=-1)
    finite = torch.isfinite(best.values)
    assert torch.equal(picked[1], finite) and not finite[1:4].any()
    assert torch.equal(picked[0][finite], best.indices[finite])
    assert greedy.argmax_rows(logits.to(torch.bfloat16)) is None  # the sampler keeps torch's max


@pytest.mark.skipif(build.find_compiler() is None or not variants.for_machine(), reason="needs a C compiler on x86-64")
def test_every_build_of_the_greedy_pick_is_torch_max(tmp_path):
    """greedy.c built for each variant this CPU runs (its lanes as wide as the build's registers: 4, 8 or
    16): the first argmax and finiteness at vocab sizes around every lane count, as `max(dim=-1)`."""
    import ctypes

    compiler = build.find_compiler()
    for variant in variants.runnable(variants.cpu_flags(), variants.for_machine()):
        path = tmp_path / f"greedy-{variant.name}.so"
        build.compile_library(compiler, "greedy", variant.flags, path)
        fn = ctypes.CDLL(str(path)).argmax_rows_f32
        signature = bindings.LIBRARIES["greedy"]["argmax_rows_f32"]
        fn.restype, fn.argtypes = signature.restype, list(signature.argtypes)
        for vocab in (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 4099):
            gen = torch.Generator().manual_seed(vocab)
            logits = torch.randint(-3, 3, (6, vocab), generator=gen).float()
            logits[1, vocab // 2] = float("nan")
            logits[2] = float("-inf")
            logits[3, vocab - 1] = float("inf")
            idx, finite = torch.empty(6, dtype=torch.int64), torch.empty(6, dtype=torch.bool)
            fn(logits.data_ptr(), 6, vocab, idx.data_ptr(), finite.data_ptr())
            best = logits.max(dim=-1)
            expected = torch.isfinite(best.values)
            assert torch.equal(finite, expected), (variant.name, vocab)
            assert torch.equal(idx[expected], best.indices[expected]), (variant.name, vocab)


def test_pack_keeps_onednn_where_amx_cannot_run(monkeypatch):
    """fp32, a width that is not a multiple of 32 (builtin:tiny's LM head) and a CPU without AMX or
    AVX-512 BF16 (forced) take oneDNN's packed weight; bf16 only where oneDNN can pack it, else the
    plain path."""
    bf16 = torch.randn(64, 64).to(torch.bfloat16)
    monkeypatch.setattr(avx2_linear, "available", lambda: False)  # an AVX-512 CPU, or no AVX2
    assert isinstance(dense.pack(torch.randn(64, 64)), dense.OneDNNWeight)
    bf16_form = dense.OneDNNWeight if ONEDNN_BF16 else type(None)
    assert isinstance(dense.pack(torch.randn(258, 64).to(torch.bfloat16)), bf16_form)
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    if bf16_linear.available():  # a CPU without AMX but with AVX-512 BF16 takes that kernel
        assert isinstance(dense.pack(bf16), bf16_linear.BF16Weight)
    monkeypatch.setattr(bf16_linear, "available", lambda: False)
    assert isinstance(dense.pack(bf16), bf16_form)


@needs_amx
def test_engine_output_is_the_same_on_onednn_as_on_amx(monkeypatch, tmp_path):
    """bf16 end to end with an adapter: the AMX projections and oneDNN's (forced) give the same tokens."""
    adapters = {"a": write_tiny_adapter(tmp_path / "a", seed=1, rank=4)}
    on_amx, _ = generate(adapters, "bfloat16")
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    monkeypatch.setattr(bf16_linear, "available", lambda: False)
    model, _ = load_model(BUILTIN_TINY, CPU, torch.bfloat16, compute=compute_for(CPU, torch.bfloat16))
    assert all(isinstance(p.packed, dense.OneDNNWeight) for p in model.layers[0].projections())
    assert generate(adapters, "bfloat16")[0] == on_amx


def forget_kernels() -> None:
    for cached in (build.load_library, bindings.function, cpu_kernels._kernel, lora_kernel._function,
                   fused._function, amx_linear._function, greedy._function):
        cached.cache_clear()


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path):
    """An empty kernel cache and no prebuilt kernels (each is built at run time, the fallback), and the
    process's loaded kernels forgotten before and after."""
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_KERNEL_PREBUILT", str(tmp_path / "no-prebuilt"))
    forget_kernels()
    yield tmp_path
    forget_kernels()


def test_engine_with_adapters_is_the_same_on_the_torch_paths(kernel_cache, tmp_path):
    """All three kernels (LoRA op with its rank-major slots, fused layer ops, decode attention)
    against the torch paths a GPU or `--kernels off` takes, end to end with adapters of two ranks and
    base-model requests in one batch; `--attention-backend torch` keeps the other kernels."""
    adapters = {"a": write_tiny_adapter(tmp_path / "a", seed=1, rank=4),
                "b": write_tiny_adapter(tmp_path / "b", seed=2, rank=8)}
    with_kernels, ops = generate(adapters)
    assert ops == "CpuLoRAOp, CpuPagedAttention"
    on_torch, ops = generate(adapters, kernels="off")
    assert ops == "TorchLoRAOp, TorchPagedAttention"
    assert on_torch == with_kernels
    torch_attention, ops = generate(adapters, attention_backend="torch")
    assert ops == "CpuLoRAOp, TorchPagedAttention"
    assert torch_attention == with_kernels


def test_no_compiler_falls_back(monkeypatch, kernel_cache, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    q = torch.randn(1, 2, 8)
    cache = torch.randn(2, 4, 2, 8)
    assert cpu_kernels.decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                        torch.ones(1, dtype=torch.long)) is None
    assert "could not build" in caplog.text
    assert list(kernel_cache.iterdir()) == [], "no partial library is left behind"


@pytest.mark.parametrize("cc", [None, "/nonexistent/cc"])
def test_no_compiler_on_the_path_falls_back(monkeypatch, kernel_cache, caplog, tmp_path_factory, cc):
    """CC unset and no cc or gcc on PATH (a slim image): no build is tried, the torch path is kept and
    the log says why; CC naming a file that is not there is a build that fails, the same way."""
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-bin")))
    if cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", cc)
    q = torch.randn(1, 2, 8)
    cache = torch.randn(2, 4, 2, 8)
    assert cpu_kernels.decode_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                        torch.ones(1, dtype=torch.long)) is None
    assert ("no C compiler found" if cc is None else "could not build") in caplog.text
    assert list(kernel_cache.iterdir()) == []


def _cpu_flags() -> set[str]:
    """This CPU's feature flags as the process's choices read them (capped by LORAPLEX_CPU_VARIANT)."""
    return set(variants.cpu_flags())


def test_the_kernels_are_ready_when_the_engine_starts(kernel_cache):
    """Built at start-up, when the platform plan probes which kernels load (every one it may choose),
    not in the first request's decode step."""
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu"))
    built = {p.name.rsplit("-", 1)[0] for p in kernel_cache.iterdir() if p.suffix == ".so"}
    # (a kernel another test loaded in this process is not built again: at least the decode step's)
    assert {"fused", "lora", "paged_decode_attention", "paged_prefill_attention"} <= built
    assert isinstance(core.runner.model.lora_op, lora_kernel.CpuLoRAOp)
    attention = core.runner.model.attention
    assert isinstance(attention, CpuPagedAttention)
    # The prefill kernel where the CPU lacks AVX-512 (torch's SDPA is kept where it has it).
    assert attention.prefill_kernel == ("avx512f" not in _cpu_flags())
    core.shutdown()


AVX2_SHAPES = [(16, 1), (48, 64), (96, 577)]  # one to several panels (an odd count), an odd depth
AVX2_ROWS = [1, 2, 3, 5, 6, 7, 8, 12, 13, 32, 300]  # every remainder of the 6-row tile, 1-2 rows over panel pairs


@needs_avx2_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", AVX2_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), AVX2_SHAPES)
def test_avx2_linear_is_the_fp32_product(rows, bias, out_features, in_features):
    """The AVX2 kernel against the fp64 product, with and without bias, and 3-D inputs; each row's
    output is the same whatever else is in the batch (one sum order for every row count)."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    assert avx2_linear.takes(weight)
    packed = avx2_linear.AVX2Weight(weight)  # on every AVX2 CPU, preferred or not
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    got = packed(x, b)
    torch.testing.assert_close(got, expected.float(), atol=1e-5 * in_features**0.5, rtol=1e-5)
    assert torch.equal(packed(x.reshape(1, rows, in_features), b), got.reshape(1, rows, out_features))
    assert torch.equal(packed.float_output(x, b), got)
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(packed(x[row:row + 1], b), got[row:row + 1]), f"row {row} alone differs"


@needs_avx2_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", AVX2_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), AVX2_SHAPES)
def test_avx2_bf16_linear_is_the_fp32_kernel_on_the_widened_values_rounded_once(rows, bias, out_features,
                                                                             in_features):
    """bf16 weights (interleaved panels, widened as read): exactly the fp32 kernel's sums on the same
    values widened, rounded once to bf16 (nearest even); `float_output` is that bf16 value widened."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + 1)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    assert avx2_linear.takes(weight) and avx2_linear.takes(weight.float())
    packed, packed_f32 = avx2_linear.AVX2Weight(weight), avx2_linear.AVX2Weight(weight.float())
    got = packed(x, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, packed_f32(x.float(), None if b is None else b.float()).to(torch.bfloat16))
    wide = packed.float_output(x, b)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    assert torch.equal(packed(x.reshape(rows, 1, in_features), b), got.reshape(rows, 1, out_features))
    for row in {0, rows - 1}:
        assert torch.equal(packed(x[row:row + 1], b), got[row:row + 1]), f"row {row} alone differs"


@needs_avx2_kernel
@needs_bf16_kernel
@pytest.mark.parametrize("out_features,in_features", [(16, 2), (48, 64), (272, 160), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 32, 67])
def test_bf16_kernel_is_the_exact_product_summed_in_fp32_and_rounded_once(rows, out_features, in_features):
    """The AVX-512 BF16 kernel against the exact product of the same bf16 values: off by at most fp32's
    accumulation error (k adds of 2^-24 relative) and one bf16 rounding; units of 1-4 panels (17 panels:
    pairs and a lone one), tiles of 1-8 rows (67: a prefill chunk's 8 full tiles and a remainder); its
    fp32 output holds exactly its bf16 values; a row's output does not depend on the rows beside it."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    weight = bf16_linear.BF16Weight(w)
    for b in (None, bias):
        got = weight(x, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        exact = x.double() @ w.double().T + (0 if b is None else b.double())
        magnitude = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
        accumulation = (in_features + 1) * 2.0**-24 * magnitude
        assert ((got.double() - exact).abs() <= 2.0**-8 * (exact.abs() + accumulation) + accumulation).all()
        assert torch.equal(weight.float_output(x, b), got.float())
    together = weight(x, bias)
    for first, count in ((0, 1), (rows - 1, 1), (rows // 2, rows - rows // 2)):
        assert torch.equal(weight(x[first:first + count], bias), together[first:first + count])


def test_bf16_kernel_takes_bf16_widths_of_16_and_even_inputs_only():
    """fp32, fp16, a width that is not a multiple of 16 (builtin:tiny's LM head: 258) and an odd input
    size keep the other paths."""
    assert not bf16_linear.takes(torch.randn(64, 64))
    assert not bf16_linear.takes(torch.randn(64, 64).to(torch.float16))
    assert not bf16_linear.takes(torch.randn(258, 64).to(torch.bfloat16))
    assert not bf16_linear.takes(torch.randn(64, 63).to(torch.bfloat16))
    assert bf16_linear.takes(torch.randn(64, 64).to(torch.bfloat16)) == bf16_linear.available()


def test_avx2_linear_takes_fp32_and_bf16_widths_of_16_only():
    """fp16 and a width that is not a multiple of 16 (builtin:tiny's LM head: 258) keep the other paths."""
    assert not avx2_linear.takes(torch.randn(64, 64).to(torch.float16))
    assert not avx2_linear.takes(torch.randn(258, 64))
    assert avx2_linear.takes(torch.randn(64, 64)) and avx2_linear.takes(torch.randn(64, 64).to(torch.bfloat16))
    assert isinstance(dense.pack(torch.randn(258, 64)), dense.OneDNNWeight)


def test_each_cpu_takes_its_preferred_projection_kernel():
    """Which kernel a model's projections get, from the CPU's flags alone: AMX for bf16 where it has
    AMX; AVX-512 BF16's for bf16 where it has that and no AMX; the AVX2 kernel for fp32 and bf16 where
    it has AVX2 and FMA but no AVX-512 (oneDNN's kernels use AVX-512 and are faster there); else oneDNN
    (bf16: only where oneDNN packs it). Each kernel runs, and is tested, wherever its instructions
    exist, preferred or not."""
    flags = _cpu_flags()
    avx2 = {"avx2", "fma"} <= flags
    assert avx2_linear.available() == avx2, "the kernels build with the compiler on these machines"
    assert avx2_linear.preferred() == (avx2 and "avx512f" not in flags)
    amx = {"amx_tile", "amx_bf16"} <= flags
    assert amx_linear.available() == amx
    # the avx512-bf16 variant or a better one runs here (its flags: x86-64-v4's, VNNI's and BF16's)
    avx512_bf16 = any(v.score >= 50 for v in variants.runnable(flags, variants.X86_64))
    assert bf16_linear.available() == avx512_bf16
    assert bf16_linear.preferred() == (avx512_bf16 and not amx)
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(BUILTIN_TINY, CPU, dtype, compute=compute_for(CPU, dtype))
        if dtype == torch.bfloat16 and amx:
            expected: type = amx_linear.AMXWeight
        elif dtype == torch.bfloat16 and avx512_bf16:
            expected = bf16_linear.BF16Weight
        elif avx2 and "avx512f" not in flags:
            expected = avx2_linear.AVX2Weight
        elif dtype == torch.float32 or ONEDNN_BF16:
            expected = dense.OneDNNWeight
        else:
            expected = type(None)
        assert {type(p.packed) for p in model.layers[0].projections()} == {expected}, (dtype, sorted(flags & {
            "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))


@pytest.fixture
def avx2_projections(monkeypatch):
    """The AVX2 kernel as the projections' kernel, fp32 and bf16, on any CPU where it runs (on an
    AVX-512 or AMX CPU another is preferred: this tests the AVX2 kernel there too)."""
    monkeypatch.setattr(avx2_linear, "preferred", lambda: True)
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    monkeypatch.setattr(bf16_linear, "available", lambda: False)
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_model(BUILTIN_TINY, CPU, dtype, compute=compute_for(CPU, dtype))
        assert all(isinstance(p.packed, avx2_linear.AVX2Weight) for p in model.layers[0].projections())


@needs_avx2_kernel
def test_engine_output_is_the_same_on_onednn_as_on_the_avx2_kernel(avx2_projections, monkeypatch, tmp_path):
    """fp32 end to end with an adapter: the AVX2 projections and oneDNN's (forced) give the same tokens."""
    adapters = {"a": write_tiny_adapter(tmp_path / "a", seed=1, rank=4)}
    on_avx2, _ = generate(adapters)
    monkeypatch.setattr(avx2_linear, "preferred", lambda: False)
    model, _ = load_model(BUILTIN_TINY, CPU, torch.float32, compute=compute_for(CPU, torch.float32))
    assert all(isinstance(p.packed, dense.OneDNNWeight) for p in model.layers[0].projections())
    assert generate(adapters)[0] == on_avx2


@needs_avx2_kernel
def test_bf16_engine_output_is_the_same_on_the_avx2_kernel_as_on_f_linear(avx2_projections, monkeypatch, tmp_path):
    """bf16 end to end with an adapter: the AVX2 kernel's projections and the plain path's (forced:
    neither the AVX2 kernel nor oneDNN's packing) give the same tokens."""
    adapters = {"a": write_tiny_adapter(tmp_path / "a", seed=1, rank=4)}
    on_avx2, _ = generate(adapters, "bfloat16")
    monkeypatch.setattr(avx2_linear, "preferred", lambda: False)
    monkeypatch.setattr(dense, "_packing_works", lambda dtype: False)
    model, _ = load_model(BUILTIN_TINY, CPU, torch.bfloat16, compute=compute_for(CPU, torch.bfloat16))
    assert not any(isinstance(p.packed, avx2_linear.AVX2Weight) for p in model.layers[0].projections())
    assert generate(adapters, "bfloat16")[0] == on_avx2
