"""The greedy pick of a step's rows in C (`greedy.c`): first argmax and whether the row's maximum is
finite. None where the kernel cannot run (not CPU fp32, no compiler, `LORAPLEX_CPU_KERNELS=0`): the
sampler then takes torch's max."""

from __future__ import annotations

import functools

import torch

from inference_service.kernels.bindings import CFunction, function


def argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first argmax [S] int64, maximum finite [S] bool) of logits [S, V], or None."""
    fn = _function()
    if fn is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    logits = logits.contiguous()
    rows, cols = logits.shape
    idx = torch.empty(rows, dtype=torch.int64)
    finite = torch.empty(rows, dtype=torch.bool)
    fn(logits.data_ptr(), rows, cols, idx.data_ptr(), finite.data_ptr())
    return idx, finite


@functools.cache
def _function() -> CFunction | None:
    return function("greedy", "argmax_rows_f32")
