"""Calling a packed-weight projection kernel on any input shape: what AMX's, AVX2's and the quantized
kernels' weights share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class RowsKernel(Protocol):
    """A kernel call on dense rows: (x, bias or None, out, rows) by address."""

    def __call__(self, x: int, bias: int | None, out: int, rows: int) -> None: ...


def project_rows(x: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int,
                 out_dtype: torch.dtype, kernel: RowsKernel) -> torch.Tensor:
    """out [..., out_features] from x [..., in_features]: x flattened to dense rows, the kernel run on
    them (not at all for zero rows), the leading shape put back."""
    flat = x.dim() != 2
    x2 = (x.reshape(-1, in_features) if flat else x).contiguous()
    b = None if bias is None else bias.contiguous()  # held: the kernel reads it by address
    rows = x2.shape[0]
    out = torch.empty(rows, out_features, dtype=out_dtype)
    if rows:
        kernel(x2.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(), rows)
    return out.reshape(*x.shape[:-1], out_features) if flat else out


class PanelWeight:
    """A weight in a C kernel's column panels whose kernel takes (x, panels, bias, out, rows, N, K,
    fp32 output) by address and returns non-zero when its per-thread buffers cannot be allocated (the
    AVX2 and the Q8_0/Q4_0 projections). Subclasses set `panels`, the shapes, `dtype`, `_kernel` (the
    C function for `dtype`) and `_name` (for the error)."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype
    _kernel: Callable[..., int]
    _name: str

    @property
    def storage(self) -> torch.Tensor:
        """The packed weight as the kernel reads it (the decode stack passes its address)."""
        return self.panels

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._run(x, bias, self.dtype)

    def float_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`self(x, bias).float()` in one pass (bf16: the bf16-rounded products written as fp32)."""
        return self._run(x, bias, torch.float32)

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        assert x.dtype == self.dtype

        def kernel(x2: int, b: int | None, out: int, rows: int) -> None:
            if self._kernel(x2, self.panels.data_ptr(), b, out, rows, self.out_features, self.in_features,
                            out_dtype == torch.float32):
                raise MemoryError(f"{self._name} projection: its per-thread buffers could not be allocated")

        return project_rows(x, bias, self.in_features, self.out_features, out_dtype, kernel)
