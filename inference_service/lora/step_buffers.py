"""The LoRA metadata of a capture-safe decode step, in static device buffers the LoRA manager owns.

A captured step (a CUDA graph, or a step compiled whole) reads the same memory on every replay, so
what changes from step to step is written into these buffers in place, never rebuilt: allocated
once for the largest batch-size bucket, and each bucket's `LoRABatch` is a set of views into them.

Per row of the batch (padding rows and base-model rows alike have no adapter):
- `row_pages` [rows, max_pages]: the row's adapter pages in rank order, padded with the pool's zero
  page (a base-model row is all zero pages, so its delta is exactly zero with no branch): what the
  torch op's per-row gather reads (each row its own group, `LoRABatch.pages`);
- `row_ranks` [rows]: its adapter's rank (0 without one).
Per run of consecutive rows on one adapter (the segments the Triton kernels take, `LoRABatch.runs`):
- `runs` [rows, 4]: first row, end row, offset of its pages in `run_pages`, rank; unused runs are
  all zeros (first == end: no work), so a kernel launches over a fixed number of runs;
- `run_pages` [rows · max_pages]: the runs' page lists, one after another.
Scaling needs no buffer: the pool folds it into B when an adapter is loaded (mem_pool.py).

`fill` writes all of it from the host with one copy (a pinned staging buffer on CUDA).
"""

from __future__ import annotations

import torch

from inference_service.lora.ops import LoRABatch

RowAdapter = tuple[tuple[int, ...], int]  # an adapter's pages in rank order and its rank; ((), 0): none


class LoRAStepBuffers:
    def __init__(self, max_rows: int, max_pages: int, page_rank: int, zero_page: int, device: torch.device) -> None:
        self.max_rows, self.max_pages, self.page_rank, self.zero_page = max_rows, max_pages, page_rank, zero_page
        sizes = (max_rows * max_pages, max_rows, max_rows * 4, max_rows * max_pages)
        self._device = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        self._host = torch.zeros(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        device_parts = self._device.split(sizes)
        host_parts = self._host.split(sizes)
        self.row_pages, self.row_ranks = device_parts[0].view(max_rows, max_pages), device_parts[1]
        self.runs, self.run_pages = device_parts[2].view(max_rows, 4), device_parts[3]
        self._host_row_pages, self._host_row_ranks = host_parts[0].view(max_rows, max_pages), host_parts[1]
        self._host_runs, self._host_run_pages = host_parts[2].view(max_rows, 4), host_parts[3]
        self.row_pages.fill_(zero_page)
        self.run_pages.fill_(zero_page)
        self.nbytes = self._device.nbytes

    def fill(self, rows: list[RowAdapter]) -> None:
        """Write the adapters of a step's rows (in batch order; at most `max_rows`; rows past them,
        a bucket's padding, get none) into the buffers in place."""
        assert len(rows) <= self.max_rows, f"{len(rows)} rows, buffers for {self.max_rows}"
        self._host_row_pages.fill_(self.zero_page)
        self._host_row_ranks.zero_()
        self._host_runs.zero_()
        self._host_run_pages.fill_(self.zero_page)
        run_count, page_count, previous = 0, 0, None
        for row, (pages, rank) in enumerate(rows):
            if not pages:
                previous = None
                continue
            assert len(pages) <= self.max_pages, f"an adapter of {len(pages)} pages, buffers for {self.max_pages}"
            self._host_row_pages[row, : len(pages)] = torch.tensor(pages)
            self._host_row_ranks[row] = rank
            if previous == pages:  # the run goes on
                self._host_runs[run_count - 1, 1] = row + 1
                continue
            self._host_runs[run_count] = torch.tensor([row, row + 1, page_count, rank])
            self._host_run_pages[page_count : page_count + len(pages)] = torch.tensor(pages)
            run_count, page_count, previous = run_count + 1, page_count + len(pages), pages
        self._device.copy_(self._host, non_blocking=True)

    def batch(self, rows: int) -> LoRABatch:
        """The LoRA batch of a bucket of `rows` rows: views into the buffers, the same on every step."""
        return LoRABatch(
            pages=self.row_pages[:rows], gather_rows=None, dest_rows=None, src_positions=None, num_groups=rows,
            max_group_len=1, num_tokens=rows, first_row=0, runs=self.runs[:rows], run_pages=self.run_pages,
            max_rank=self.max_pages * self.page_rank,
        )
