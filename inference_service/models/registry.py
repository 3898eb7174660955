"""Which model class serves a checkpoint, from its config.json's `architectures` (a GGUF file's
`general.architecture` reaches here as the model_type gguf.py translates it to).

A new model family is one module in this package and one line in `MODEL_CLASSES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from adapter_cache.errors import FailedPreconditionError
from inference_service.lora.ops import LoRAOp, SlicedB
from inference_service.models.attention import AttentionBackend, KVLayer
from inference_service.models.batch import ForwardBatch
from inference_service.models.config import ModelConfig
from inference_service.models.llama import LlamaModel
from inference_service.models.qwen3 import Qwen3Model
from inference_service.models.qwen3_moe import Qwen3MoeModel


class CausalLM(Protocol):
    """What the loader and the engine use of a model."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    lora_op: LoRAOp  # set by the engine for its device before the LoRA slots are allocated
    attention: AttentionBackend
    weight_bytes_saved: int  # by weights kept quantized, against dense ones (set by pack_weights)

    def __call__(self, batch: ForwardBatch, kv_caches: list[KVLayer]) -> torch.Tensor:
        """Next-token logits [S, vocab] (fp32) of `batch.logits_rows`: `logits(hidden(...))`."""
        ...

    def hidden(self, batch: ForwardBatch, kv_caches: list[KVLayer]) -> torch.Tensor:
        """The LM head's input [S, hidden] at `batch.logits_rows` (the forward pass through the layers)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: fp32 logits [S, vocab] (the products rounded to the model's dtype)."""
        ...

    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the LM head can fuse it: per row of `logits(hidden)` its first argmax and whether its
        maximum is finite (no NaN in the row), without the logits; else None."""
        ...

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None: ...

    def pack_weights(self) -> None: ...

    def attach_lora_buffers(
        self, buffers: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[SlicedB]]]
    ) -> None: ...


ModelClass = Callable[[ModelConfig, torch.device, torch.dtype], CausalLM]

# HF architecture -> (the model_type its config.json names, the class that serves it).
MODEL_CLASSES: dict[str, tuple[str, ModelClass]] = {
    "LlamaForCausalLM": ("llama", LlamaModel),
    "MistralForCausalLM": ("mistral", LlamaModel),
    "Qwen2ForCausalLM": ("qwen2", LlamaModel),
    "Qwen3ForCausalLM": ("qwen3", Qwen3Model),
    "Qwen3MoeForCausalLM": ("qwen3_moe", Qwen3MoeModel),
}


def model_class(hf_config: Mapping[str, object]) -> ModelClass:
    """The class for a config.json. One without `architectures` (builtin:tiny, a GGUF file's
    translation) is looked up by its model_type; one with both must have them agree."""
    model_type = hf_config.get("model_type", "llama")
    architectures = hf_config.get("architectures")
    if not architectures:
        for known_type, cls in MODEL_CLASSES.values():
            if known_type == model_type:
                return cls
        raise FailedPreconditionError(f"unsupported model_type {model_type!r} (supported: {_supported()})")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise FailedPreconditionError(f"config.json must name one architecture, got {architectures!r}")
    (architecture,) = architectures
    if architecture not in MODEL_CLASSES:
        raise FailedPreconditionError(f"unsupported architecture {architecture!r} (supported: {_supported()})")
    expected_type, cls = MODEL_CLASSES[architecture]
    if model_type != expected_type:
        raise FailedPreconditionError(
            f"unsupported model_type {model_type!r}: {architecture} checkpoints are model_type {expected_type!r}")
    return cls


def _supported() -> str:
    return ", ".join(f"{arch} ({model_type})" for arch, (model_type, _) in MODEL_CLASSES.items())
