"""Asynchronous host→device copies behind one interface.

CUDA: copies are issued on a side stream from pinned host memory and completion is a recorded
event; the compute stream waits on it before first use. CPU: the same interface runs the copy
on a copy thread and completion is a future, so the copy overlaps compute there too (torch
releases the GIL inside copy kernels). `BlockingCopyEngine` is the no-overlap baseline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from inference_service.kernels.copy import CopyJob, PassGate

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
# The longest a thread that must act now waits for the GIL while another runs Python: the scheduler
# thread while a loader thread parses an adapter or sets up a copy, and the async device worker,
# back from a step, while the scheduler thread plans the next. With Python's default, 5 ms, that
# wait can land whole in one inter-token gap of a ~10 ms decode step.
GIL_SWITCH_INTERVAL_S = 0.0005
# See ThreadCopyEngine: during a forward pass, one piece of a copy (~30 µs) each this often.
PASS_PIECE_INTERVAL_S = 0.0003
_CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly


class CopyHandle(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> None:
        """Block until the copy finished; re-raises its error."""

    def before_use(self) -> None:
        """Order later compute after the copy (a stream wait on CUDA; nothing on CPU)."""


class CopyEngine(Protocol):
    def submit(self, job: CopyJob) -> CopyHandle:
        """Start a copy: whole, piece by piece, or as its C program (see `CopyJob`)."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host memory the engine can copy from asynchronously."""

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Wraps each forward pass: an engine that shares the compute's cores holds back then."""

    def close(self) -> None: ...


class _FutureHandle:
    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()

    def before_use(self) -> None:
        self._future.result()


class ThreadCopyEngine:
    """CPU twin of the CUDA side stream: one copy thread, futures as events.

    The copy shares the cores with the forward pass, so it runs mostly between passes (the pass
    gate), in bounded pieces, and during a pass only one piece every PASS_PIECE_INTERVAL_S; with the
    C kernels a whole load is one GIL-free call. Why each of these: docs/engine.md, "CPU copy
    overlap".
    """

    def __init__(self) -> None:
        # Full priority: at a lower one loads fell behind (docs/engine.md).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="lora-copy", initializer=background_worker_thread, initargs=(0,)
        )
        self._gate = PassGate()

    def submit(self, job: CopyJob) -> CopyHandle:
        def run() -> None:
            program = job.program() if job.program is not None else None
            if program is not None:
                program.run_gated(self._gate, PASS_PIECE_INTERVAL_S)
                return
            for chunk in job.pieces():
                self._gate.wait_open(PASS_PIECE_INTERVAL_S)
                chunk()

        return _FutureHandle(self._pool.submit(_no_grad(run)))

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        self._gate.close()
        try:
            yield
        finally:
            self._gate.open()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class BlockingCopyEngine:
    """Copies inline on the caller's thread: the no-overlap baseline for benchmarks."""

    def submit(self, job: CopyJob) -> CopyHandle:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            _no_grad(job)()
            future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the handle like the async engines
            future.set_exception(exc)
        return _FutureHandle(future)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def computing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class _EventHandle:
    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        self._event.synchronize()

    def before_use(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)


class CudaCopyEngine:
    """Side-stream copies with one event per load."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device)

    def submit(self, job: CopyJob) -> CopyHandle:
        with torch.cuda.stream(self._stream), torch.no_grad():
            job()
            event = torch.cuda.Event()
            event.record(self._stream)
        return _EventHandle(event)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def computing(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the copy engine is separate hardware

    def close(self) -> None:
        self._stream.synchronize()


def shorten_gil_switch_interval() -> None:
    """For a process with a thread that must not wait long for the GIL (see GIL_SWITCH_INTERVAL_S)."""
    if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)


def background_worker_thread(niceness: int = BACKGROUND_NICENESS) -> None:
    """Set-up of loader threads (host preparation, CPU slot copies), which run beside the model:
    one torch thread each, a lower CPU priority, a shorter GIL switch interval for the process
    (why: docs/engine.md, "CPU copy overlap")."""
    torch.set_num_threads(1)
    shorten_gil_switch_interval()
    try:
        if niceness:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (AttributeError, OSError):  # not Linux, or not permitted: loads just compete evenly
        pass


def _no_grad(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn()

    return run


class InlineExecutor(concurrent.futures.Executor):
    """Runs submitted work at once on the caller's thread: host preparation in blocking mode."""

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - delivered through the future like a pool's
            future.set_exception(exc)
        return future


def free_memory(device: torch.device) -> int:
    """Bytes free for new allocations: the GPU's (`cudaMemGetInfo`) on CUDA, else the host's
    MemAvailable (0 where /proc/meminfo cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def make_copy_engine(device: torch.device, overlap: bool) -> CopyEngine:
    if not overlap:
        return BlockingCopyEngine()
    if device.type == "cuda":
        return CudaCopyEngine(device)
    return ThreadCopyEngine()


def register_host_memory(buffer: torch.Tensor) -> bool:
    """Page-lock an existing host buffer (e.g. an mmap of a staged file) for async DMA on CUDA.

    Returns False where it is not possible (no CUDA): copies then run synchronously-staged.
    """
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    size = buffer.numel() * buffer.element_size()
    # Staged files are mapped read-only, which plain registration refuses; we only ever read them.
    result = cudart.cudaHostRegister(buffer.data_ptr(), size, _CUDA_HOST_REGISTER_READ_ONLY)
    if int(result) != 0:
        log.warning("cudaHostRegister failed (%s); copies from this buffer will not overlap", result)
        return False
    return True


def unregister_host_memory(buffer: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
