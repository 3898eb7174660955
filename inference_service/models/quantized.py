"""Base weights kept in a GGUF quantization (`--weights-dtype`) instead of dequantized at load.

`auto` keeps each projection whose GGUF tensors are Q8_0 or Q4_0 (llama.cpp's 8- and 4-bit types) as
blocks, which a kernel reads as they are (kernels/quant_linear), and serves a matrix of another
quantized type in such a file (llama.cpp writes their LM head as Q6_K) as Q8_0; `q8_0` / `q4_0` serve every
projection in that type, quantizing (gguf-py, llama.cpp's rounding) those the file holds in another
type; `bf16` dequantizes every weight to the serving dtype (`--dtype`), as before. Quantized weights
are served on CPU only, packed for the kernel (a captured decode step reads dense weights).
Embeddings and norms stay in the serving dtype; LoRA adds its bf16/fp32 product on top of the
quantized projection's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

KEPT_TYPES = ("Q8_0", "Q4_0")  # GGUF types served as blocks
QUANTIZED_DTYPES = tuple(t.lower() for t in KEPT_TYPES)
WEIGHTS_DTYPES = ("auto", "bf16", *QUANTIZED_DTYPES)


@dataclass(frozen=True)
class QuantizedWeight:
    """A projection's weight [out_features, in_features] as GGUF blocks: uint8 [out_features,
    bytes of one row], rows in the model's (HF) order."""

    type_name: str
    blocks: np.ndarray
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [out_features, in_features] (gguf-py's dequantization)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        data = dequantize(self.blocks, GGMLQuantizationType[self.type_name])
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32).reshape(self.out_features,
                                                                                      self.in_features))

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Weights fused along the output (q/k/v, gate/up): their rows one after another."""
        first = parts[0]
        assert all(p.type_name == first.type_name and p.in_features == first.in_features for p in parts)
        if len(parts) == 1:
            return first
        return QuantizedWeight(first.type_name, np.concatenate([p.blocks for p in parts]),
                               sum(p.out_features for p in parts), first.in_features)


@runtime_checkable
class QuantizedWeights(Protocol):
    """A checkpoint that can give a projection's weight as quantized blocks (gguf.GGUFStateDict)."""

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Weight `name` as blocks, or None where it is served dense."""
        ...


def quantize_blocks(weight: np.ndarray, type_name: str) -> QuantizedWeight:
    """An fp32 weight [out, in] (in a multiple of 32) as blocks of `type_name`, rounded as llama.cpp rounds."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    blocks = quantize(np.ascontiguousarray(weight, dtype=np.float32), GGMLQuantizationType[type_name])
    return QuantizedWeight(type_name, blocks, weight.shape[0], weight.shape[1])
