"""bf16 projections on CPUs with AVX-512 BF16 and no AMX (`bf16_linear.c`: `vdpbf16ps`).

On such CPUs (AMD Zen 4-5, Intel Cooper Lake) torch's bf16 projections are oneDNN calls from Python,
one per op: a batch-1 decode step of SmolLM2 took 30-40 ms where its weights take ~8 ms to read, and
a step whose projections C cannot call cannot run as one C call (models/decode_stack.py). This kernel
reads a weight's panels once per batch of rows and multiplies bf16 pairs in hardware.
`pack` turns a bf16 weight [N, K] into the kernel's panels where it is this CPU's bf16 projection
(`preferred`: built with AVX-512 BF16, and no AMX, whose kernel comes first), or gives None where it is
not or cannot take the weight (not bf16, N not a multiple of 16, K odd, `LORAPLEX_CPU_KERNELS=0`).
`BF16Weight` packs for the kernel wherever it runs (`takes`), which is how it is tested on AMX CPUs too.
"""

from __future__ import annotations

import functools
import logging

import torch

from inference_service.kernels import amx_linear
from inference_service.kernels.bindings import CFunction, address, function
from inference_service.kernels.hugepages import Arena
from inference_service.kernels.projection_rows import PanelWeight

log = logging.getLogger(__name__)

PANEL = 16  # the kernel's column panel


class BF16Weight(PanelWeight):
    """A bf16 weight [N, K] as [N/16][K/2][16][2] panels (per input pair, the 16 columns' two weights
    side by side): out = x @ W^T (+ bias) for any number of rows, x, bias and out bf16."""

    def __init__(self, weight: torch.Tensor, storage: torch.Tensor | None = None) -> None:
        """`storage`: bf16, as many elements as the weight (a part of the model's huge-page arena)."""
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self.dtype = torch.bfloat16
        kernel = _function()
        assert kernel is not None, "a BF16Weight exists only where the kernel runs"
        self._kernel = kernel
        self._name = "AVX-512 BF16"
        panels = weight.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3)  # [N/16, K/2, 16, 2]
        if storage is None:
            self.panels = panels.contiguous()
        else:
            self.panels = storage.view(panels.shape)
            self.panels.copy_(panels)


def takes(weight: torch.Tensor) -> bool:
    """True if the kernel runs here and can take weight [N, K] (bf16 on CPU, N a multiple of 16, K even)."""
    n, k = weight.shape
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not n % PANEL and not k % 2
            and available())


def pack(weight: torch.Tensor, arena: Arena | None = None) -> BF16Weight | None:
    """The panel layout of weight [N, K] (cut from `arena` when given) where the kernel is this CPU's
    bf16 projection, or None."""
    if not (preferred() and takes(weight)):
        return None
    return BF16Weight(weight, None if arena is None else arena.take(weight.numel()))


def available() -> bool:
    """The kernel runs here: built with AVX-512 BF16, on a CPU that has it."""
    return _function() is not None


def preferred() -> bool:
    """The kernel is this CPU's bf16 projection: it runs here and AMX's does not."""
    return available() and not amx_linear.available()


def kernel_address() -> int | None:
    """The C function's address (bf16_linear_bf16), or None."""
    kernel = _function()
    return None if kernel is None else address(kernel)


@functools.cache
def _function() -> CFunction | None:
    """bf16_linear_bf16, or None where the kernel does not run."""
    init = function("bf16_linear", "bf16_linear_init")
    if init is None:
        return None
    if not init():
        log.info("a CPU without AVX-512 BF16: bf16 projections use another kernel")
        return None
    kernel = function("bf16_linear", "bf16_linear_bf16")
    assert kernel is not None
    return kernel
