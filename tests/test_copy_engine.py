"""The CPU copy engine copies between forward passes, a piece (one module) at a time, and during a
pass only one piece per PASS_PIECE_INTERVAL_S."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from adapter_cache.adapter_format import load_adapter_dir
from harness.adapters import write_tiny_adapter
from inference_service import device
from inference_service.device import ThreadCopyEngine
from inference_service.kernels.copy import CopyJob
from inference_service.lora.mem_pool import LoRAMemoryPool
from inference_service.models.loader import builtin_tiny_config


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

    copy = CopyJob(lambda: None, (first, lambda: ran.append(2)))
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

    handle = engine.submit(CopyJob(lambda: None, (first, lambda: ran.append(2))))
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
        pool.copy_into_slot(slot, big).whole()  # stale data to overwrite
    by_torch = pool.copy_into_slot(0, small)
    assert by_torch.program is not None and by_torch.program() is not None, "the kernel should build here"
    by_torch.whole()
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
        copy = dataclasses.replace(copy, program=None)
    engine = ThreadCopyEngine()
    with engine.computing():  # one long pass, no gap at all
        handle = engine.submit(copy)
        handle.wait()
    expected = LoRAMemoryPool(1, 8, shapes, torch.device("cpu"), torch.float32, b_rank_major=True)
    expected.copy_into_slot(0, adapter)()
    for (a, b), (a_exp, b_exp) in zip(pool.buffers.values(), expected.buffers.values(), strict=True):
        assert torch.equal(a, a_exp) and torch.equal(b, b_exp)
    engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_adapter_in_the_slots_form_loads_the_same_slot(tmp_path, dtype):
    """`host_form` (done once, when staged) moves the transpose, the scaling and the dtype out of
    the load: the C program and the torch pieces then only copy, and write the slot exactly as a
    load of the adapter as read does."""
    shapes = builtin_tiny_config().lora_shapes()
    adapter = load_adapter_dir(write_tiny_adapter(tmp_path / "a", seed=3, rank=4, modules=("q_proj", "down_proj")),
                               shapes, 8)
    pool = LoRAMemoryPool(4, 8, shapes, torch.device("cpu"), dtype, b_rank_major=True)
    form = pool.host_form(adapter)
    assert form.slot_form and not adapter.slot_form and form.keepalive is None
    assert pool.host_form(form) is form
    a, bt, scaling = form.modules[(0, "q_proj")]
    assert bt.shape == adapter.modules[(0, "q_proj")][1].t().shape and scaling == 1.0 and a.dtype == dtype
    pool.copy_into_slot(0, adapter).whole()  # as read, by torch
    pool.copy_into_slot(1, form)()  # in the slots' form, by the C program
    pool.copy_into_slot(2, form).whole()  # the same by torch
    for chunk in pool.copy_into_slot(3, form).chunks:  # and piece by piece
        chunk()
    for a_buf, b_buf in pool.buffers.values():
        for slot in (1, 2, 3):
            assert torch.equal(a_buf[0], a_buf[slot]) and torch.equal(b_buf[0], b_buf[slot])
    assert LoRAMemoryPool(1, 8, shapes, torch.device("cpu"), dtype).host_form(adapter) is adapter, (
        "PEFT-layout slots (the GPU's) take adapters as read")


def test_copy_program_pieces_are_bounded_and_exact():
    """A copy program cuts copies and zero fills into pieces of at most PIECE_ELEMENTS (what runs
    during a pass), and the pieces together write exactly the whole. The transposing copy that
    brings B into the slots' form (`transpose_into`, when staged) is exact too."""
    from inference_service.kernels import copy as kernels
    from inference_service.lora.backend import transpose_into

    if not kernels.CopyProgram(torch.float32).ok:
        pytest.skip("the C kernels do not build here (no compiler)")
    n = kernels.PIECE_ELEMENTS
    src = torch.randn(3 * n + 5)
    b = torch.randn(3 * n // 1000 + 7, 1000)  # B [out, r] with out * r > 3 pieces
    copied, zeroed = torch.empty_like(src), torch.full((n + 1,), 7.0)
    transposed = torch.empty(b.shape[1], b.shape[0] + 3)  # rows of dst longer than b has rows
    program = kernels.CopyProgram(torch.float32)
    program.copy(copied.data_ptr(), src)
    program.zero(zeroed.data_ptr(), n + 1)
    ops = len(program._ops) // kernels._OP.size
    assert ops == 4 + 2
    program.run_all()
    assert torch.equal(copied, src) and not zeroed.any()
    transpose_into(transposed[:, : b.shape[0]], b, 0.5)
    assert torch.equal(transposed[:, : b.shape[0]], 0.5 * b.t())


def test_the_engine_stages_adapters_in_its_slots_form(tmp_path):
    """Through the manager, what the local source keeps is already in the slots' form on CPU with
    the kernels (a reload is plain copies), and as read where the slots take PEFT's layout."""
    from harness.engine_helpers import load_adapters, make_core

    path = write_tiny_adapter(tmp_path / "a", seed=1)
    core = make_core()
    load_adapters(core, {"a": path}, preload=True)
    kept = core.lora._source.fetch(str(path), None, core.lora._pool.host_form)
    assert kept.tier == "cache" and kept.slot_form == core.lora._pool.b_rank_major
    core.shutdown()
