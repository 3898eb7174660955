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


class ExpertStepBuffers:
    """The LoRA grouping of an MoE layer's (token, expert) pairs, in static buffers the LoRA manager
    owns: allocated once for the step's largest token count (times the experts per token) and the
    pool's largest adapter, rewritten in place by every MoE layer from the step's `LoRABatch` and
    the layer's routing, on the device, with no host read (so a captured step could run it too).

    The pool stacks each expert group's pages ([experts · (pages + 1), ...], mem_pool.py), so one op
    per projection serves every expert: each pair is its own row, reading its token's adapter pages
    shifted to its expert's (the zero page shifts to the expert's zero page: base rows add zero).
    - `token_pages` [tokens, max_pages], `token_ranks` [tokens]: each token's adapter, from the
      batch's runs (each row compared with the runs' bounds, so no per-token host work);
    - `pair_pages` [pairs, max_pages]: each pair's pages, and its runs [pairs, 4], one pair each
      (row i, i + 1, its pages at i · max_pages in `pair_pages`, its rank): what the C kernel reads.
    """

    def __init__(self, max_tokens: int, top_k: int, max_pages: int, page_rank: int, zero_page: int,
                 pages_per_expert: int, device: torch.device) -> None:
        self.max_tokens, self.max_pairs = max_tokens, max_tokens * top_k
        self.max_pages, self.page_rank, self.zero_page = max_pages, page_rank, zero_page
        self.pages_per_expert = pages_per_expert
        long = dict(dtype=torch.long, device=device)
        self._token_index = torch.arange(max_tokens, **long)
        self.token_pages = torch.full((max_tokens, max_pages), zero_page, **long)
        self.token_ranks = torch.zeros(max_tokens, **long)
        self.pair_pages = torch.full((self.max_pairs, max_pages), zero_page, **long)
        pairs = torch.arange(self.max_pairs, **long)
        self.runs = torch.stack([pairs, pairs + 1, pairs * max_pages, torch.zeros_like(pairs)], dim=1)
        self._page_index = torch.arange(max_pages, **long)
        self.nbytes = sum(t.nbytes for t in (self._token_index, self.token_pages, self.token_ranks, self.pair_pages,
                                             self.runs, self._page_index))

    def group(self, lora: LoRABatch, token_of_pair: torch.Tensor, expert_of_pair: torch.Tensor) -> LoRABatch:
        """The LoRA batch of the pairs (token `token_of_pair[i]` on expert `expert_of_pair[i]`, in the
        order the layer computes them), written into the buffers; views into them."""
        tokens, pairs = lora.num_tokens, token_of_pair.shape[0]
        assert tokens <= self.max_tokens and pairs <= self.max_pairs, (
            f"{tokens} tokens, {pairs} pairs: expert buffers for {self.max_tokens}, {self.max_pairs}")
        assert lora.runs is not None and lora.run_pages is not None
        first, end, offset, rank = lora.runs.unbind(1)
        # Each token's run + 1 (0: the base model; an unused run, first == end, holds no row), by
        # comparing the rows with the runs' bounds: [tokens, runs] compares, where the runs are the
        # step's sequences at most (a scatter-add on long tensors took 30% of a CPU decode step).
        rows = self._token_index[:tokens, None]
        inside = (rows >= first) & (rows < end)
        run_of = (inside * torch.arange(1, lora.runs.shape[0] + 1, device=lora.runs.device)).sum(1)
        run = (run_of - 1).clamp(min=0)
        ranks = self.token_ranks[:tokens]
        ranks.copy_(torch.where(run_of > 0, rank.index_select(0, run), 0))
        pages_used = (ranks + self.page_rank - 1) // self.page_rank
        at = (offset.index_select(0, run)[:, None] + self._page_index).clamp(max=lora.run_pages.shape[0] - 1)
        token_pages = self.token_pages[:tokens]
        token_pages.copy_(torch.where(self._page_index < pages_used[:, None], lora.run_pages[at], self.zero_page))
        pair_pages = self.pair_pages[:pairs]
        pair_pages.copy_(token_pages.index_select(0, token_of_pair) + expert_of_pair[:, None] * self.pages_per_expert)
        runs = self.runs[:pairs]
        runs[:, 3].copy_(ranks.index_select(0, token_of_pair))
        return LoRABatch(
            pages=pair_pages, gather_rows=None, dest_rows=None, src_positions=None, num_groups=pairs,
            max_group_len=1, num_tokens=pairs, first_row=0, runs=runs, run_pages=self.pair_pages.view(-1),
            max_rank=self.max_pages * self.page_rank,
        )
