"""Paged KV cache: fixed-size blocks (accounted by `BlockPool`) and per-request block tables."""

from __future__ import annotations

import math
import mmap

import torch

from inference_service.engine.block_pool import BlockPool
from inference_service.models.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    # K and V, every layer.
    return 2 * config.num_layers * block_size * config.kv_size * torch.empty((), dtype=dtype).element_size()


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor; on CPU an anonymous mapping of its own, which the kernel hands out zeroed and
    faults in as blocks are first written: a cache sized from the machine's available memory costs
    nothing at start (writing zeros cost ~1.4 s per 256 MiB of a fresh VM's memory) and only the
    blocks requests reach take memory."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    numel = math.prod(shape)
    region = mmap.mmap(-1, max(numel * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)  # holds the mapping


class KVCache:
    """Per-layer K/V tensors [num_blocks, block_size, kv_heads, head_dim]; which blocks are free,
    cached or held is the `BlockPool`'s."""

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
        prefix_caching: bool = True, spare_block: bool = False,
    ) -> None:
        """`spare_block`: one block more in the tensors, outside the pool, where the padding rows of a
        captured decode step write their K/V (`pad_slot`)."""
        self.pool = BlockPool(num_blocks, prefix_caching)
        shape = (num_blocks + int(spare_block), block_size, config.num_kv_heads, config.head_dim)
        # Small pages, unlike the weights (models/linear.arena_for): on 2 MiB pages a batch-32 decode
        # step was no faster (19.75 vs 19.67 ms).
        self.layers = [(_zeros(shape, device, dtype), _zeros(shape, device, dtype)) for _ in range(config.num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.nbytes = num_blocks * kv_bytes_per_block(config, block_size, dtype)

    @property
    def pad_slot(self) -> int:
        """The spare block's first position (no sequence's block: the pool never hands it out)."""
        assert self.layers[0][0].shape[0] > self.num_blocks, "made without spare_block"
        return self.num_blocks * self.block_size

    @property
    def prefix_caching(self) -> bool:
        return self.pool.caching

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (free, or cached and unheld)."""
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        """Blocks requests hold (cached blocks nobody holds are not counted: they are no leak)."""
        return self.pool.num_held

    @property
    def num_cached(self) -> int:
        return self.pool.num_cached

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_table) <= self.pool.num_free

    def grown(self, block_table: list[int], num_tokens: int) -> list[int]:
        """A new block table: `block_table` extended to hold num_tokens (callers check can_grow
        first). Tables are never changed in place, so a launched step keeps the one it was planned
        with while the scheduler moves on (async scheduling)."""
        new = self.pool.allocate(self.blocks_needed(num_tokens) - len(block_table))
        return block_table + new if new else block_table

    def release(self, block_table: list[int]) -> None:
        """Drop a table's references (its owner drops the table: it is not emptied in place)."""
        self.pool.release(block_table)
