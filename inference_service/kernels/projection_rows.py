"""Calling a packed-weight projection kernel on any input shape: what AMX's and AVX2's weights share."""

from __future__ import annotations

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
