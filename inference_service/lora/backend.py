"""The LoRA op implementations by name (`OPS`, made by `make_lora_op` for the one the platform plan
names): the batched op on CPU in C (`kernels/lora.c`), the Triton kernels on CUDA where triton is
installed (`triton_op.TritonLoRAOp`), torch's batched matmuls (`ops.TorchLoRAOp`) anywhere.

The C kernel keeps B rank-major in the pages (Bt [R, out]), so the pool is created with
`b_rank_major=True` when this op is used. Adapters are brought into that form once, when staged
(`transpose_into`); loads into such pages are then plain copies, run as a `kernels.copy.CopyProgram`
on the CPU copy engine.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util

import torch

from inference_service.kernels.bindings import CFunction, address, function
from inference_service.lora.ops import LoRABatch, LoRAOp, SlicedB, TorchLoRAOp

# The ops by name, in the order the platform plan tries them (the first that runs here); the C kernel's
# is off with `--kernels off`, Triton's with `EngineConfig.triton_kernels=False`.
OPS = ("c", "triton", "torch")
C_KERNEL_OPS = frozenset({"c"})
_APPLY = {torch.float32: "lora_apply_f32", torch.bfloat16: "lora_apply_bf16"}
_TRANSPOSE = {torch.float32: "transpose_scale_f32", torch.bfloat16: "transpose_scale_bf16"}


def available(dtype: torch.dtype) -> bool:
    """True if the kernel runs for this model dtype here (builds it now if needed)."""
    return dtype in _APPLY and _function(_APPLY[dtype]) is not None


class CpuLoRAOp:
    """`LoRAOp` for CPU: one kernel call per fused projection. Pages hold the model's dtype."""

    b_rank_major = True

    def __init__(self, dtype: torch.dtype) -> None:
        self._fn = _function(_APPLY[dtype])
        assert self._fn is not None, "check available() first"
        self.kernel_address = address(self._fn)  # for C that calls the kernel (kernels/decode_stack.c)
        # Per projection (keyed by its buffers' addresses, all of them: a buffer freed and another
        # allocated at its address must not find the old one's layout): the B pointers and column
        # offsets the kernel takes.
        self._layouts: dict[tuple[int, ...], tuple[ctypes.Array, torch.Tensor]] = {}

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype  # widened to fp32 inside the kernel

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        x = x.contiguous()
        assert batch.runs is not None and batch.run_pages is not None
        assert x.dtype == out.dtype == a.dtype and out.stride(1) == 1 and a.is_contiguous()
        pointers, cols = self.layout(a, bs)
        num_modules = len(bs)
        page_rank = a.shape[1] // num_modules
        scratch = torch.empty(x.shape[0], num_modules * batch.max_rank, dtype=torch.float32)
        status = self._fn(
            x.data_ptr(), out.data_ptr(), out.stride(0), a.data_ptr(), pointers, cols.data_ptr(), num_modules,
            page_rank, batch.max_rank, x.shape[1], batch.runs.data_ptr(), batch.runs.shape[0],
            batch.run_pages.data_ptr(), scratch.data_ptr(),
        )
        if status != 0:
            raise MemoryError("LoRA kernel: out of memory for its scratch buffers")

    def layout(self, a: torch.Tensor, bs: list[SlicedB]) -> tuple[ctypes.Array, torch.Tensor]:
        """The kernel's B pointer array and column offsets [n + 1] for one projection's buffers."""
        key = (a.data_ptr(), *(s.b.data_ptr() for s in bs), *(s.end for s in bs))
        layout = self._layouts.get(key)
        if layout is None:
            assert all(s.b.is_contiguous() for s in bs)
            pointers = (ctypes.c_void_p * len(bs))(*(s.b.data_ptr() for s in bs))
            cols = torch.tensor([s.start for s in bs] + [bs[-1].end], dtype=torch.int64)
            layout = self._layouts[key] = (pointers, cols)
        return layout


def transpose_into(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
    """dst [c, r] = scale * src [r, c] (a B into a rank-major slot, its scaling folded in)."""
    if src.dtype != dst.dtype:
        src = src.to(dst.dtype)
    fn = _function(_TRANSPOSE.get(dst.dtype, ""))
    if fn is None or src.stride(1) != 1 or dst.stride(1) != 1 or dst.device.type != "cpu":
        dst.copy_(src.t())
        dst.mul_(scale)
        return
    fn(dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0), src.shape[0], src.shape[1], scale)


@functools.cache
def _function(symbol: str) -> CFunction | None:
    return function("lora", symbol) if symbol else None


def triton_available() -> bool:
    """True if triton is installed (it is imported only when a CUDA op is made)."""
    return importlib.util.find_spec("triton") is not None


def op_runs(name: str, device: torch.device, model_dtype: torch.dtype) -> bool:
    """Whether op `name` runs on this device for the model's dtype (the C kernel is built now where it may)."""
    if name == "c":
        return device.type == "cpu" and available(model_dtype)
    if name == "triton":
        return device.type == "cuda" and triton_available()
    return name == "torch"


def make_lora_op(name: str, device: torch.device, model_dtype: torch.dtype) -> LoRAOp:
    """The op the platform plan named (`OPS`): "c" (the C kernel, CPU), "triton" (CUDA) or "torch"."""
    if name == "c":
        return CpuLoRAOp(model_dtype)
    if name == "triton":
        from inference_service.lora.triton_op import TritonLoRAOp

        return TritonLoRAOp(device)
    assert name == "torch", f"unknown LoRA op {name!r}"
    return TorchLoRAOp(device)
