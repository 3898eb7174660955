"""LoRA slots on the device: slot-stacked A/B buffers, uid_to_slot / slot_to_uid, LRU eviction.

Buffers per layer and module are `A [n_slots, r_max, in]` and `B [n_slots, out, r_max]`; ranks
below r_max are zero-padded and the adapter's scaling is folded into B.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from inference_service.lora.adapter import BaseModelShapes, HostAdapter

SlotBuffers = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAMemoryPool:
    def __init__(
        self, num_slots: int, max_rank: int, shapes: BaseModelShapes, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self.buffers: SlotBuffers = {}
        for layer in range(shapes.num_layers):
            for module, (in_features, out_features) in shapes.features.items():
                self.buffers[(layer, module)] = (
                    torch.zeros(num_slots, max_rank, in_features, device=device, dtype=dtype),
                    torch.zeros(num_slots, out_features, max_rank, device=device, dtype=dtype),
                )
        self.nbytes = sum(a.nbytes + b.nbytes for a, b in self.buffers.values())
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

    def copy_into_slot(self, slot: int, adapter: HostAdapter) -> Callable[[], None]:
        """The work of overwriting one slot, for the overlap loader to run on its copy stream.

        Every module is written: ranks past the adapter's and modules it lacks become zeros, so
        nothing of the slot's previous adapter can leak into the new one.
        """

        def copy() -> None:
            for key, (a_buf, b_buf) in self.buffers.items():
                a_slot, b_slot = a_buf[slot], b_buf[slot]
                weights = adapter.modules.get(key)
                if weights is None:
                    a_slot.zero_()
                    b_slot.zero_()
                    continue
                a, b, scaling = weights
                rank = a.shape[0]
                a_slot[:rank].copy_(a, non_blocking=True)
                a_slot[rank:].zero_()
                if b.device == b_slot.device:  # one pass: scale while copying
                    torch.mul(b, scaling, out=b_slot[:, :rank])
                else:  # host → device: async copy from pinned memory, then scale on the device
                    b_slot[:, :rank].copy_(b, non_blocking=True)
                    b_slot[:, :rank].mul_(scaling)
                b_slot[:, rank:].zero_()

        return copy
