"""Projections on Q8_0 weights, read as blocks (`q8_linear.c`): no dequantized copy of the model.

A GGUF Q8_0 row is blocks of 34 bytes: an fp16 scale, then 32 int8 weights along the input. `pack`
repacks a weight's blocks once, at load, into the kernel's 16-column panels (still int8 + fp16
scales, 1.0625 bytes a weight against bf16's 2); the kernel widens them in registers and sums in
fp32 with FMA, on AVX2 + FMA + F16C (any AVX-512 CPU has them), else in portable C. Activations
are the model's dtype (fp32 or bf16), as for the dense kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
import torch

from inference_service.kernels.build import address, load_library
from inference_service.kernels.projection_rows import project_rows

log = logging.getLogger(__name__)

PANEL = 16  # output columns a panel holds
BLOCK = 32  # Q8_0's weights per block (along the input)
BLOCK_BYTES = 34  # fp16 scale + 32 int8
DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes
_VOID_P, _INT64 = ctypes.c_void_p, ctypes.c_int64


def panels(blocks: np.ndarray, out_features: int, in_features: int) -> np.ndarray:
    """GGUF Q8_0 rows (uint8 [N, K/32 * 34]) as the kernel's panels: [N/16][K/32][16 fp16 scales,
    32 x 16 int8 (per k, the 16 columns)], flat uint8."""
    n, kb = out_features, in_features // BLOCK
    rows = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n // PANEL, PANEL, kb, BLOCK_BYTES)
    scales = rows[..., :2].transpose(0, 2, 1, 3).reshape(n // PANEL, kb, 2 * PANEL)
    weights = rows[..., 2:].transpose(0, 2, 3, 1).reshape(n // PANEL, kb, BLOCK * PANEL)
    return np.concatenate([scales, weights], axis=-1).reshape(-1)


class Q8Weight:
    """A Q8_0 weight [N, K] in panels: out = x @ W^T (+ bias) for any number of rows, in `dtype`
    (x and bias in it too)."""

    def __init__(self, blocks: np.ndarray, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        functions = _functions()
        assert functions is not None, "a Q8Weight exists only where the kernel runs"
        self._fn = functions[DTYPES.index(dtype)]
        self.panels = torch.from_numpy(panels(blocks, out_features, in_features))

    @property
    def storage(self) -> torch.Tensor:
        """The packed weight as the kernel reads it (the decode stack passes its address)."""
        return self.panels

    @property
    def nbytes(self) -> int:
        return self.panels.numel()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._run(x, bias, self.dtype)

    def float_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`self(x, bias).float()` in one pass (bf16: the bf16-rounded products written as fp32)."""
        return self._run(x, bias, torch.float32)

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        assert x.dtype == self.dtype

        def kernel(x2: int, b: int | None, out: int, rows: int) -> None:
            if self._fn(x2, self.panels.data_ptr(), b, out, rows, self.out_features, self.in_features,
                        out_dtype == torch.float32):
                raise MemoryError("Q8_0 projection: its per-thread buffer could not be allocated")

        return project_rows(x, bias, self.in_features, self.out_features, out_dtype, kernel)


def pack(blocks: np.ndarray, out_features: int, in_features: int, dtype: torch.dtype) -> Q8Weight | None:
    """The panels of a Q8_0 weight, or None where the kernel cannot take it (N not a multiple of 16,
    an activation dtype other than fp32/bf16, the kernel not built or disabled)."""
    if out_features % PANEL or in_features % BLOCK or dtype not in DTYPES or not available():
        return None
    return Q8Weight(blocks, out_features, in_features, dtype)


def available() -> bool:
    return _functions() is not None


def kernel_address(dtype: torch.dtype) -> int | None:
    """The C function's address for activations of `dtype` (q8_linear_f32 or _bf16), or None."""
    functions = _functions()
    if functions is None or dtype not in DTYPES:
        return None
    return address(functions[DTYPES.index(dtype)])


@functools.cache
def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    """(q8_linear_f32, q8_linear_bf16), or None where the kernel cannot be had."""
    library = load_library("q8_linear")
    if library is None:
        return None
    library.q8_linear_vectorised.restype = ctypes.c_int
    log.info("Q8_0 projections: %s", "AVX2/FMA/F16C" if library.q8_linear_vectorised() else "portable C")
    f32, bf16 = library.q8_linear_f32, library.q8_linear_bf16
    for fn in (f32, bf16):
        fn.restype = ctypes.c_int
        fn.argtypes = [_VOID_P] * 4 + [_INT64] * 3 + [ctypes.c_int]
    return f32, bf16
