"""Slot loads as copy programs run in C (`copy.c`), the pass gate the copy thread waits on, and
`CopyJob`, the typed value a slot load is handed to a copy engine as (device.py).

Built and loaded by `kernels.build`; where the library cannot be had, `CopyProgram.ok` is false
and `PassGate` works in Python alone, so callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inference_service.kernels import bindings

# The most elements one piece of a copy program moves: 256 KiB of fp32, ~30 µs of one core here.
# Pieces are what runs during a forward pass (see ThreadCopyEngine), so their size bounds how long
# the copy thread holds a core the pass wants.
PIECE_ELEMENTS = 1 << 16
# CopyOp in copy.c: dst, src (0: a zero fill), bytes.
_OP = struct.Struct("@PPq")


class CopyProgram:
    """A slot load for `run_copy_program` (copy.c), written by address into a slot of `dtype`:
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

    def copy_range(self, dst: int, src: torch.Tensor, offset: int, count: int) -> None:
        """`count` elements of the contiguous `src` from element `offset` on, to address `dst` (a
        page's share of an adapter's rows, without making a view)."""
        self.ok = self.ok and src.device.type == "cpu" and src.dtype == self._dtype and src.is_contiguous()
        if self.ok:
            assert 0 <= offset and offset + count <= src.numel()
            width = src.element_size()
            self._add(dst, src.data_ptr() + offset * width, count * width)

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
        steps). See `run_copy_program_gated` in copy.c."""
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
    """`PassGate` in copy.c: `hold` is 1 during a forward pass; `scheduler_cpu` is where the
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


@dataclass(frozen=True)
class CopyJob:
    """One copy for a copy engine, three ways: `whole` does it all at once (a CUDA side stream, a
    blocking load); `chunks`, the same in pieces to run in order (default: `whole` as one piece);
    `program`, where the CPU kernels are, makes the same as a C copy program that runs in one call
    without the GIL (None from it: use the pieces). See ThreadCopyEngine."""

    whole: Callable[[], None]
    chunks: tuple[Callable[[], None], ...] = ()
    program: Callable[[], CopyProgram | None] | None = field(default=None)

    def pieces(self) -> tuple[Callable[[], None], ...]:
        return self.chunks or (self.whole,)

    def __call__(self) -> None:
        program = self.program() if self.program is not None else None
        if program is not None:
            program.run_all()
        else:
            self.whole()


@functools.cache
def _function(symbol: str) -> bindings.CFunction | None:
    assert ctypes.sizeof(ctypes.c_void_p) == 8 and _OP.size == 24, "CopyOp's layout as in kernels.h"
    return bindings.function("copy", symbol)
