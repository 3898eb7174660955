"""Qwen3 (dense): the LLaMA layer with an RMSNorm on each head of q and of k, before RoPE.

Everything else is LLaMA's: no attention bias (config.json's `attention_bias`, false in Qwen3's
releases), and head_dim from config.json, which in Qwen3 is not hidden_size / num_heads
(ModelConfig reads it).
"""

from __future__ import annotations

import torch

from inference_service.models.config import ModelConfig
from inference_service.models.fused_ops import FusedOps
from inference_service.models.layers import RMSNorm
from inference_service.models.llama import LlamaDecoderLayer, LlamaModel, PutWeights


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, index: int, device: torch.device, dtype: torch.dtype,
                 ops: FusedOps) -> None:
        super().__init__(config, index, device, dtype, ops)
        # One weight of head_dim each, shared by every head (as transformers' Qwen3RMSNorm).
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype, ops)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype, ops)

    def normalize_qk(self, qkv: torch.Tensor) -> None:
        """Per head, after the projection and its LoRA delta (PEFT adapts q_proj/k_proj, and the
        norm reads their output), before RoPE and the KV cache write."""
        c = self.config
        for norm, start, size in ((self.q_norm, 0, c.q_size), (self.k_norm, c.q_size, c.kv_size)):
            heads = qkv[:, start : start + size]
            heads.copy_(norm(heads.reshape(-1, c.head_dim)).view(-1, size))

    def load_hf(self, put: PutWeights, prefix: str) -> None:
        super().load_hf(put, prefix)
        put(self.q_norm.weight, f"{prefix}.self_attn.q_norm.weight")
        put(self.k_norm.weight, f"{prefix}.self_attn.k_norm.weight")


class Qwen3Model(LlamaModel):
    layer_class = Qwen3DecoderLayer
