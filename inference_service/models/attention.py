"""Paged attention behind one interface: `AttentionBackend`, one per name in `BACKENDS`, the one the
platform plan (inference_service/platform) names made by `make_attention_backend`.

A backend writes a layer's new K/V into its cache blocks (unless the fused RoPE kernel already
did) and attends: decode rows batched, each prefill segment on its own. The torch backend runs
everywhere; on CPU the C kernel reads decode context in place from the blocks; on CUDA, where
triton is installed, the Triton decode kernel does (`kernels/triton_attention.py`, imported only
then).
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
import torch.nn.functional as F

from inference_service.kernels import paged_attention as cpu_kernels
from inference_service.models.batch import AttentionBatch, PrefillSegment

KVLayer = tuple[torch.Tensor, torch.Tensor]  # one layer's K and V caches [num_blocks, block_size, Hkv, D]
# The backends by name (`--attention-backend`), in the order auto tries them: the C kernels on CPU, the
# Triton kernel on CUDA, torch's SDPA anywhere. Where each runs: `backend_runs`; what it needs, for the
# message when it is named where it cannot run: `NEEDS`; the C kernels' are off with `--kernels off`.
BACKENDS = ("c", "triton", "torch")
NEEDS = {"c": "the C kernels on CPU (--kernels auto)", "triton": "CUDA and triton", "torch": ""}
C_KERNEL_BACKENDS = frozenset({"c"})


class AttentionBackend(Protocol):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, batch: AttentionBatch, cached: bool
    ) -> torch.Tensor:
        """Attention output [T, Hq, D] for q [T, Hq, D] and this step's k/v [T, Hkv, D].
        `cached`: k and v are already in the cache at `batch.slot_mapping`."""
        ...


def backend_runs(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether backend `name` runs on this device and dtype (the C kernel is built now where it may)."""
    if name == "c":
        return cpu_kernels.available(device, dtype)
    if name == "triton":
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    return name == "torch"


def make_attention_backend(name: str, prefill_kernel: bool = False) -> AttentionBackend:
    """The backend the platform plan named (`BACKENDS`): "c" (with the C prefill kernel where
    `prefill_kernel`), "triton" or "torch"."""
    if name == "c":
        return CpuPagedAttention(prefill_kernel=prefill_kernel)
    if name == "triton":
        return TritonPagedAttention()
    assert name == "torch", f"unknown attention backend {name!r}"
    return TorchPagedAttention()


class GatherScratch:
    """Reused destinations for the K and V block gathers of every layer and step.

    A fresh tensor per gather (tens of MB in a large decode batch) made glibc hand the pages back
    and fault them in again each time: the gather plus attention ran ~5x slower on CPU.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, which: int, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Whole blocks by index (one memcpy per block, ~2x faster than advanced indexing)."""
        rows, row_size = tables.numel(), cache[0].numel()
        buffer = self._buffers[which]
        if buffer is None or buffer.numel() < rows * row_size or buffer.dtype != cache.dtype or (
            buffer.device != cache.device
        ):
            # Grow with headroom: decode contexts lengthen a block at a time.
            buffer = torch.empty(rows * row_size * 5 // 4, dtype=cache.dtype, device=cache.device)
            self._buffers[which] = buffer
        out = buffer[: rows * row_size].view(rows, row_size)
        torch.index_select(cache.view(cache.shape[0], -1), 0, tables.reshape(-1), out=out)
        return out.view(*tables.shape, *cache.shape[1:])


class TorchPagedAttention:
    """SDPA over gathered blocks: runs on any device."""

    def __init__(self) -> None:
        self.scratch = GatherScratch()  # shared by every layer: they run one after another

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: KVLayer, batch: AttentionBatch, cached: bool
    ) -> torch.Tensor:
        k_cache, v_cache = kv
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        if not cached:
            k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, k)
            v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, batch.slot_mapping, v)
        decode_rows = batch.decode_rows
        all_decode = decode_rows is not None and not batch.prefills and decode_rows.shape[0] == q.shape[0]
        out = None if all_decode else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decode_rows is not None:
            tables, lens = batch.decode_block_tables, batch.decode_lens
            assert tables is not None and lens is not None  # set together with decode_rows
            # Rows are numbered in batch order, so a batch of decodes only is rows 0..T-1: no gathers.
            queries = q if all_decode else q.index_select(0, decode_rows)  # [Bd, Hq, D]
            result = self.decode(queries, k_cache, v_cache, tables, lens)
            if out is None:  # all rows are decodes: the result is the output
                return result
            out.index_copy_(0, decode_rows, result)
        assert out is not None  # only batches of decodes alone return above
        self.prefill(q, k, v, k_cache, v_cache, batch, out)
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        out: torch.Tensor,
    ) -> None:
        """Each prefill segment's causal attention into its rows of `out`, over its own k/v and, after a
        first chunk, the cached context: in place where `prefill_in_place` can, else gather + SDPA."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        rest = []  # segments left to the gather + SDPA path
        for i, seg in enumerate(batch.prefills):
            result = self.prefill_in_place(q[seg.start : seg.end], k_cache, v_cache, seg)
            if result is None:
                rest.append(i)
            else:
                out[seg.start : seg.end] = result
        # One gather for K and one for V per layer, of every segment's blocks at once: a gather per
        # segment was 64 parallel regions a step for 8 segments of 4 layers (docs/performance.md).
        context = batch.context_blocks() if any(batch.prefills[i].num_computed for i in rest) else None
        if context is not None:
            index, offsets = context
            all_keys = self.scratch.gather(0, k_cache, index)  # [blocks, block_size, Hkv, D]
            all_values = self.scratch.gather(1, v_cache, index)
        for i in rest:
            seg = batch.prefills[i]
            queries = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
            if seg.num_computed == 0:
                keys = k[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
                values = v[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
                result = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
            else:
                assert context is not None  # every segment over cached context is in it
                length = seg.num_computed + seg.end - seg.start
                first, last = offsets[i], offsets[i] + seg.block_table.shape[0]
                keys = all_keys[first:last].view(-1, num_kv_heads, head_dim)[:length]
                values = all_values[first:last].view(-1, num_kv_heads, head_dim)[:length]
                query_pos = torch.arange(seg.num_computed, length, device=q.device)[:, None]
                mask = torch.arange(length, device=q.device)[None, :] <= query_pos
                result = F.scaled_dot_product_attention(
                    queries,
                    keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask,
                    enable_gqa=True,
                )
            out[seg.start : seg.end] = result.squeeze(0).transpose(0, 1)

    def prefill_in_place(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment
    ) -> torch.Tensor | None:
        """A segment's attention (q: its rows) read from the cache in place, where a backend has a kernel
        for it; None here: the gather + SDPA path."""
        return None

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        """One query per sequence [B, Hq, D] over its first `lens[b]` cached tokens (tables [B, max_blocks])."""
        batch_size, num_kv_heads, head_dim = tables.shape[0], k_cache.shape[2], k_cache.shape[3]
        keys = self.scratch.gather(0, k_cache, tables).view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = self.scratch.gather(1, v_cache, tables).view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
        valid = torch.arange(keys.shape[2], device=q.device)[None, :] < lens[:, None]
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :], enable_gqa=True
        ).squeeze(2)


class CpuPagedAttention(TorchPagedAttention):
    """Decode through the C kernel, which reads the blocks in place (no gather); prefill chunks through
    the C prefill kernel where it is the faster (`prefill_kernel`), else as torch."""

    def __init__(self, prefill_kernel: bool) -> None:
        super().__init__()
        self.prefill_kernel = prefill_kernel

    def prefill_in_place(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: PrefillSegment
    ) -> torch.Tensor | None:
        if not self.prefill_kernel:
            return None
        # The chunk's K/V are in the cache by now; None (a shape the kernel does not take): torch's path.
        return cpu_kernels.prefill_attention(q, k_cache, v_cache, seg.block_table, seg.num_computed)

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        result = cpu_kernels.decode_attention(q, k_cache, v_cache, tables, lens)
        # None: a case the kernel does not take (layout, dtype): the torch path computes the same.
        return result if result is not None else super().decode(q, k_cache, v_cache, tables, lens)


class TritonPagedAttention(TorchPagedAttention):
    """Decode through the Triton kernel, which reads the blocks in place (no gather); prefill as torch."""

    def __init__(self) -> None:
        super().__init__()
        from inference_service.kernels import triton_attention  # triton only where this backend is chosen

        self._decode = triton_attention.paged_decode_attention

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        return self._decode(q, k_cache, v_cache, tables, lens)
