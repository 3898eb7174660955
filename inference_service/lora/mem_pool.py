"""LoRA slots on the device: slot-stacked A/B buffers, uid_to_slot / slot_to_uid, LRU eviction.

The modules that feed one fused base projection (q,k,v; gate,up; see `BaseModelShapes.fused`)
share one A buffer, `A [n_slots, n·r_max, in]` with their A stacked along the rank axis, so one
shrink matmul serves the whole projection; each module has its own B, stored as the LoRA op
reads it: `[n_slots, out, r_max]` (PEFT's layout) or rank-major `[n_slots, r_max, out]` (the CPU
kernel's, which expands along output columns).
`buffers[(layer, module)]` are the per-module (A view, B view as [n_slots, out, r_max] whatever
the storage) pairs. Ranks below r_max are zero-padded and the adapter's scaling is folded into B.
Host adapters are brought into the slots' form once, when staged (`host_form`), so that a load
(again after every eviction) is plain copies.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from adapter_cache.adapter_format import BaseModelShapes, HostAdapter
from inference_service.kernels.copy import CopyJob, CopyProgram
from inference_service.lora.backend import transpose_into
from inference_service.lora.ops import SlicedB

SlotBuffers = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
GroupBuffers = dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[SlicedB]]]


class LoRAMemoryPool:
    def __init__(
        self,
        num_slots: int,
        max_rank: int,
        shapes: BaseModelShapes,
        device: torch.device,
        dtype: torch.dtype,
        b_rank_major: bool = False,
    ) -> None:
        self.num_slots, self.max_rank, self.b_rank_major = num_slots, max_rank, b_rank_major
        self.group_buffers: GroupBuffers = {}
        self.buffers: SlotBuffers = {}
        for layer in range(shapes.num_layers):
            for group in shapes.module_groups():
                in_features = shapes.features[group[0]][0]
                outs = [shapes.features[module][1] for module in group]
                assert all(shapes.features[m][0] == in_features for m in group), f"{group} must share an input"
                a = torch.zeros(num_slots, len(group) * max_rank, in_features, device=device, dtype=dtype)
                sliced, col = [], 0
                for i, (module, out_features) in enumerate(zip(group, outs, strict=True)):
                    shape = (max_rank, out_features) if b_rank_major else (out_features, max_rank)
                    b = torch.zeros(num_slots, *shape, device=device, dtype=dtype)
                    b_view = b.transpose(1, 2) if b_rank_major else b
                    self.buffers[(layer, module)] = (a[:, i * max_rank : (i + 1) * max_rank], b_view)
                    sliced.append(SlicedB(col, col + out_features, b))
                    col += out_features
                self.group_buffers[(layer, group)] = (a, sliced)
        self.nbytes = sum(a.nbytes + b.nbytes for a, b in self.buffers.values())
        self.dtype = dtype
        # Per module: A's address, slot stride, in features; rank-major B's address, out features.
        self._addresses = {
            key: (a.data_ptr(), a.stride(0), a.shape[2], b.data_ptr(), b.shape[1])
            for key, (a, b) in self.buffers.items()
        }
        self.uid_to_slot: dict[str, int] = {}
        self.slot_to_uid: list[str | None] = [None] * num_slots
        self._last_use = [0] * num_slots
        self._clock = itertools.count(1)

    def find_slot(self, unevictable: set[str]) -> int | None:
        """A free slot, else the least recently used one whose adapter is not in `unevictable`."""
        free = [s for s, uid in enumerate(self.slot_to_uid) if uid is None]
        if free:
            return free[0]
        candidates = [s for s, uid in enumerate(self.slot_to_uid) if uid not in unevictable]
        return min(candidates, key=self._last_use.__getitem__) if candidates else None

    def assign(self, slot: int, uid: str) -> None:
        assert self.slot_to_uid[slot] is None, f"slot {slot} still holds {self.slot_to_uid[slot]}"
        self.slot_to_uid[slot] = uid
        self.uid_to_slot[uid] = slot
        self.touch(uid)

    def free(self, uid: str) -> int:
        slot = self.uid_to_slot.pop(uid)
        self.slot_to_uid[slot] = None
        return slot

    def touch(self, uid: str) -> None:
        self._last_use[self.uid_to_slot[uid]] = next(self._clock)

    def host_form(self, adapter: HostAdapter) -> HostAdapter:
        """`adapter` as rank-major slots hold it (`HostAdapter.slot_form`); as it is for PEFT-layout
        slots, which take it as read. Runs on a host-loader thread when an adapter is staged (the
        manager's adapters reach `copy_into_slot` in this form already)."""
        if not self.b_rank_major or adapter.slot_form:
            return adapter
        modules = {}
        for key, (a, b, scaling) in adapter.modules.items():
            bt = torch.empty(b.shape[1], b.shape[0], dtype=self.dtype)
            transpose_into(bt, b, scaling)
            modules[key] = (a.to(self.dtype).contiguous(), bt, 1.0)
        size = sum(a.nbytes + bt.nbytes for a, bt, _ in modules.values())
        # The tensors are new, so the source's buffer is not kept alive with them.
        return dataclasses.replace(adapter, modules=modules, size_bytes=size, keepalive=None, slot_form=True)

    def copy_into_slot(self, slot: int, adapter: HostAdapter) -> CopyJob:
        """The work of overwriting one slot, for the overlap loader to run on its copy engine,
        whole or in pieces of one module each (see ThreadCopyEngine and `CopyJob`).

        Every module is written: ranks past the adapter's and modules it lacks become zeros, so
        nothing of the slot's previous adapter can leak into the new one."""
        adapter = self.host_form(adapter)
        whole = functools.partial(self._copy_modules, slot, adapter, list(self.buffers))
        chunks = tuple(functools.partial(self._copy_modules, slot, adapter, [key]) for key in self.buffers)
        program = functools.partial(self._copy_program, slot, adapter) if self.b_rank_major else None
        return CopyJob(whole, chunks, program)

    def _copy_program(self, slot: int, adapter: HostAdapter) -> CopyProgram | None:
        """The whole slot copy for the C copy engine (CPU, rank-major B, the adapter in the slots'
        form), or None where it cannot be. Addresses are computed, not viewed: views cost ~1 ms of
        GIL per load here."""
        program = CopyProgram(self.dtype)
        width, r_max = self.dtype.itemsize, self.max_rank
        for key, (a_base, a_slot_stride, size_in, bt_base, size_out) in self._addresses.items():
            a_slot = a_base + slot * a_slot_stride * width  # [r_max, in], rows contiguous
            bt_slot = bt_base + slot * r_max * size_out * width  # [r_max, out], rows contiguous
            weights = adapter.modules.get(key)
            rank = 0 if weights is None else weights[0].shape[0]
            if weights is not None:
                program.copy(a_slot, weights[0])
                program.copy(bt_slot, weights[1])
            program.zero(a_slot + rank * size_in * width, (r_max - rank) * size_in)
            program.zero(bt_slot + rank * size_out * width, (r_max - rank) * size_out)
        return program if program.ok else None

    def _copy_modules(self, slot: int, adapter: HostAdapter, keys: list[tuple[int, str]]) -> None:
        """The part of a slot copy for these (layer, module) keys, with torch: a few multi-tensor
        calls (copy, scale B, zero the rest) for all of them."""
        destinations: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        scaled: list[torch.Tensor] = []
        scales: list[float] = []
        zeroed: list[torch.Tensor] = []
        for key in keys:
            a_buf, b_buf = self.buffers[key]
            a_slot, b_slot = a_buf[slot], b_buf[slot]
            weights = adapter.modules.get(key)
            if weights is None:
                zeroed += [a_slot, b_slot]
                continue
            a, b, scaling = weights
            rank = a.shape[0]
            destinations.append(a_slot[:rank])
            sources.append(a)
            destinations.append(b_slot.t()[:rank] if self.b_rank_major else b_slot[:, :rank])
            sources.append(b)
            if not self.b_rank_major:  # an adapter in the slots' form has its scaling folded in already
                scaled.append(b_slot[:, :rank])
                scales.append(scaling)
            if rank < self.max_rank:
                zeroed += [a_slot[rank:], b_slot[:, rank:]]

        if destinations:
            torch._foreach_copy_(destinations, sources, non_blocking=True)
        if scaled:
            torch._foreach_mul_(scaled, scales)
        if zeroed:
            torch._foreach_zero_(zeroed)

