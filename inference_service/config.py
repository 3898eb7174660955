"""Engine configuration: one dataclass, filled by the CLI (inference_service/cli.py) or by tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str = "builtin:tiny"  # HF checkpoint dir or builtin:tiny
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | float16 | bfloat16
    max_loras: int = 4  # LoRA slots on the device
    max_lora_rank: int = 16
    block_size: int = 16  # tokens per KV block
    # LoRA slot buffers are allocated first; the KV cache gets what is left of this budget
    # (None: on CUDA 90% of free memory after weights, on CPU 256 MiB) or exactly kv_cache_bytes.
    memory_budget_bytes: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # token budget per step (chunked prefill)
    max_queue: int = 1024  # waiting requests before RESOURCE_EXHAUSTED
    max_new_tokens_limit: int = 4096
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    aging_steps: int = 64  # a request skipped this many steps stops later ones overtaking it
    cache_address: str | None = None  # adapter-cache sidecar; None: read file:// URIs directly
    host_load_workers: int = 2  # threads preparing adapters on the host (never the scheduler)
    # Validated adapters read from local directories, kept in host memory (LRU) so that one evicted
    # from its slot is copied back without reading and checking it again; 0 turns this off.
    host_cache_bytes: int = 512 << 20
    overlap_loads: bool = True  # False: blocking slot copies (benchmark baseline only)
    seed: int = 0  # seeds sampling for requests without a seed of their own

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[self.dtype]
