"""The batched LoRA op on CPU, in C (`lora.c`), and the slot loads it needs.

Built and loaded by `kernels.build`. The kernel keeps B rank-major in the slots (Bt [R, out]),
so the pool is created with `b_rank_major=True` when this op is used; `make_lora_op` (below)
picks it where it can run and the torch op everywhere else. Adapters are brought into that form
once, when staged (`transpose_into`); loads into such slots are then plain copies, run as a
`CopyProgram` on the CPU copy engine.
"""

from __future__ import annotations

import ctypes
import functools
import struct
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


# The most elements one piece of a copy program moves: 256 KiB of fp32, ~30 µs of one core here.
# Pieces are what runs during a forward pass (see ThreadCopyEngine), so their size bounds how long
# the copy thread holds a core the pass wants.
PIECE_ELEMENTS = 1 << 16
# CopyOp in lora.c: dst, src (0: a zero fill), bytes.
_OP = struct.Struct("@PPq")


class CopyProgram:
    """A slot load for `run_copy_program` (lora.c), written by address into a slot of `dtype`:
    copies of tensors already in the slots' form and zero fills, in pieces of at most
    PIECE_ELEMENTS. The pieces are listed here (plain integers, no tensor views: this runs on the
    copy thread and holds the GIL) and run in few calls without it. `ok` turns false at the first
    source it cannot copy as it is (another dtype, not contiguous, not CPU): the caller then
    copies with torch."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._piece_bytes = PIECE_ELEMENTS * dtype.itemsize
        self.ok = _function("run_copy_program") is not None
        self._ops = bytearray()
        self._count = 0

    def copy(self, dst: int, src: torch.Tensor) -> None:
        """The contiguous `src`, in the slots' dtype, to address `dst`."""
        self.ok = self.ok and src.device.type == "cpu" and src.dtype == self._dtype and src.is_contiguous()
        if self.ok:
            self._add(dst, src.data_ptr(), src.numel() * src.element_size())

    def zero(self, dst: int, count: int) -> None:
        """`count` zeros of the slots' dtype at address `dst`."""
        self._add(dst, 0, count * self._dtype.itemsize)

    def run_all(self) -> None:
        """Every piece now, on the calling thread (a blocking load)."""
        assert self.ok
        _function("run_copy_program")(self._address(), self._count)

    def run_gated(self, gate: PassGate, piece_interval_s: float) -> None:
        """Every piece in order, on the copy thread, in one call without the GIL: between forward
        passes (`gate` open) as many as fit in the gap; during a pass one every `piece_interval_s`,
        so a load does not depend on the gaps alone (they can be too short to finish it for many
        steps). See `run_copy_program_gated` in lora.c."""
        assert self.ok
        _function("run_copy_program_gated")(self._address(), self._count, ctypes.byref(gate.word),
                                            int(piece_interval_s * 1e9))

    def _address(self) -> int:
        return ctypes.addressof((ctypes.c_char * len(self._ops)).from_buffer(self._ops))

    def _add(self, dst: int, src: int, nbytes: int) -> None:
        for start in range(0, nbytes, self._piece_bytes):
            self._ops += _OP.pack(dst + start, src + start if src else 0, min(self._piece_bytes, nbytes - start))
            self._count += 1


class _GateWord(ctypes.Structure):
    """`PassGate` in lora.c: `hold` is 1 during a forward pass; `scheduler_cpu` is where the
    scheduler thread ended the last one."""

    _fields_ = [("hold", ctypes.c_int32), ("scheduler_cpu", ctypes.c_int32)]


class PassGate:
    """Closed during each forward pass, open between them; shared by the scheduler thread and the
    copy thread. A copy program waits on it in C (`run_gated`); torch pieces, where the C kernels
    are missing, wait on it in Python (`wait_open`)."""

    def __init__(self) -> None:
        self.word = _GateWord()
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        """A forward pass starts: copies hold back."""
        self._open.clear()
        self.word.hold = 1

    def open(self) -> None:
        """The pass ended: wake the copy thread (in C at once, with no GIL to take) and say which
        core to keep off."""
        fn = _function("pass_gate_open")
        if fn is not None:
            fn(ctypes.byref(self.word))
        else:
            self.word.hold = 0
        self._open.set()

    def wait_open(self, timeout_s: float) -> bool:
        """Until the gate opens or `timeout_s` passes; True if it is open."""
        return self._open.wait(timeout_s)


@functools.cache
def _function(symbol: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    library = load_library("lora") if symbol else None
    if library is None:
        return None
    fn = getattr(library, symbol)
    if symbol in ("run_copy_program", "run_copy_program_gated"):
        fn.restype = None
        gate = [ctypes.c_void_p, ctypes.c_int64] if symbol.endswith("gated") else []
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, *gate]
        assert ctypes.sizeof(ctypes.c_void_p) == 8 and _OP.size == 24, "CopyOp layout as in lora.c"
    elif symbol == "pass_gate_open":
        fn.restype, fn.argtypes = None, [ctypes.c_void_p]
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
