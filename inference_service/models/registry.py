"""Which model class serves a checkpoint, from its config.json's `architectures` (a GGUF file's
`general.architecture` reaches here as the model_type gguf.py translates it to).

A new model family is one module in this package and one line in `MODEL_CLASSES`, which also declares
whether the engine's decode fast path (models/decode_stack.py: LLaMA's layer in C) serves it, and if
not why (the platform plan shows the reason).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from adapter_cache.errors import FailedPreconditionError
from inference_service.lora.ops import LoRAOp, SlicedB
from inference_service.models.attention import AttentionBackend, KVLayer
from inference_service.models.batch import ForwardBatch
from inference_service.models.compute import ModelCompute
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


ModelClass = Callable[[ModelConfig, torch.device, torch.dtype, ModelCompute], CausalLM]


@dataclass(frozen=True)
class Family:
    model_type: str  # what its config.json names
    model_class: ModelClass
    # Why the decode stack (LLaMA's layer in C, kernels/decode_stack.c) cannot run this family's
    # layers; None: it runs them.
    no_decode_stack: str | None = None


_QK_NORM = "QK-norm (an RMSNorm per head of q and k) is not in the C decode stack"
# HF architecture -> its family.
MODEL_CLASSES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", LlamaModel),
    "MistralForCausalLM": Family("mistral", LlamaModel),
    "Qwen2ForCausalLM": Family("qwen2", LlamaModel),
    "Qwen3ForCausalLM": Family("qwen3", Qwen3Model, no_decode_stack=_QK_NORM),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", Qwen3MoeModel,
                                  no_decode_stack=f"{_QK_NORM}, nor is the sparse MoE block"),
}


def family(model_type: str) -> Family:
    """The family of a loaded model (`ModelConfig.model_type`)."""
    for known in MODEL_CLASSES.values():
        if known.model_type == model_type:
            return known
    raise FailedPreconditionError(f"unsupported model_type {model_type!r} (supported: {_supported()})")


def model_class(hf_config: Mapping[str, object]) -> ModelClass:
    """The class for a config.json (its `family`'s). One without `architectures` (builtin:tiny, a GGUF file's
    translation) is looked up by its model_type; one with both must have them agree."""
    model_type = hf_config.get("model_type", "llama")
    architectures = hf_config.get("architectures")
    if not architectures:
        return family(str(model_type)).model_class
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise FailedPreconditionError(f"config.json must name one architecture, got {architectures!r}")
    (architecture,) = architectures
    if architecture not in MODEL_CLASSES:
        raise FailedPreconditionError(f"unsupported architecture {architecture!r} (supported: {_supported()})")
    known = MODEL_CLASSES[architecture]
    if model_type != known.model_type:
        raise FailedPreconditionError(
            f"unsupported model_type {model_type!r}: {architecture} checkpoints are model_type {known.model_type!r}")
    return known.model_class


def _supported() -> str:
    return ", ".join(f"{arch} ({known.model_type})" for arch, known in MODEL_CLASSES.items())
