"""The CPU copy engine copies between forward passes, a piece (one module) at a time, and during a
pass only one piece per PASS_PIECE_INTERVAL_S."""

from __future__ import annotations

import threading

import pytest
import torch

from inference_service import device
from inference_service.device import ThreadCopyEngine
from inference_service.lora.adapter import load_adapter_dir
from inference_service.lora.mem_pool import LoRAMemoryPool, SlotCopy
from inference_service.models.loader import builtin_tiny_config
from tests.test_lora_manager import write_tiny_adapter


@pytest.fixture
def long_interval(monkeypatch):
    """No pieces during a pass within these tests' time (the interval is what bounds them)."""
    monkeypatch.setattr(device, "PASS_PIECE_INTERVAL_S", 30.0)


def test_copies_wait_while_a_forward_pass_runs(long_interval):
    engine = ThreadCopyEngine()
    ran: list[int] = []
    first_done = threading.Event()

    def first() -> None:
        ran.append(1)
        first_done.set()

    copy = SlotCopy(lambda: None, [first, lambda: ran.append(2)])
    with engine.computing():
        handle = engine.submit(copy)
        assert not first_done.wait(0.3), "no piece starts during a forward pass"
    assert first_done.wait(5)
    handle.wait()
    assert ran == [1, 2] and handle.done()
    engine.close()


def test_a_forward_pass_holds_back_the_rest_of_a_copy(long_interval):
    engine = ThreadCopyEngine()
    ran: list[int] = []
    in_first, release_first = threading.Event(), threading.Event()

    def first() -> None:
        in_first.set()
        release_first.wait(5)
        ran.append(1)

    handle = engine.submit(SlotCopy(lambda: None, [first, lambda: ran.append(2)]))
    assert in_first.wait(5)
    with engine.computing():  # begins while the first piece is running
        release_first.set()
        threading.Event().wait(0.3)
        assert ran == [1] and not handle.done(), "the second piece waits for the pass to end"
    handle.wait()
    assert ran == [1, 2]
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_slot_copy_in_one_kernel_call_waits_for_the_pass_and_matches_torch(tmp_path, dtype, long_interval):
    """The C copy program (rank-major slots on CPU) holds back during a pass like the pieces do,
    and writes exactly what the torch pieces write, over a slot that held another adapter."""
    shapes = builtin_tiny_config().lora_shapes()
    big = load_adapter_dir(write_tiny_adapter(tmp_path / "big", seed=1, rank=8), shapes, 8)
    small = load_adapter_dir(write_tiny_adapter(tmp_path / "small", seed=2, rank=4, modules=("q_proj", "o_proj")),
                             shapes, 8)
    pool = LoRAMemoryPool(2, 8, shapes, torch.device("cpu"), dtype, b_rank_major=True)
    for slot in (0, 1):
        pool.copy_into_slot(slot, big)()  # stale data to overwrite
    by_torch = pool.copy_into_slot(0, small)
    assert by_torch.program is not None and by_torch.program() is not None, "the kernel should build here"
    by_torch()
    engine = ThreadCopyEngine()
    before = [b[1].clone() for _, b in pool.buffers.values()]
    with engine.computing():
        handle = engine.submit(pool.copy_into_slot(1, small))
        threading.Event().wait(0.3)
        assert not handle.done()
        assert all(torch.equal(b[1], old) for (_, b), old in zip(pool.buffers.values(), before, strict=True))
    handle.wait()
    for a, b in pool.buffers.values():
        assert torch.equal(a[0], a[1]) and torch.equal(b[0], b[1])
    engine.close()


@pytest.mark.parametrize("in_c", [True, False])
def test_a_long_forward_pass_does_not_stall_a_copy(tmp_path, monkeypatch, in_c):
    """During a pass a piece runs every interval: a load finishes even when the gaps are short."""
    monkeypatch.setattr(device, "PASS_PIECE_INTERVAL_S", 0.001)
    shapes = builtin_tiny_config().lora_shapes()
    adapter = load_adapter_dir(write_tiny_adapter(tmp_path / "a", seed=1, rank=8), shapes, 8)
    pool = LoRAMemoryPool(1, 8, shapes, torch.device("cpu"), torch.float32, b_rank_major=True)
    copy = pool.copy_into_slot(0, adapter)
    if not in_c:
        copy.program = None
    engine = ThreadCopyEngine()
    with engine.computing():  # one long pass, no gap at all
        handle = engine.submit(copy)
        handle.wait()
    expected = LoRAMemoryPool(1, 8, shapes, torch.device("cpu"), torch.float32, b_rank_major=True)
    expected.copy_into_slot(0, adapter)()
    for (a, b), (a_exp, b_exp) in zip(pool.buffers.values(), expected.buffers.values(), strict=True):
        assert torch.equal(a, a_exp) and torch.equal(b, b_exp)
    engine.close()
