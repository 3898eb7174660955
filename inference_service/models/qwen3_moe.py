"""Qwen3-MoE: Qwen3's attention (QK-norm) with a sparse MoE block in place of the dense MLP.

The block routes each token to its top-k experts (softmax over the router's logits in fp32, top-k,
renormalised to sum to one when config.json's `norm_topk_prob`, as transformers does), then runs the
experts grouped by expert: the (token, expert) pairs are sorted by expert and each active expert
does one matmul over all of its rows, never a loop over tokens. No shared expert (Qwen3-MoE has
none). LoRA on each expert's gate/up/down goes through the same paged pool and op as the dense
projections, with the step's adapter grouping restricted to the expert's rows (`LoRABatch.restrict`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.lora.ops import LoRABatch, LoRAOp
from inference_service.models.config import ModelConfig
from inference_service.models.fused_ops import FusedOps
from inference_service.models.layers import LoRALinear, LoRASlices, frozen_param
from inference_service.models.llama import LlamaModel, PutWeights
from inference_service.models.qwen3 import Qwen3DecoderLayer


class SparseMoE(nn.Module):
    """Top-k routed experts, each a gated MLP; base weights stacked [experts, out, in]."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, ops: FusedOps) -> None:
        super().__init__()
        self.ops = ops
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.router = frozen_param(e, h, device, dtype)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h, device=device, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i, device=device, dtype=dtype), requires_grad=False)
        self.gate_up_lora = [LoRASlices([(f"experts.{x}.gate_proj", 0, i), (f"experts.{x}.up_proj", i, 2 * i)])
                             for x in range(e)]
        self.down_lora = [LoRASlices([(f"experts.{x}.down_proj", 0, h)]) for x in range(e)]

    def lora_slices(self) -> list[LoRASlices]:
        return [*self.gate_up_lora, *self.down_lora]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]) as transformers' Qwen3MoeTopKRouter."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, op: LoRAOp, lora: LoRABatch | None) -> torch.Tensor:
        weights, experts = self.route(x)
        # Group the (token, expert) pairs by expert; a stable sort keeps each expert's rows in batch order.
        order = torch.argsort(experts.reshape(-1), stable=True)
        rows_by_expert = (order // self.top_k).split(torch.bincount(experts.reshape(-1),
                                                                    minlength=len(self.down_lora)).tolist())
        pair_weights = weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, rows in enumerate(rows_by_expert):
            if not len(rows):
                continue
            weight = pair_weights[start : start + len(rows), None]
            start += len(rows)
            rows_lora = lora.restrict(rows.tolist()) if lora is not None else None
            out.index_add_(0, rows, self._expert(expert, x.index_select(0, rows), op, rows_lora) * weight)
        return out

    def _expert(self, expert: int, x: torch.Tensor, op: LoRAOp, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up[expert])
        self.gate_up_lora[expert].apply(op, x, gate_up, lora)
        act = self.ops.silu_mul(gate_up)
        down = F.linear(act, self.down[expert])
        self.down_lora[expert].apply(op, act, down, lora)
        return down


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    feed_forward: SparseMoE

    def make_feed_forward(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                          ops: FusedOps) -> nn.Module:
        return SparseMoE(config, device, dtype, ops)

    def projections(self) -> list[LoRALinear]:
        """The dense projections (packed for the CPU GEMM); the experts' are the MoE block's."""
        return [self.qkv, self.o]

    def lora_slices(self) -> list[LoRASlices]:
        return [*super().lora_slices(), *self.feed_forward.lora_slices()]

    def load_mlp_hf(self, put: PutWeights, prefix: str) -> None:
        moe = self.feed_forward
        put(moe.router, f"{prefix}.gate.weight")
        for e in range(len(moe.down_lora)):
            put(moe.gate_up[e], f"{prefix}.experts.{e}.gate_proj.weight", f"{prefix}.experts.{e}.up_proj.weight")
            put(moe.down[e], f"{prefix}.experts.{e}.down_proj.weight")


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer
