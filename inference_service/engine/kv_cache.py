"""Paged KV cache: fixed-size blocks, a free list, and per-request block tables."""

from __future__ import annotations

import math

import torch

from inference_service.models.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    # K and V, every layer.
    return 2 * config.num_layers * block_size * config.kv_size * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Per-layer K/V tensors [num_blocks, block_size, kv_heads, head_dim] and the block free list."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.layers = [
            (torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(config.num_layers)
        ]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.nbytes = num_blocks * kv_bytes_per_block(config, block_size, dtype)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_table) <= len(self._free)

    def grown(self, block_table: list[int], num_tokens: int) -> list[int]:
        """A new block table: `block_table` extended to hold num_tokens (callers check can_grow
        first). Tables are never changed in place, so a launched step keeps the one it was planned
        with while the scheduler moves on (async scheduling)."""
        new = [self._free.pop() for _ in range(self.blocks_needed(num_tokens) - len(block_table))]
        return block_table + new if new else block_table

    def release(self, block_table: list[int]) -> None:
        """Return a table's blocks (its owner drops the table: it is not emptied in place)."""
        self._free.extend(reversed(block_table))
