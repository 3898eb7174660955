"""The serving dtype (`--dtype auto`): on an accelerator the checkpoint's own `torch_dtype` (what it
was trained and shipped in); on CPUs bf16 where the CPU computes it natively (AVX512-BF16 / AMX) or
where the AVX2 projection kernel is preferred (AVX2 without AVX-512: bf16 weights widened as they are
read, half fp32's bytes at fp32's arithmetic; docs/performance.md, "bf16 on an AVX2-only CPU"), else
fp32 (torch's emulated bf16 is slower than fp32 there)."""

from __future__ import annotations

import json

import torch

from adapter_cache.errors import LoraplexError
from inference_service.platform.probe import CpuInfo

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def choose_dtype(requested: str, model: str, revision: str | None, device: torch.device, cpu: CpuInfo,
                 avx2_kernel: bool) -> tuple[torch.dtype, str]:
    """(dtype, why) for `--dtype requested`; `avx2_kernel`: the AVX2 projection kernel is this CPU's."""
    if requested != "auto":
        return DTYPES[requested], "--dtype"
    if device.type != "cpu":
        named = checkpoint_dtype(model, revision)
        return (named, "the checkpoint's torch_dtype") if named else (torch.float32, "the checkpoint names none")
    if cpu.native_bf16:
        return torch.bfloat16, "native bf16: AVX512-BF16 or AMX"
    if avx2_kernel:
        return torch.bfloat16, "the AVX2 kernel widens bf16 weights"
    return torch.float32, "no native bf16 and no AVX2 kernel"


def checkpoint_dtype(model: str, revision: str | None = None) -> torch.dtype | None:
    from inference_service.models.source import resolve_model

    try:
        source = resolve_model(model, revision)
    except LoraplexError:
        return None  # loading reports it
    if source.kind != "hf" or source.path is None:
        return None  # builtin:tiny; a GGUF file names no serving dtype (its weights are dequantized)
    config = source.path / "config.json"
    fields = json.loads(config.read_text())
    name = fields.get("torch_dtype") or fields.get("dtype")  # transformers 5 writes "dtype"
    return DTYPES.get(str(name).removeprefix("torch.")) if name else None
