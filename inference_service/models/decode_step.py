"""A capture-safe decode step: one token per sequence, its inputs in static buffers filled in place.

What a CUDA graph replays, or a step compiled whole (torch.compile, fullgraph), must read the same
memory every time and must not ask the host anything while it runs. So:
- the step's inputs (token ids, positions, KV slot mapping, block tables, sequence lengths) live in
  `DecodeInputs`, allocated once for the largest batch-size bucket and written in place before each
  step (one host→device copy); a bucket's `ForwardBatch` is views into them, built once;
- the LoRA metadata lives in the LoRA manager's `LoRAStepBuffers` (lora/step_buffers.py), the same;
- the step itself (`decode_tokens`) is the model's own layer forward over those views, with ops that
  neither allocate host-side nor sync: no `.item()`, `.tolist()` or branch on a tensor's value. Its
  Python branches depend only on the bucket (shapes), which is fixed per captured step.

Rows past a step's real ones (a bucket's padding) take token 0 at position 0, attend to one token,
have no adapter, and write their K/V to `pad_slot`, a cache position no sequence uses (the engine
reserves a block for it); their tokens are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_service.lora.ops import LoRABatch, LoRAOp
from inference_service.models import linear as dense
from inference_service.models.attention import AttentionBackend, KVLayer, TorchPagedAttention
from inference_service.models.batch import AttentionBatch, ForwardBatch
from inference_service.models.llama import LlamaModel

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows` rows; None if none does (the step runs uncaptured)."""
    return next((size for size in buckets if size >= rows), None)


class DecodeInputs:
    """The step's inputs in static buffers (one device tensor, one pinned host staging copy)."""

    def __init__(self, max_rows: int, max_blocks: int, pad_slot: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks, self.pad_slot = max_rows, max_blocks, pad_slot
        width = 4 + max_blocks  # token, position, slot, length, then the block table
        self._device = torch.zeros(max_rows, width, dtype=torch.long, device=device)
        self._host = torch.zeros(max_rows, width, dtype=torch.long, pin_memory=device.type == "cuda")
        self.input_ids, self.positions = self._device[:, 0], self._device[:, 1]
        self.slot_mapping, self.seq_lens = self._device[:, 2], self._device[:, 3]
        self.block_tables = self._device[:, 4:]
        self.rows = torch.arange(max_rows, device=device)  # decode_rows and logits_rows: every row
        self._clear_host()
        self._device.copy_(self._host)

    def _clear_host(self) -> None:
        host = self._host
        host.zero_()
        host[:, 2] = self.pad_slot
        host[:, 3] = 1

    def fill(self, tokens: list[int], positions: list[int], tables: list[list[int]], block_size: int) -> None:
        """Write a step's rows (each sequence's new token, its position and block table) in place;
        the rest become padding rows."""
        assert len(tokens) == len(positions) == len(tables) <= self.max_rows
        self._clear_host()
        host = self._host
        for row, (token, position, table) in enumerate(zip(tokens, positions, tables, strict=True)):
            assert len(table) <= self.max_blocks, f"a table of {len(table)} blocks, buffers for {self.max_blocks}"
            host[row, 0], host[row, 1] = token, position
            host[row, 2] = table[position // block_size] * block_size + position % block_size
            host[row, 3] = position + 1
            host[row, 4 : 4 + len(table)] = torch.tensor(table)
        # Asynchronous from pinned memory on CUDA: the previous step's copy is done by now, since its
        # tokens were read back before this step was planned.
        self._device.copy_(self._host, non_blocking=True)

    def batch(self, rows: int, lora: LoRABatch | None) -> ForwardBatch:
        """A bucket's batch: views into the buffers, built once and reused by every step."""
        attention = AttentionBatch(
            slot_mapping=self.slot_mapping[:rows], decode_rows=self.rows[:rows],
            decode_block_tables=self.block_tables[:rows], decode_lens=self.seq_lens[:rows],
        )
        return ForwardBatch(input_ids=self.input_ids[:rows], positions=self.positions[:rows], attention=attention,
                            lora=lora, logits_rows=self.rows[:rows])


class StaticDecodeAttention(TorchPagedAttention):
    """SDPA over the gathered blocks with nothing kept between calls (the torch backend's reused
    gather scratch grows on the host's say-so): what a compiled or captured torch step uses."""

    def decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor:
        batch_size, num_kv_heads, head_dim = tables.shape[0], k_cache.shape[2], k_cache.shape[3]
        flat = tables.reshape(-1)
        keys = k_cache.index_select(0, flat).view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, flat).view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
        valid = torch.arange(keys.shape[2], device=q.device)[None, :] < lens[:, None]
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :], enable_gqa=True
        ).squeeze(2)


def check_capturable(model: LlamaModel) -> None:
    """A captured step reads dense weights: a model packed for the CPU GEMM (C kernels, opaque to
    the compiler) cannot be captured."""
    packed = model.packed_lm_head is not None or any(p.packed is not None for layer in model.layers
                                                     for p in layer.projections())
    if packed:
        raise ValueError("a capture-safe decode step needs the model's dense weights (load it without packing)")


def decode_tokens(
    model: LlamaModel, kv_caches: list[KVLayer], op: LoRAOp, attention: AttentionBackend, batch: ForwardBatch,
    non_finite: int = -1,
) -> torch.Tensor:
    """Greedy next tokens [rows] of one decode step (the first argmax, as the engine's greedy
    pick; `non_finite` where a row's logits have no finite maximum). Writes each row's K/V into the
    cache; reads only `batch`'s buffers."""
    x = model.embed_tokens(batch.input_ids)
    rope = model.rotary(batch.positions, x.dtype)
    for layer, kv in zip(model.layers, kv_caches, strict=True):
        x = layer(x, rope, batch, kv, op, attention)
    logits = dense.linear_float(model.norm(x), model.lm_head, None, None)
    finite = torch.isfinite(logits.amax(dim=-1))
    return torch.where(finite, logits.argmax(dim=-1), non_finite)
