"""The decoder's hyperparameters, read from a Hugging Face config.json (or what a GGUF file's
metadata translates to). Which model class serves them is the registry's question (registry.py)."""

from __future__ import annotations

from dataclasses import dataclass

from adapter_cache.adapter_format import BaseModelShapes
from adapter_cache.errors import FailedPreconditionError


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Mixture of experts (0 experts: a dense MLP). Every layer's MLP is sparse when there are experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @classmethod
    def from_hf(cls, data: dict, name: str = "") -> ModelConfig:
        model_type = data.get("model_type", "llama")
        if data.get("hidden_act", "silu") != "silu":
            raise FailedPreconditionError(f"unsupported hidden_act {data.get('hidden_act')!r}")
        heads = data["num_attention_heads"]
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_pos = data.get("max_position_embeddings", 2048)
        window = data.get("sliding_window")
        if window and data.get("use_sliding_window", True):
            # Serving within the window keeps full attention exact without a windowed mask.
            max_pos = min(max_pos, window)
        attention_bias = bool(data.get("attention_bias", False))
        # transformers 5 writes `rope_parameters` (theta included); older checkpoints rope_theta/rope_scaling.
        rope = data.get("rope_parameters") or {}
        rope_scaling = data.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if (rope_scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
            raise FailedPreconditionError("partial rotary embeddings are not supported")
        num_experts = data.get("num_experts") or data.get("num_local_experts") or 0
        if num_experts and (data.get("mlp_only_layers") or data.get("decoder_sparse_step", 1) != 1):
            raise FailedPreconditionError("MoE checkpoints with dense MLP layers among the sparse ones "
                                          "(mlp_only_layers, decoder_sparse_step) are not supported")
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_layers=data["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=data.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(data.get("mlp_bias", False)),
            model_type=model_type,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            num_experts=num_experts,
            num_experts_per_tok=data.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=data.get("moe_intermediate_size", 0) if num_experts else 0,
            norm_topk_prob=bool(data.get("norm_topk_prob", False)),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def lora_shapes(self) -> BaseModelShapes:
        h, i = self.hidden_size, self.intermediate_size
        if self.num_experts:
            return self._moe_lora_shapes()
        return BaseModelShapes(
            num_layers=self.num_layers,
            features={
                "q_proj": (h, self.q_size),
                "k_proj": (h, self.kv_size),
                "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h),
                "gate_proj": (h, i),
                "up_proj": (h, i),
                "down_proj": (i, h),
            },
            # The fused projections of DecoderLayer, in its column order.
            fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        )



    def _moe_lora_shapes(self) -> BaseModelShapes:
        """Attention as in the dense model; each expert's gate/up/down as modules of their own
        (`experts.E.gate_proj`, ...), gate and up of one expert fused as the dense MLP's are."""
        h, i = self.hidden_size, self.moe_intermediate_size
        features = {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
        }
        fused: list[tuple[str, ...]] = [("q_proj", "k_proj", "v_proj")]
        for e in range(self.num_experts):
            features |= {f"experts.{e}.gate_proj": (h, i), f"experts.{e}.up_proj": (h, i),
                         f"experts.{e}.down_proj": (i, h)}
            fused.append((f"experts.{e}.gate_proj", f"experts.{e}.up_proj"))
        return BaseModelShapes(num_layers=self.num_layers, features=features, fused=tuple(fused),
                               num_experts=self.num_experts)
