"""The adapter pool on the device: pages of rank rows, uid_to_pages / page_to_uid, LRU eviction by pages.

An adapter of rank r takes ceil(r / page_rank) pages, so its memory is its real size within one
page's rounding (S-LoRA's unified paging, with pages of `page_rank` rank rows rather than one). Every
per-layer buffer is paged the same way, so a page number names the same rank rows everywhere:

- the modules that feed one fused base projection (q,k,v; gate,up; see `BaseModelShapes.fused`)
  share one A buffer `A [pages + 1, n·page_rank, in]`, their A rows stacked along the rank axis,
  so one shrink serves the whole projection;
- each module has its own B, `[pages + 1, out, page_rank]` (PEFT's layout) or rank-major
  `[pages + 1, page_rank, out]` (the CPU kernel's, which expands along output columns).

An MoE model's expert groups (`experts.E.gate_proj` + `up_proj`; `experts.E.down_proj`) are views
into one tensor per layer and group, [experts, pages + 1, ...], so one LoRA op serves every expert
(`group_buffers[(layer, ("experts.gate_proj", "experts.up_proj"))]`, its pages numbered per
expert: `pages_per_expert`).

The last page, `zero_page`, is all zeros and never handed out: the torch op pads shorter page
lists with it. Rank rows past an adapter's rank in its last page, and pages of modules it lacks,
are written as zeros by every load, so nothing of a page's previous adapter leaks into the next.

`buffers[(layer, module)]` are the per-module (A view [pages + 1, page_rank, in], B view
[pages + 1, out, page_rank] whatever the storage) pairs. Scaling is folded into B. Host adapters are
brought into the pages' form once, when staged (`host_form`), so a load (again after every
eviction) is plain copies.

Capacity: `num_pages` from a byte budget (`--max-loras auto`), or a fixed count of max-rank
adapters (`--max-loras N`: N x pages of the largest rank, and at most N adapters resident, the old
fixed-slot pool's behaviour). An adapter's "slot" is its first page: a handle unique among the
resident adapters, which the model runner groups rows by.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from collections import Counter
from collections.abc import Mapping

import torch

from adapter_cache.adapter_format import BaseModelShapes, HostAdapter
from inference_service.kernels import hugepages
from inference_service.kernels.copy import CopyJob, CopyProgram
from inference_service.lora.backend import transpose_into
from inference_service.lora.ops import SlicedB
from inference_service.lora.pool_shares import PoolShares

PageBuffers = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
GroupBuffers = dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[SlicedB]]]

DEFAULT_PAGE_RANK = 8


def pages_for(rank: int, page_rank: int) -> int:
    return max(1, -(-rank // page_rank))


def expert_group(group: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    """An MoE expert's module group (`experts.E.gate_proj`, ...): (E, the names without E); else (None, group)."""
    parts = [module.split(".") for module in group]
    if not all(len(p) == 3 and p[0] == "experts" and p[1].isdigit() for p in parts):
        return None, group
    assert len({p[1] for p in parts}) == 1, f"{group}: one expert's modules"
    return int(parts[0][1]), tuple(f"experts.{p[2]}" for p in parts)


def bytes_per_page(shapes: BaseModelShapes, page_rank: int, dtype: torch.dtype) -> int:
    """Device bytes of one page over every layer and module (A rows and B rows of `page_rank` ranks)."""
    per_layer = sum(in_f + out_f for in_f, out_f in shapes.features.values())
    return shapes.num_layers * per_layer * page_rank * dtype.itemsize


class LoRAMemoryPool:
    def __init__(
        self,
        num_slots: int | None,
        max_rank: int,
        shapes: BaseModelShapes,
        device: torch.device,
        dtype: torch.dtype,
        b_rank_major: bool = False,
        *,
        num_pages: int | None = None,
        page_rank: int = DEFAULT_PAGE_RANK,
        share_bytes: Mapping[str, int] | None = None,
        huge_pages: bool = True,
    ) -> None:
        """`num_slots`: a fixed-slot pool (the old one, and `--max-loras N`): that many pages of
        `max_rank` rows, one adapter each, whatever its rank. None: `num_pages` pages of `page_rank`
        rows, as many adapters as they hold (the pool sized by memory). `share_bytes`: each tenant's
        share of the pool (pool_shares.py), which decides whose adapters a load may evict."""
        if num_slots is not None:
            num_pages, page_rank = num_slots, max_rank
        assert num_pages is not None
        if num_pages < pages_for(max_rank, page_rank):
            raise ValueError(f"an adapter pool of {num_pages} pages cannot hold one adapter of rank {max_rank}")
        self.num_pages, self.page_rank, self.max_rank = num_pages, page_rank, max_rank
        self.shares = PoolShares.from_bytes(share_bytes or {}, bytes_per_page(shapes, page_rank, dtype),
                                            pages_for(max_rank, page_rank), num_pages)
        self.b_rank_major, self.max_adapters = b_rank_major, num_slots
        self.zero_page = num_pages
        self.group_buffers: GroupBuffers = {}
        self.buffers: PageBuffers = {}
        total = num_pages + 1
        # Pages are only read once an adapter's load wrote them (and the zero page, zeroed here):
        # the rest stays untouched memory until used.
        for layer in range(shapes.num_layers):
            stacked: dict[tuple[str, ...], list[torch.Tensor]] = {}  # an expert group's [E, pages + 1, ...]
            for group in shapes.module_groups():
                in_features = shapes.features[group[0]][0]
                outs = [shapes.features[module][1] for module in group]
                assert all(shapes.features[m][0] == in_features for m in group), f"{group} must share an input"
                expert, alike = expert_group(group)
                b_shapes = [(page_rank, o) if b_rank_major else (o, page_rank) for o in outs]
                if expert is not None and alike not in stacked:
                    stacked[alike] = self._stack(layer, alike, shapes.num_experts, total,
                                                 [(len(group) * page_rank, in_features), *b_shapes], dtype, device,
                                                 huge_pages)
                a = (stacked[alike][0][expert] if expert is not None
                     else hugepages.empty((total, len(group) * page_rank, in_features), dtype, device, huge_pages))
                a[self.zero_page].zero_()
                sliced, col = [], 0
                for i, (module, out_features) in enumerate(zip(group, outs, strict=True)):
                    shape = b_shapes[i]
                    b = (stacked[alike][1 + i][expert] if expert is not None
                         else hugepages.empty((total, *shape), dtype, device, huge_pages))
                    b[self.zero_page].zero_()
                    b_view = b.transpose(1, 2) if b_rank_major else b
                    self.buffers[(layer, module)] = (a[:, i * page_rank : (i + 1) * page_rank], b_view)
                    sliced.append(SlicedB(col, col + out_features, b))
                    col += out_features
                self.group_buffers[(layer, group)] = (a, sliced)
        self.pages_per_expert = total  # an expert group's page p of expert e is page e * total + p
        self.nbytes = sum(a.nbytes + b.nbytes for a, b in self.buffers.values())
        self.page_nbytes = self.nbytes // total
        self.dtype = dtype
        # Per module: A's address, page stride, in features; rank-major B's address, out features.
        self._addresses = {
            key: (a.data_ptr(), a.stride(0), a.shape[2], b.data_ptr(), b.shape[1])
            for key, (a, b) in self.buffers.items()
        }
        self.uid_to_pages: dict[str, tuple[int, ...]] = {}
        self.page_to_uid: list[str | None] = [None] * num_pages
        self.uid_to_owner: dict[str, str | None] = {}  # a resident adapter's tenant (None: shared)
        self._free: list[int] = list(range(num_pages))  # a heap: the lowest pages first (less memory touched)
        self._last_use: dict[str, int] = {}
        self._clock = itertools.count(1)

    def _stack(self, layer: int, alike: tuple[str, ...], num_experts: int, total: int,
               shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
               huge_pages: bool) -> list[torch.Tensor]:
        """One tensor [experts, pages + 1, ...] for A and for each B of an expert group (each expert's
        buffers are views into it), registered whole in `group_buffers` under the group's names without
        the expert (`experts.gate_proj`, ...) as [experts · (pages + 1), ...]: one LoRA op reads every
        expert's pages, a (token, expert) pair naming expert e's page p as e · (pages + 1) + p."""
        tensors = [hugepages.empty((num_experts, total, *shape), dtype, device, huge_pages) for shape in shapes]
        flat = [t.view(num_experts * total, *t.shape[2:]) for t in tensors]
        sliced, col = [], 0
        for b, out_features in zip(flat[1:], self._outs(shapes[1:]), strict=True):
            sliced.append(SlicedB(col, col + out_features, b))
            col += out_features
        self.group_buffers[(layer, alike)] = (flat[0], sliced)
        return tensors

    def _outs(self, b_shapes: list[tuple[int, int]]) -> list[int]:
        return [shape[1] if self.b_rank_major else shape[0] for shape in b_shapes]

    # ---- capacity ----

    def pages_for(self, rank: int) -> int:
        return pages_for(rank, self.page_rank)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def slot_to_uid(self) -> list[str | None]:
        """The owner of each page (in a fixed-slot pool a page is a slot)."""
        return self.page_to_uid

    @property
    def uid_to_slot(self) -> dict[str, int]:
        """Each resident adapter's handle (its first page): derived from `uid_to_pages`."""
        return {uid: pages[0] for uid, pages in self.uid_to_pages.items()}

    @property
    def max_rank_capacity(self) -> int:
        """Adapters of the largest rank the pool holds at once (what a fixed-slot pool called slots)."""
        count = self.num_pages // self.pages_for(self.max_rank)
        return count if self.max_adapters is None else min(count, self.max_adapters)

    def pages_by_owner(self) -> Counter[str | None]:
        """Pages each owner's resident adapters hold (copies in flight included). O(resident)."""
        held: Counter[str | None] = Counter()
        for uid, pages in self.uid_to_pages.items():
            held[self.uid_to_owner[uid]] += len(pages)
        return held

    def find_room(self, rank: int, unevictable: set[str], owner: str | None = None) -> list[str] | None:
        """The adapters to evict (least recently used first, none of `unevictable`, only those the
        shares let `owner` take: pool_shares.py) so that one of `rank` fits; [] if it fits now; None
        if it cannot fit without evicting one it may not."""
        wanted = self.pages_for(rank)
        needed = wanted - len(self._free)
        over_count = self.max_adapters is not None and len(self.uid_to_pages) >= self.max_adapters
        if needed <= 0 and not over_count:
            return []
        candidates = sorted((uid for uid in self.uid_to_pages if uid not in unevictable),
                            key=self._last_use.__getitem__)
        return self.shares.victims(owner, wanted, [(uid, self.uid_to_owner[uid], len(self.uid_to_pages[uid]))
                                                   for uid in candidates],
                                   self.pages_by_owner(), needed, over_count)

    def assign(self, uid: str, rank: int, owner: str | None = None) -> tuple[int, ...]:
        assert uid not in self.uid_to_pages, f"{uid} already has pages"
        count = self.pages_for(rank)
        assert count <= len(self._free), f"{count} pages wanted, {len(self._free)} free"
        assert self.max_adapters is None or len(self.uid_to_pages) < self.max_adapters
        pages = tuple(heapq.heappop(self._free) for _ in range(count))
        for page in pages:
            self.page_to_uid[page] = uid
        self.uid_to_pages[uid] = pages
        self.uid_to_owner[uid] = owner
        self.touch(uid)
        return pages

    def free(self, uid: str) -> tuple[int, ...]:
        pages = self.uid_to_pages.pop(uid)
        del self.uid_to_owner[uid]
        del self._last_use[uid]
        for page in pages:
            self.page_to_uid[page] = None
            heapq.heappush(self._free, page)
        return pages

    def slot_of(self, uid: str) -> int | None:
        """The adapter's handle (its first page), or None without pages."""
        pages = self.uid_to_pages.get(uid)
        return pages[0] if pages else None

    def touch(self, uid: str) -> None:
        self._last_use[uid] = next(self._clock)

    # ---- loads ----

    def host_form(self, adapter: HostAdapter) -> HostAdapter:
        """`adapter` as rank-major pages hold it (`HostAdapter.slot_form`); as it is for PEFT-layout
        pages, which take it as read. Runs on a host-loader thread when an adapter is staged (the
        manager's adapters reach `copy_into_pages` in this form already)."""
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

    def copy_into_pages(self, pages: tuple[int, ...], adapter: HostAdapter) -> CopyJob:
        """The work of overwriting an adapter's pages, for the overlap loader to run on its copy
        engine, whole or in pieces of one module each (see ThreadCopyEngine and `CopyJob`).

        Every page of every module is written: rank rows past the adapter's and modules it lacks
        become zeros, so nothing of a page's previous adapter can leak into the new one."""
        adapter = self.host_form(adapter)
        whole = functools.partial(self._copy_modules, pages, adapter, list(self.buffers))
        chunks = tuple(functools.partial(self._copy_modules, pages, adapter, [key]) for key in self.buffers)
        program = functools.partial(self._copy_program, pages, adapter) if self.b_rank_major else None
        return CopyJob(whole, chunks, program)

    def copy_into_slot(self, slot: int, adapter: HostAdapter) -> CopyJob:
        """`copy_into_pages` for one page: a fixed-slot pool's slot."""
        return self.copy_into_pages((slot,), adapter)

    def _copy_program(self, pages: tuple[int, ...], adapter: HostAdapter) -> CopyProgram | None:
        """The whole load for the C copy engine (CPU, rank-major B, the adapter in the pages' form),
        or None where it cannot be. Addresses are computed, not viewed: views cost ~1 ms of GIL per
        load here."""
        program = CopyProgram(self.dtype)
        width, page_rank = self.dtype.itemsize, self.page_rank
        for key, (a_base, a_page_stride, size_in, bt_base, size_out) in self._addresses.items():
            weights = adapter.modules.get(key)
            rank = 0 if weights is None else weights[0].shape[0]
            for k, page in enumerate(pages):
                a_page = a_base + page * a_page_stride * width  # [page_rank, in], rows contiguous
                bt_page = bt_base + page * page_rank * size_out * width  # [page_rank, out], rows contiguous
                rows = min(max(rank - k * page_rank, 0), page_rank)
                if rows:
                    program.copy_range(a_page, weights[0], k * page_rank * size_in, rows * size_in)
                    program.copy_range(bt_page, weights[1], k * page_rank * size_out, rows * size_out)
                if rows < page_rank:
                    program.zero(a_page + rows * size_in * width, (page_rank - rows) * size_in)
                    program.zero(bt_page + rows * size_out * width, (page_rank - rows) * size_out)
        return program if program.ok else None

    def _copy_modules(self, pages: tuple[int, ...], adapter: HostAdapter, keys: list[tuple[int, str]]) -> None:
        """The part of a load for these (layer, module) keys, with torch: a few multi-tensor calls
        (copy, scale B, zero the rest) for all of them."""
        destinations: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        scaled: list[torch.Tensor] = []
        scales: list[float] = []
        zeroed: list[torch.Tensor] = []
        page_rank = self.page_rank
        for key in keys:
            a_buf, b_buf = self.buffers[key]
            weights = adapter.modules.get(key)
            for k, page in enumerate(pages):
                a_page, b_page = a_buf[page], b_buf[page]  # [page_rank, in], [out, page_rank]
                if weights is None:
                    zeroed += [a_page, b_page]
                    continue
                a, b, scaling = weights
                first = k * page_rank
                rows = min(max(a.shape[0] - first, 0), page_rank)
                if rows:
                    destinations.append(a_page[:rows])
                    sources.append(a[first : first + rows])
                    if self.b_rank_major:  # an adapter in the pages' form: Bt [r, out], scaling folded in
                        destinations.append(b_page.t()[:rows])
                        sources.append(b[first : first + rows])
                    else:
                        destinations.append(b_page[:, :rows])
                        sources.append(b[:, first : first + rows])
                        scaled.append(b_page[:, :rows])
                        scales.append(scaling)
                if rows < page_rank:
                    zeroed += [a_page[rows:], b_page[:, rows:]]

        if destinations:
            torch._foreach_copy_(destinations, sources, non_blocking=True)
        if scaled:
            torch._foreach_mul_(scaled, scales)
        if zeroed:
            torch._foreach_zero_(zeroed)
