"""Dense projections, with weights prepacked once for oneDNN on CPU.

MKL's GEMM behind `F.linear` repacks the weight on every call; at decode batch sizes that repacking
is 15-30% of a projection (more in bf16). A oneDNN-packed weight (what torch's own inductor uses
when it freezes a CPU model) skips it and works for any batch size. The packing op is private to
torch, so it is probed once per process and the plain path is kept wherever it is missing or
disagrees with `F.linear`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of weight [out, in], or None where the plain path should be used."""
    if weight.device.type != "cpu" or not _packing_works(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        bias = torch.randn(48, generator=gen).to(dtype)
        expected = F.linear(x, weight, bias)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = linear(x, weight, bias, packed)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        if got.dtype == dtype and torch.allclose(got, expected, atol=tolerance, rtol=tolerance):
            return True
        log.warning("oneDNN prepacked linear disagrees with F.linear in %s: using F.linear", dtype)
    except (AttributeError, RuntimeError) as exc:
        log.info("oneDNN prepacked linear unavailable in %s (%s): using F.linear", dtype, exc)
    return False
