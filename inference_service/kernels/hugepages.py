"""Large host tensors on 2 MiB pages (transparent huge pages, asked for with madvise).

Why: a decode step streams every weight once; on 4 KiB pages each 4 KiB costs a TLB walk. On this
project's CI-class host (THP in `madvise` mode, so nothing gets huge pages unasked) a plain sequential
read went from 22 to 31 GB/s on 2 MiB pages and the AMX projections from ~20 to ~22 GB/s
(docs/performance.md, "Decode against the machine's roofline"). Used for the packed weights (one
arena) and the adapter pool; the KV cache stays on small pages (engine/kv_cache.py says why). Advice
only: where the kernel declines (THP off, not Linux) the memory is ordinary.

A tensor's memory is an anonymous mapping of its own, 2 MiB more than it needs so that the tensor can
start on a 2 MiB boundary; the tensor's storage is exactly its bytes, and the slack around it is never
touched (address space, not memory). Only whole 2 MiB runs are advised, so a tensor's last partial
run, and tensors under 2 MiB (plain torch tensors), stay on small pages. The mapping comes zeroed and
is faulted in as it is first written, as torch's large allocations are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device | str = "cpu",
          huge: bool = True) -> torch.Tensor:
    """`torch.empty(shape)`, on 2 MiB pages where it is a CPU tensor of at least one such page (its
    memory then comes zeroed, and is faulted in as it is first written); `huge` False (`--huge-pages
    off`): always `torch.empty`."""
    tensor = _mapped(shape, dtype, torch.device(device)) if huge else None
    return tensor if tensor is not None else torch.empty(shape, dtype=dtype, device=device)


def _mapped(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A tensor on its own (zeroed) mapping, advised onto 2 MiB pages; None where that does not apply."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE_PAGE or not _supported():
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # (shared memory has its own THP rule)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = (-address) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError as exc:
        _log_refusal(exc.errno or 0)
    # The tensor holds the mapping (frombuffer keeps its buffer alive), unmapped with the last view.
    return torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)


class Arena:
    """One allocation on 2 MiB pages that tensors are cut from in turn (the model's packed weights: one
    per weight would leave most of them under the 2 MiB a huge page needs)."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.buffer = empty((numel,), dtype)
        self.used = 0

    def take(self, numel: int) -> torch.Tensor:
        assert self.used + numel <= self.buffer.numel(), "the arena was sized for fewer elements"
        part = self.buffer[self.used : self.used + numel]
        self.used += numel
        return part


@functools.cache
def _log_refusal(errno: int) -> None:
    log.info("the kernel declined 2 MiB pages (madvise errno %d): large tensors use small pages", errno)


@functools.cache
def _supported() -> bool:
    """Linux with transparent huge pages (and Python's madvise)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
