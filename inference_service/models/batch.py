"""What one forward pass gets: a whole scheduler step packed into one flat [T] token batch.

The model runner builds these; models and attention backends read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference_service.lora.ops import LoRABatch


@dataclass
class PrefillSegment:
    """One request's prefill chunk: rows [start, end) of the batch, on top of `num_computed` cached."""

    start: int
    end: int
    num_computed: int
    block_table: torch.Tensor  # [n_blocks] covering num_computed + (end - start) tokens


@dataclass
class AttentionBatch:
    """Where the step's K/V go and what each request attends to: decode rows batched, prefills per segment."""

    slot_mapping: torch.Tensor  # [T] flat KV position where each token's K/V is written
    decode_rows: torch.Tensor | None = None  # [Bd] batch rows of single-token (decode) requests
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None = None  # [Bd] context length of each decode row (incl. its token)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # Every block of the prefill segments over cached context (num_computed > 0), segment after
    # segment: one gather per layer reads them all (see `context_blocks`). The model runner sets it;
    # built from the segments' tables on first use where it did not.
    context_index: torch.Tensor | None = None

    def context_blocks(self) -> tuple[torch.Tensor, list[int]] | None:
        """The flat block index of every prefill segment over cached context and each such
        segment's first position in it (-1 for a segment without cached context); None if none."""
        if self._context is None:
            offsets, tables, offset = [], [], 0
            for seg in self.prefills:
                if seg.num_computed == 0:
                    offsets.append(-1)
                    continue
                offsets.append(offset)
                tables.append(seg.block_table)
                offset += seg.block_table.shape[0]
            if not tables:
                return None
            index = self.context_index if self.context_index is not None else torch.cat(tables)
            assert index.shape[0] == offset, "context_index does not match the segments' tables"
            self._context = (index, offsets)
        return self._context

    _context: tuple[torch.Tensor, list[int]] | None = field(default=None, init=False, repr=False, compare=False)


@dataclass
class ForwardBatch:
    """One step's tokens, their positions, attention metadata and LoRA slots."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionBatch
    lora: LoRABatch | None
    logits_rows: torch.Tensor  # [S] rows whose next-token logits are needed
