"""LLaMA-family decoder (Llama 2/3, Mistral, Qwen2) over a flat token batch with paged KV and LoRA.

One forward runs a whole scheduler step: prefill chunks and decode tokens of many requests,
packed into one [T] token batch (batch.py). Families that differ from LLaMA in a step of the layer
subclass `LlamaDecoderLayer` and override that step (qwen3.py: norms on q and k).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol

import torch
from torch import nn

from adapter_cache.errors import FailedPreconditionError
from inference_service.kernels.hugepages import Arena
from inference_service.lora.ops import LoRAOp, SlicedB, TorchLoRAOp
from inference_service.models import linear as dense
from inference_service.models.attention import AttentionBackend, KVLayer
from inference_service.models.batch import ForwardBatch
from inference_service.models.compute import ModelCompute, portable
from inference_service.models.config import ModelConfig
from inference_service.models.fused_ops import FusedOps
from inference_service.models.layers import (
    GatedMLP,
    LoRALinear,
    LoRASlices,
    RMSNorm,
    RotaryEmbedding,
    apply_rope,
    frozen_param,
)
from inference_service.models.quantized import QuantizedWeight, QuantizedWeights


class PutWeights(Protocol):
    def __call__(self, dst: torch.Tensor, *names: str) -> None:
        """Copy the named HF checkpoint weights (concatenated along the output) into `dst`."""
        ...


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, device: torch.device, dtype: torch.dtype,
                 ops: FusedOps) -> None:
        super().__init__()
        c = config
        self.config, self.index, self.ops = c, index, ops
        h, q, kv = c.hidden_size, c.q_size, c.kv_size
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, device, dtype, ops)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, device, dtype, ops)
        self.qkv = LoRALinear(h, [("q_proj", q), ("k_proj", kv), ("v_proj", kv)], c.qkv_bias, device, dtype)
        self.o = LoRALinear(q, [("o_proj", h)], c.o_bias, device, dtype)
        # "feed_forward" (Meta's own name) sorts where the flat gate_up/down weights did before it
        # existed, so builtin:tiny's seeded weights, drawn in name order, are unchanged.
        self.feed_forward = self.make_feed_forward(c, device, dtype, ops)

    def make_feed_forward(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                          ops: FusedOps) -> nn.Module:
        """The MLP after attention: forward(x, op, lora) -> [T, hidden]. LLaMA's is gated and dense."""
        return GatedMLP(config, device, dtype, ops)

    def projections(self) -> list[LoRALinear]:
        return [self.qkv, self.o, self.feed_forward.gate_up, self.feed_forward.down]

    def lora_slices(self) -> list[LoRASlices]:
        return [p.lora for p in self.projections()]

    def pack_weights(self, packing: dense.WeightPacking, arena: Arena | None = None) -> None:
        for projection in self.projections():
            projection.pack(packing, arena)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVLayer,
        op: LoRAOp,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        residual = x
        x = self.input_layernorm(x)
        attn = self.self_attention(x, rope, batch, kv, op, attention)
        out = self.o(attn, op, batch.lora)
        residual, x = self.post_attention_layernorm.add_and_norm(residual, out)
        return residual + self.feed_forward(x, op, batch.lora)

    def self_attention(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: KVLayer,
        op: LoRAOp,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """Self-attention's output before o_proj, [T, Hq * D]."""
        c = self.config
        qkv = self.qkv(x, op, batch.lora)
        self.normalize_qk(qkv)
        k_cache, v_cache = kv
        # With the C ops one kernel rotates q and k in place and writes k and v to the cache.
        cached = self.ops.rope_and_cache(qkv, c.num_heads, c.num_kv_heads, c.head_dim, *rope,
                                      batch.attention.slot_mapping, k_cache, v_cache)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, k, v = (t.reshape(-1, heads, c.head_dim) for t, heads in ((q, c.num_heads), (k, c.num_kv_heads),
                                                                      (v, c.num_kv_heads)))
        if not cached:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return attention.forward(q, k, v, kv, batch.attention, cached).reshape(-1, c.q_size)

    def normalize_qk(self, qkv: torch.Tensor) -> None:
        """Between the projection and RoPE, in place on the fused [T, q | k | v]: nothing in LLaMA."""

    def load_hf(self, put: PutWeights, prefix: str) -> None:
        """Take this layer's weights from a checkpoint with HF names under `prefix` (model.layers.N)."""
        put(self.input_layernorm.weight, f"{prefix}.input_layernorm.weight")
        put(self.post_attention_layernorm.weight, f"{prefix}.post_attention_layernorm.weight")
        attention = [f"{prefix}.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]
        for projection, modules in ((self.qkv, attention), (self.o, [f"{prefix}.self_attn.o_proj"])):
            put_projection(put, projection, modules)
        self.load_mlp_hf(put, f"{prefix}.mlp")

    def load_mlp_hf(self, put: PutWeights, prefix: str) -> None:
        """The MLP's weights, under `prefix` (model.layers.N.mlp)."""
        put_projection(put, self.feed_forward.gate_up, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        put_projection(put, self.feed_forward.down, [f"{prefix}.down_proj"])


def put_projection(put: PutWeights, projection: LoRALinear, modules: list[str]) -> None:
    """A fused projection's weight (and bias) from its HF modules, concatenated in column order."""
    put(projection.weight, *(f"{m}.weight" for m in modules))
    if projection.bias is not None:
        put(projection.bias, *(f"{m}.bias" for m in modules))


class LlamaModel(nn.Module):
    layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 compute: ModelCompute | None = None) -> None:
        """`compute`: the attention backend, fused ops and weight packing the platform plan chose
        (inference_service/platform); without one, torch's everywhere."""
        super().__init__()
        self.config, self.device, self.dtype = config, device, dtype
        self.compute = compute = compute or portable()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.layer_class(config, i, device, dtype, compute.fused)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype, compute.fused)
        self.lm_head = frozen_param(config.vocab_size, config.hidden_size, device, dtype)
        self.rotary = RotaryEmbedding(config, device)
        self.lora_op: LoRAOp = TorchLoRAOp(device)  # the engine picks the op for its device
        self.attention: AttentionBackend = compute.attention
        self.packed_lm_head: dense.PackedWeight | None = None
        self.quantized_lm_head: QuantizedWeight | None = None  # kept quantized by the loader until packed
        # Bytes the quantized weights' kernel copies save against dense ones (models/quantized.py).
        self.weight_bytes_saved = 0

    def pack_weights(self) -> None:
        """Once the weights are in: quantized weights into their kernels' layout, then the dense
        projections prepacked for the CPU GEMM (no-op elsewhere), the AMX copies into one arena on
        2 MiB pages."""
        projections = [p for layer in self.layers for p in layer.projections()]
        packing = self.compute.packing
        kept = [w for w in (self.quantized_lm_head, *(p.quantized for p in projections)) if w is not None]
        quantized_arena = packing.quantized_arena_for(kept, self.dtype)
        saved = sum(p.pack_quantized(packing, quantized_arena) for p in projections)
        if self.quantized_lm_head is not None:
            quantized, self.quantized_lm_head = self.quantized_lm_head, None
            packed = packing.pack_quantized(quantized, self.dtype, quantized_arena)
            if packed is None:
                self.lm_head.data = quantized.dequantize().to(self.dtype)
            else:
                self.packed_lm_head = packed
                saved += quantized.out_features * quantized.in_features * self.dtype.itemsize - packed.nbytes
        self.weight_bytes_saved = saved
        lm_head = [self.lm_head.data] if self.packed_lm_head is None else []
        arena = packing.arena_for([*lm_head, *(p.weight.data for p in projections if p.packed is None)])
        if self.packed_lm_head is None:
            self.packed_lm_head = packing.pack(self.lm_head.data, arena)
            if self.packed_lm_head is not None:
                self.lm_head.data = self.lm_head.data.new_empty(0)
        for layer in self.layers:
            layer.pack_weights(packing, arena)

    def attach_lora_buffers(
        self, buffers: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[SlicedB]]]
    ) -> None:
        """Point every fused projection at its group's slot buffers (owned by the LoRA memory pool)."""
        for layer in self.layers:
            for slices in layer.lora_slices():
                slices.buffers = buffers[(layer.index, slices.modules)]

    def forward(self, batch: ForwardBatch, kv_caches: list[KVLayer]) -> torch.Tensor:
        return self.logits(self.hidden(batch, kv_caches))

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, kv_caches: list[KVLayer]) -> torch.Tensor:
        """The final norm's output [S, hidden] at `batch.logits_rows` (what the LM head reads)."""
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, batch, kv, self.lora_op, self.attention)
        return self.norm(x.index_select(0, batch.logits_rows))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return dense.linear_float(hidden, self.lm_head, None, self.packed_lm_head)

    @torch.inference_mode()
    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return dense.greedy_pick(hidden, None, self.packed_lm_head)

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Missing or extra weights are errors."""
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise FailedPreconditionError(f"checkpoint is missing weight {name}")
            used.add(name)
            return tensors[name]

        # Projections the checkpoint keeps quantized (a GGUF file served with --weights-dtype auto, q8_0
        # or q4_0) take its blocks instead of a dense copy: by the parameter each would fill. A fused
        # projection whose parts differ in type (a mixed file) is served dense.
        quantized = tensors.quantized if isinstance(tensors, QuantizedWeights) else None
        projections = {id(p.weight): p for layer in self.layers for p in layer.projections()}

        def put(dst: torch.Tensor, *names: str) -> None:
            if quantized is not None and (id(dst) in projections or dst is self.lm_head) and all(
                    n in tensors for n in names):
                parts = [part for part in (quantized(n) for n in names) if part is not None]
                if len(parts) == len(names) and len({part.type_name for part in parts}) == 1:
                    used.update(names)
                    weight = QuantizedWeight.concat(parts)
                    if dst is self.lm_head:
                        self.quantized_lm_head = weight
                        self.lm_head.data = self.lm_head.data.new_empty(0)
                    else:
                        projections[id(dst)].set_quantized(weight)
                    return
            dst.copy_(torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0]))

        with torch.no_grad():
            put(self.embed_tokens.weight, "model.embed_tokens.weight")
            put(self.norm.weight, "model.norm.weight")
            lm_head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
            put(self.lm_head, lm_head)
            for layer in self.layers:
                layer.load_hf(put, f"model.layers.{layer.index}")
        unused = set(tensors) - used - {"lm_head.weight"}
        unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
        if unused:
            raise FailedPreconditionError(f"checkpoint has weights this model does not use: {sorted(unused)[:5]}")
