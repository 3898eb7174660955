"""The model's CPU fast paths against their plain torch equivalents: oneDNN-prepacked projections
and the reused block-gather buffers of paged attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_service.models import linear as dense
from inference_service.models.llama import GatherScratch
from inference_service.models.loader import BUILTIN_TINY, load_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_linear_matches_f_linear(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    packed = dense.pack(weight)
    assert packed is not None, "oneDNN packing should be available in torch's CPU build"
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(dense.linear(x, weight, bias, packed), F.linear(x, weight, bias),
                               atol=tolerance, rtol=tolerance)


def test_loaded_model_holds_each_weight_once():
    """Prepacking replaces the dense projection weights instead of doubling the model's memory."""
    model, _ = load_model(BUILTIN_TINY, CPU, torch.float32)
    layer = model.layers[0]
    assert set(layer.packed) == {"qkv", "o", "gate_up", "down"} and "lm_head" in model.packed
    assert layer.qkv_weight.numel() == 0 and model.lm_head.numel() == 0


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
