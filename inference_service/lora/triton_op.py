"""`LoRAOp` on GPUs: the Triton shrink and expand (`kernels/triton_lora.py`), one shrink per fused
projection and one expand per module, each reading only the pages of the adapters in the step.

B is kept rank-major in the pages ([pages, R, out], as for the CPU kernel), so the expand reads
each rank row along contiguous output columns. Imported only where triton is (lora/backend.py).
"""

from __future__ import annotations

import torch

from inference_service.kernels import triton_lora
from inference_service.lora.ops import LoRABatch, SlicedB


class TritonLoRAOp:
    b_rank_major = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype  # products are summed in fp32 inside the kernels

    def apply(
        self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bs: list[SlicedB], batch: LoRABatch
    ) -> None:
        assert batch.runs is not None and batch.run_pages is not None
        # fp32 products of x and A rows, [T, n, the widest rank]: what each module's expand reads.
        shrunk = torch.empty(x.shape[0], len(bs), max(batch.max_rank, 1), dtype=torch.float32, device=x.device)
        triton_lora.lora_shrink(x.contiguous(), a, shrunk, batch.runs, batch.run_pages, len(bs))
        for module, s in enumerate(bs):
            triton_lora.lora_expand(shrunk, s.b, out, batch.runs, batch.run_pages, module, s.start, b_rank_major=True)
