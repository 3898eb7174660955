"""fp32 and bf16 projections on CPUs with AVX2 and FMA but no AVX-512 (`avx2_linear.c`).

On such CPUs (AMD Zen 1-3, older Intel) oneDNN's packed fp32 GEMM reads a decode step's weights at a
third of a plain read's rate; this kernel reads them at 1.2-2.8x its rate at 1-8 rows and matches or
beats it up to a 256-row prefill chunk (docs/performance.md, "Decode on an AVX2-only CPU"). Such
CPUs have no bf16 arithmetic (torch's bf16 GEMM runs at 1-7 GFLOP/s there, and oneDNN will not pack
bf16): bf16 weights keep the same panels in bf16, widened to fp32 as the kernel reads them.
The kernel runs on every CPU with AVX2 and FMA (`available`), and is the preferred projection only
where there is no AVX-512 (`preferred`; there oneDNN's kernels use it and are faster). `pack` turns a
weight [N, K] into 16-column panels where it is preferred, or gives None where it is not or cannot
take the weight (not fp32 or bf16, N not a multiple of 16, the kernel not built,
`LORAPLEX_CPU_KERNELS=0`); the caller then keeps oneDNN or `F.linear`. `AVX2Weight` packs for the
kernel wherever it runs (`takes`), which is how it is tested on AVX-512 CPUs too.
"""

from __future__ import annotations

import functools
import logging

import torch

from inference_service.kernels.bindings import CFunction, address, function
from inference_service.kernels.projection_rows import PanelWeight

log = logging.getLogger(__name__)

PANEL = 16  # the kernel's column panel
DTYPES = (torch.float32, torch.bfloat16)


class AVX2Weight(PanelWeight):
    """A weight [N, K] (fp32 or bf16) as [N/16][K][16] panels: out = x @ W^T (+ bias) for any number of
    rows, in the weight's dtype (x and bias in it too)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.dtype = weight.dtype
        functions = _functions()
        assert functions is not None, "an AVX2Weight exists only where the kernel runs"
        self._kernel = functions[0] if self.dtype == torch.float32 else functions[1]
        self._name = f"AVX2 {'fp32' if self.dtype == torch.float32 else 'bf16'}"
        panels = weight.reshape(n // PANEL, PANEL, k).permute(0, 2, 1)
        if self.dtype == torch.bfloat16:  # per k: c0 c8 c1 c9 ... c7 c15 (the kernel splits even/odd)
            panels = panels.reshape(n // PANEL, k, 2, PANEL // 2).transpose(-1, -2)
        self.panels = panels.contiguous()


def takes(weight: torch.Tensor) -> bool:
    """True if the kernel runs here and can take weight [N, K] (fp32 or bf16 on CPU, N a multiple of 16)."""
    n, _ = weight.shape
    return weight.device.type == "cpu" and weight.dtype in DTYPES and not n % PANEL and available()


def pack(weight: torch.Tensor) -> AVX2Weight | None:
    """The panel layout of weight [N, K] where the kernel is this CPU's preferred projection, or None."""
    return AVX2Weight(weight) if preferred() and takes(weight) else None


def available() -> bool:
    """The kernel runs here: built, on a CPU with AVX2 and FMA."""
    return _functions() is not None


def preferred() -> bool:
    """The kernel is this CPU's projection for fp32 and bf16: it runs here and there is no AVX-512."""
    return available() and _preferred()


@functools.cache
def _preferred() -> bool:
    fn = function("avx2_linear", "avx2_linear_preferred")
    assert fn is not None
    return bool(fn())


def kernel_address(dtype: torch.dtype) -> int | None:
    """The C function's address for weights of `dtype` (avx2_linear_f32 or _bf16), or None."""
    functions = _functions()
    if functions is None or dtype not in DTYPES:
        return None
    return address(functions[DTYPES.index(dtype)])


@functools.cache
def _functions() -> tuple[CFunction, CFunction] | None:
    """(avx2_linear_f32, avx2_linear_bf16), or None where the kernel does not run."""
    init = function("avx2_linear", "avx2_linear_init")
    if init is None:
        return None
    if not init():
        log.info("a CPU without AVX2/FMA: projections use oneDNN")
        return None
    f32, bf16 = function("avx2_linear", "avx2_linear_f32"), function("avx2_linear", "avx2_linear_bf16")
    assert f32 is not None and bf16 is not None
    return f32, bf16
