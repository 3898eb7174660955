"""fp32 projections on CPUs with AVX2 and FMA but no AVX-512 (`avx2_linear.c`).

On such CPUs (AMD Zen 1-3, older Intel) oneDNN's packed fp32 GEMM reads a decode step's weights at a
third of a plain read's rate; this kernel reads them at 1.2-2.8x its rate at 1-8 rows and matches or
beats it up to a 256-row prefill chunk (docs/architecture.md, "Decode on an AVX2-only CPU").
`pack` turns a weight [N, K] into 16-column panels, or gives None where the kernel cannot take it
(not fp32, N not a multiple of 16, an AVX-512 CPU, the kernel not built, `LORAPLEX_CPU_KERNELS=0`);
the caller then keeps oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from inference_service.kernels.build import load_library
from inference_service.kernels.projection_rows import project_rows

log = logging.getLogger(__name__)

PANEL = 16  # the kernel's column panel
_VOID_P, _INT64 = ctypes.c_void_p, ctypes.c_int64


class AVX2Weight:
    """A weight [N, K] as [N/16][K][16] panels: out = x @ W^T (+ bias) for any number of rows, in fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self._fn = _function()
        assert self._fn is not None, "an AVX2Weight exists only where the kernel runs"
        self.panels = weight.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert x.dtype == torch.float32

        def kernel(x2: int, b: int | None, out: int, rows: int) -> None:
            self._fn(x2, self.panels.data_ptr(), b, out, rows, self.out_features, self.in_features)

        return project_rows(x, bias, self.in_features, self.out_features, torch.float32, kernel)

    def float_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self(x, bias)  # already fp32


def pack(weight: torch.Tensor) -> AVX2Weight | None:
    """The panel layout of weight [N, K], or None where the kernel cannot take it."""
    n, _ = weight.shape
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or n % PANEL or not available():
        return None
    return AVX2Weight(weight)


def available() -> bool:
    return _function() is not None


@functools.cache
def _function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    library = load_library("avx2_linear")
    if library is None:
        return None
    library.avx2_linear_init.restype = ctypes.c_int
    if not library.avx2_linear_init():
        log.info("an AVX-512 CPU (or one without AVX2/FMA): fp32 projections use oneDNN")
        return None
    fn = library.avx2_linear_f32
    fn.restype = None
    fn.argtypes = [_VOID_P] * 4 + [_INT64] * 3
    return fn
