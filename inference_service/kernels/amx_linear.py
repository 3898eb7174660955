"""bf16 projections on Intel AMX (`amx_linear.c`), for CPUs that have it.

`pack` turns a weight [N, K] into the kernel's layout, or gives None where the kernel cannot run
(no AMX, the kernel not built, `LORAPLEX_CPU_KERNELS=0`, not bf16, N or K not a multiple of 32);
the caller then keeps oneDNN. `AMXWeight` is the packed weight, called like a projection.
"""

from __future__ import annotations

import functools
import logging

import torch

from inference_service.kernels.bindings import CFunction, address, function
from inference_service.kernels.hugepages import Arena
from inference_service.kernels.projection_rows import project_rows

log = logging.getLogger(__name__)

BLOCK = 32  # the kernel's column and depth block


class AMXWeight:
    """A weight [N, K] in the kernel's blocked layout: out = x @ W^T (+ bias) for any number of rows."""

    def __init__(self, weight: torch.Tensor, storage: torch.Tensor | None = None) -> None:
        """`storage`: N * K elements to hold the packed weight (else a tensor of its own)."""
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        self._fn = _function()
        assert self._fn is not None, "an AMXWeight exists only where the kernel runs"
        # [N/32, 32, K/32, 16, 2] -> [N/32][K/32][16 k-pairs][32 n][2]: each 2 KiB block one k-slab
        # of 32 columns, VNNI-paired as AMX's B operand reads it.
        blocks = weight.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
        self.blocks = blocks.contiguous() if storage is None else storage.view(blocks.shape).copy_(blocks)

    @property
    def storage(self) -> torch.Tensor:
        """The packed weight as the kernel reads it (the decode stack passes its address)."""
        return self.blocks

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._run(x, bias, torch.bfloat16)

    def float_output(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`self(x, bias).float()` in one pass: the bf16-rounded products written as fp32."""
        return self._run(x, bias, torch.float32)

    def argmax(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(first argmax [S] int64, maximum finite [S] bool) of `self.float_output(x, bias)` for x [S, K],
        as `greedy.argmax_rows` picks, without writing the products (the LM head of a greedy step)."""
        assert x.dtype == torch.bfloat16 and x.dim() == 2
        x = x.contiguous()
        b = None if bias is None else bias.contiguous()
        rows = x.shape[0]
        idx = torch.empty(rows, dtype=torch.int64)
        finite = torch.empty(rows, dtype=torch.bool)
        if rows and _argmax_function()(x.data_ptr(), self.blocks.data_ptr(), None if b is None else b.data_ptr(),
                                       rows, self.out_features, self.in_features, idx.data_ptr(), finite.data_ptr()):
            raise MemoryError("AMX greedy pick: its per-thread state could not be allocated")
        return idx, finite

    def _run(self, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        assert x.dtype == torch.bfloat16

        def kernel(x2: int, b: int | None, out: int, rows: int) -> None:
            self._fn(x2, self.blocks.data_ptr(), b, out, rows, self.out_features, self.in_features,
                     dtype == torch.float32)

        return project_rows(x, bias, self.in_features, self.out_features, dtype, kernel)


def packable(weight: torch.Tensor) -> bool:
    """True if `pack` takes this weight [N, K] (bf16 on CPU, N and K multiples of 32, AMX here)."""
    n, k = weight.shape
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not n % BLOCK and not k % BLOCK and (
        available()
    )


def pack(weight: torch.Tensor, arena: Arena | None = None) -> AMXWeight | None:
    """The AMX layout of weight [N, K] (cut from `arena` when given), or None where the kernel cannot
    take it."""
    if not packable(weight):
        return None
    return AMXWeight(weight, None if arena is None else arena.take(weight.numel()))


def available() -> bool:
    return _function() is not None


def kernel_address() -> int | None:
    """The C function's address (`amx_linear_bf16`), or None where it does not run."""
    fn = _function()
    return None if fn is None else address(fn)


def _argmax_function() -> CFunction:
    fn = function("amx_linear", "amx_argmax_bf16")
    assert fn is not None and _function() is not None
    return fn


@functools.cache
def _function() -> CFunction | None:
    init = function("amx_linear", "amx_linear_init")
    if init is None:
        return None
    if not init():
        log.info("no AMX on this CPU (or the kernel denied its tile state): bf16 projections use another kernel "
                 "(the platform plan names it)")
        return None
    return function("amx_linear", "amx_linear_bf16")
