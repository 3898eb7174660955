"""The batched LoRA op on CPU, in C (`lora.c`), and the transposing copy its slot loads need.

Built and loaded by `kernels.build`. The kernel keeps B rank-major in the slots (Bt [R, out]),
so the pool is created with `b_rank_major=True` when this op is used; `make_lora_op` in
`lora/ops.py` picks it where it can run and the torch op everywhere else.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from inference_service.kernels.build import load_library
from inference_service.lora.ops import LoRABatch, LoRAOp, SlicedB, TorchLoRAOp

_APPLY = {torch.float32: "lora_apply_f32", torch.bfloat16: "lora_apply_bf16"}
_TRANSPOSE = {torch.float32: "transpose_scale_f32", torch.bfloat16: "transpose_scale_bf16"}


def available(dtype: torch.dtype) -> bool:
    """True if the kernel runs for this model dtype here (builds it now if needed)."""
    return dtype in _APPLY and _function(_APPLY[dtype]) is not None


class CpuLoRAOp:
    """`LoRAOp` for CPU: one kernel call per fused projection. Slots hold the model's dtype."""

    b_rank_major = True

    def __init__(self, dtype: torch.dtype) -> None:
        self._fn = _function(_APPLY[dtype])
        assert self._fn is not None, "check available() first"
        # Per projection (keyed by its A buffer): the B pointers and column offsets the kernel takes.
        self._layouts: dict[int, tuple[ctypes.Array, torch.Tensor]] = {}

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype  # widened to fp32 inside the kernel

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        x = x.contiguous()
        assert batch.runs is not None
        assert x.dtype == out.dtype == a.dtype and out.stride(1) == 1 and a.is_contiguous()
        pointers, cols = self._layout(a, bs)
        num_modules = len(bs)
        slot_rank = a.shape[1] // num_modules
        scratch = torch.empty(x.shape[0], num_modules * slot_rank, dtype=torch.float32)
        status = self._fn(
            x.data_ptr(), out.data_ptr(), out.stride(0), a.data_ptr(), pointers, cols.data_ptr(), num_modules,
            slot_rank, x.shape[1], batch.runs.data_ptr(), batch.runs.shape[0], scratch.data_ptr(),
        )
        if status != 0:
            raise MemoryError("LoRA kernel: out of memory for its scratch buffers")

    def _layout(self, a: torch.Tensor, bs: list[SlicedB]) -> tuple[ctypes.Array, torch.Tensor]:
        layout = self._layouts.get(a.data_ptr())
        if layout is None:
            assert all(s.b.is_contiguous() for s in bs)
            pointers = (ctypes.c_void_p * len(bs))(*(s.b.data_ptr() for s in bs))
            cols = torch.tensor([s.start for s in bs] + [bs[-1].end], dtype=torch.int64)
            layout = self._layouts[a.data_ptr()] = (pointers, cols)
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


class _CopyOp(ctypes.Structure):
    _fields_ = [
        ("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
        ("dst_stride", ctypes.c_int64), ("src_stride", ctypes.c_int64), ("scale", ctypes.c_float),
        ("kind", ctypes.c_int32), ("dst_bf16", ctypes.c_int32), ("src_bf16", ctypes.c_int32),
    ]


_COPY, _TRANSPOSE_SCALE, _ZERO = 0, 1, 2
_ELEMENT = {torch.float32: 0, torch.bfloat16: 1}


class CopyProgram:
    """A slot load for `run_copy_program` (lora.c): its pieces are added here, on the copy thread,
    and run in one call without the GIL. `ok` turns false at the first piece it cannot do (another
    dtype, not CPU, a layout it does not handle): the caller then copies with torch."""

    def __init__(self) -> None:
        self.ops: list[_CopyOp] = []
        self.ok = _function("run_copy_program") is not None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._fits(dst, src, dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
            self._add(_COPY, dst, src, 1, dst.numel(), 0, 0, 1.0)

    def transpose_scale(self, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
        """dst [c, r] = scale * src [r, c]."""
        if self._fits(dst, src, dst.stride(1) == 1 and src.stride(1) == 1 and dst.shape == src.shape[::-1]):
            self._add(_TRANSPOSE_SCALE, dst, src, src.shape[0], src.shape[1], dst.stride(0), src.stride(0), scale)

    def zero(self, dst: torch.Tensor) -> None:
        if self._fits(dst, dst, dst.is_contiguous()):
            self._add(_ZERO, dst, None, 1, dst.numel(), 0, 0, 1.0)

    def run(self, hold: ctypes.c_int32, idle: threading.Event) -> None:
        """Every piece in order, none while `hold` is set; `idle` is set whenever it is clear."""
        assert self.ok
        fn = _function("run_copy_program")
        ops, done = (_CopyOp * len(self.ops))(*self.ops), 0
        while done < len(self.ops):
            idle.wait()
            done += fn(ctypes.byref(ops, done * ctypes.sizeof(_CopyOp)), len(self.ops) - done, ctypes.byref(hold))

    def _fits(self, dst: torch.Tensor, src: torch.Tensor, layout_ok: bool) -> bool:
        self.ok = self.ok and layout_ok and all(t.device.type == "cpu" and t.dtype in _ELEMENT for t in (dst, src))
        return self.ok

    def _add(self, kind: int, dst: torch.Tensor, src: torch.Tensor | None, rows: int, cols: int, dst_stride: int,
             src_stride: int, scale: float) -> None:
        if rows * cols == 0:
            return
        src_pointer, src_bf16 = (None, 0) if src is None else (src.data_ptr(), _ELEMENT[src.dtype])
        self.ops.append(_CopyOp(dst.data_ptr(), src_pointer, rows, cols, dst_stride, src_stride, scale, kind,
                                _ELEMENT[dst.dtype], src_bf16))


@functools.cache
def _function(symbol: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    library = load_library("lora") if symbol else None
    if library is None:
        return None
    fn = getattr(library, symbol)
    if symbol == "run_copy_program":
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    elif symbol in _TRANSPOSE.values():
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_float]
    else:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return fn


def make_lora_op(device: torch.device, model_dtype: torch.dtype) -> LoRAOp:
    """The C kernel on CPU where it builds and supports the dtype; torch's batched matmuls elsewhere."""
    if device.type == "cpu" and available(model_dtype):
        return CpuLoRAOp(model_dtype)
    return TorchLoRAOp(device)
