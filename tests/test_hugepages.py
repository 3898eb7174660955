"""Large host tensors on 2 MiB pages (inference_service/kernels/hugepages.py): aligned, the right size, really
backed by huge pages where the kernel's THP allows it, and ordinary tensors where it is switched off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.platform import compute_for
from inference_service.kernels import amx_linear, hugepages
from inference_service.models.loader import BUILTIN_TINY, load_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                               reason="needs Linux transparent huge pages (not 'never')")


def huge_kib_under(tensor: torch.Tensor) -> int:
    """KiB of AnonHugePages in the mappings that overlap the tensor's memory (/proc/self/smaps)."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            overlaps = low < end and start < high
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@needs_thp
def test_large_tensors_sit_on_2mib_pages():
    tensor = hugepages.empty((3 * hugepages.HUGE_PAGE // 4,), torch.bfloat16)  # 3 MiB
    assert tensor.data_ptr() % hugepages.HUGE_PAGE == 0 and tensor.is_contiguous() and tensor.shape == (1572864,)
    tensor.fill_(1)  # faults the pages in
    assert huge_kib_under(tensor) >= 2048  # its whole 2 MiB run; the last MiB stays on small pages
    assert hugepages.empty((4, 1 << 20), torch.float32).abs().sum() == 0  # a fresh mapping is zeroed


def test_small_tensors_and_the_switch_leave_ordinary_memory():
    small = hugepages.empty((1000,), torch.float32)
    assert small.shape == (1000,) and small.untyped_storage().nbytes() == 4000  # no slack
    plain = hugepages.empty((4, 1 << 20), torch.float32, huge=False)  # --huge-pages off
    assert plain.untyped_storage().nbytes() == plain.numel() * 4


def test_an_arena_hands_out_consecutive_parts_and_refuses_overflow():
    arena = hugepages.Arena(3 << 20, torch.bfloat16)
    a, b = arena.take(1 << 20), arena.take(2 << 20)
    assert b.data_ptr() == a.data_ptr() + (2 << 20)
    with pytest.raises(AssertionError, match="fewer elements"):
        arena.take(1)


@pytest.mark.skipif(not amx_linear.available(), reason="needs a CPU with AMX (and a compiler)")
def test_the_packed_weights_share_one_arena():
    model, _ = load_model(BUILTIN_TINY, torch.device("cpu"), torch.bfloat16,
                          compute=compute_for(torch.device("cpu"), torch.bfloat16))
    packed = [p.packed for layer in model.layers for p in layer.projections()]  # (its LM head: vocab 258)
    assert all(isinstance(w, amx_linear.AMXWeight) for w in packed)
    assert len({w.blocks.untyped_storage().data_ptr() for w in packed}) == 1  # type: ignore[union-attr]
