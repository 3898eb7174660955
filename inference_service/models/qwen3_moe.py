"""Qwen3-MoE: Qwen3's attention (QK-norm) with a sparse MoE block in place of the dense MLP.

The block routes each token to its top-k experts (softmax over the router's logits in fp32, top-k,
renormalised to sum to one when config.json's `norm_topk_prob`, as transformers does), then runs the
experts grouped by expert: the (token, expert) pairs are sorted by expert and each active expert
does one matmul over all of its rows, never a loop over tokens. No shared expert (Qwen3-MoE has
none). LoRA on every expert's gate/up/down is one op per projection over all the pairs: the pool
stacks the experts' pages (lora/mem_pool.py) and the LoRA manager's `ExpertStepBuffers` give each
pair its token's adapter pages on its expert, written in place on the device
(lora/step_buffers.py). The per-expert row counts are read on the host once per layer (the base
matmuls' sizes), so the layer runs uncaptured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.lora.ops import LoRABatch, LoRAOp
from inference_service.lora.step_buffers import ExpertStepBuffers
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
        self.num_experts, self.top_k, self.norm_topk_prob = e, config.num_experts_per_tok, config.norm_topk_prob
        self.router = frozen_param(e, h, device, dtype)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h, device=device, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i, device=device, dtype=dtype), requires_grad=False)
        # Every expert's LoRA in one stacked pool buffer per projection (lora/mem_pool.py).
        self.gate_up_lora = LoRASlices([("experts.gate_proj", 0, i), ("experts.up_proj", i, 2 * i)])
        self.down_lora = LoRASlices([("experts.down_proj", 0, h)])
        self.expert_lora: ExpertStepBuffers | None = None  # the LoRA manager's, set by attach_expert_buffers

    def lora_slices(self) -> list[LoRASlices]:
        return [self.gate_up_lora, self.down_lora]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]) as transformers' Qwen3MoeTopKRouter."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, op: LoRAOp, lora: LoRABatch | None) -> torch.Tensor:
        weights, experts = self.route(x)
        # The (token, expert) pairs sorted by expert (stable: each expert's rows in batch order).
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_pair, expert_of_pair = order // self.top_k, flat.index_select(0, order)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one host read of the layer
        pair_lora = None
        if lora is not None and self.gate_up_lora.buffers is not None:
            assert self.expert_lora is not None, "attach_expert_buffers before serving adapters"
            pair_lora = self.expert_lora.group(lora, token_of_pair, expert_of_pair)
        xs = x.index_select(0, token_of_pair)
        gate_up = self._grouped(xs, self.gate_up, counts)
        self.gate_up_lora.apply(op, xs, gate_up, pair_lora)
        act = self.ops.silu_mul(gate_up)
        down = self._grouped(act, self.down, counts)
        self.down_lora.apply(op, act, down, pair_lora)
        # Back to (token, k) order by a gather (a scatter-add into the tokens ran 30% of a decode step),
        # then each token's k experts weighted and summed.
        by_token = down.index_select(0, torch.argsort(order)).view(x.shape[0], self.top_k, -1)
        return torch.bmm(weights.unsqueeze(1), by_token).squeeze(1)

    @staticmethod
    def _grouped(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x's rows (grouped by expert, `counts` each) times their expert's weight: one matmul per expert
        that has rows, written into one output."""
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                torch.mm(x[start : start + count], weight[expert].t(), out=out[start : start + count])
                start += count
        return out


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
        for e in range(moe.num_experts):
            put(moe.gate_up[e], f"{prefix}.experts.{e}.gate_proj.weight", f"{prefix}.experts.{e}.up_proj.weight")
            put(moe.down[e], f"{prefix}.experts.{e}.down_proj.weight")


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer

    def attach_expert_buffers(self, buffers: ExpertStepBuffers) -> None:
        """Point every MoE layer at the LoRA manager's expert grouping buffers."""
        for layer in self.layers:
            layer.feed_forward.expert_lora = buffers
