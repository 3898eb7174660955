"""What a model computes with, handed to it by the platform plan (inference_service/platform): its
attention backend, its fused per-token ops and how its weights are packed. The model never chooses
one itself; `PORTABLE` (torch everywhere, nothing packed) is what a model made without a plan runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_service.models.attention import AttentionBackend, TorchPagedAttention
from inference_service.models.fused_ops import TORCH_FUSED_OPS, FusedOps
from inference_service.models.linear import WeightPacking


@dataclass(frozen=True)
class ModelCompute:
    attention: AttentionBackend = field(default_factory=TorchPagedAttention)  # one per model: it keeps scratch
    fused: FusedOps = TORCH_FUSED_OPS
    packing: WeightPacking = WeightPacking()


def portable() -> ModelCompute:
    """torch's ops everywhere and no packed weights: runs on any device."""
    return ModelCompute()
