"""The platform plan's choices for a model a test loads by hand (`models.loader.load_model`), as the
engine would make them: a model loaded without them runs torch's ops, nothing packed."""

from __future__ import annotations

import torch

from inference_service.engine.config import EngineConfig
from inference_service.models.compute import ModelCompute
from inference_service.platform import Platform, PlatformPlan

_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def plan_for(device: torch.device | str, dtype: torch.dtype, **settings: object) -> PlatformPlan:
    """The plan an engine on `device` serving in `dtype` would follow; `settings`: EngineConfig fields
    (kernels="off", attention_backend="torch", ...)."""
    config = EngineConfig(device=str(device), dtype=_NAMES[dtype], **settings)  # type: ignore[arg-type]
    return Platform.for_device(torch.device(device), config)


def compute_for(device: torch.device | str, dtype: torch.dtype, **settings: object) -> ModelCompute:
    """`plan_for(...).model_compute()`: what `load_model(..., compute=)` takes."""
    return plan_for(device, dtype, **settings).model_compute()
