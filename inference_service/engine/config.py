"""Engine configuration: one dataclass, filled by the CLI (inference_service/cli.py) or by tests."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from adapter_cache.errors import LoraplexError
from inference_service.limits import RequestLimits

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    # HF checkpoint dir, .gguf file (or a dir holding one), HF model id (org/name) or builtin:tiny
    model: str = "builtin:tiny"
    revision: str | None = None  # branch, tag or commit of an HF model id (default: main)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # auto | float32 | float16 | bfloat16 (the CLI defaults to auto)
    # auto | bf16 | q8_0 | q4_0: a GGUF file's projections kept quantized or dequantized to `dtype`
    # (models/quantized.py)
    weights_dtype: str = "auto"
    # The adapter pool. auto: sized by memory (lora_memory_bytes, else lora_memory_fraction of the
    # memory budget, taken before the KV cache), in pages of lora_page_rank rank rows, so an adapter
    # takes memory in proportion to its rank; N: the fixed-slot pool, N slots of max_lora_rank.
    max_loras: int | str = "auto"
    # auto: with max_loras auto the largest of 64, 32, 16 the pool holds 8 adapters of; with N slots 16
    # (engine.core.resolve_max_rank). The engine core replaces auto with the rank it chose.
    max_lora_rank: int | str = "auto"
    lora_memory_bytes: int | None = None
    # Of the memory budget: None is 0.25 on CUDA, 0.5 on CPU (docs/engine.md, "The adapter
    # pool"), less what the KV cache needs for one request of the whole context.
    lora_memory_fraction: float | None = None
    lora_page_rank: int = 8
    # Bytes of the adapter pool per tenant (the tenants file's adapter_pool_bytes): a load evicts its
    # tenant's own adapters before anyone else's once the tenant holds its share, and never those of a
    # tenant within its share (lora/pool_shares.py). Empty: one least-recently-used pool for all.
    adapter_pool_shares: dict[str, int] = field(default_factory=dict)
    block_size: int = 16  # tokens per KV block
    # Automatic prefix caching: full KV blocks are kept, keyed by their content, weights and the
    # operator's salt, and a prompt reuses the longest cached chain of them (engine.prefix_cache)
    prefix_cache: bool = True
    # LoRA slot buffers are allocated first; the KV cache gets what is left of this budget (up to
    # max_num_seqs requests of the whole context) or exactly kv_cache_bytes. None: measured once the
    # weights are loaded, 90% of the free device memory on CUDA, 25% of the available host memory
    # (MemAvailable, or the cgroup limit less usage) on CPU (engine/memory.py).
    memory_budget_bytes: int | None = None
    kv_cache_bytes: int | None = None
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # token budget per step (chunked prefill)
    max_queue: int = 1024  # waiting requests before RESOURCE_EXHAUSTED
    max_new_tokens_limit: int | None = None  # None: the context (max_model_len, within the KV cache)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    aging_steps: int = 64  # a request skipped this many steps stops later ones overtaking it
    # Fair share across tenants (engine.fair_share, the Virtual Token Counter): admission by the
    # tenants' served tokens and preemption of a tenant holding more than its share of the batch;
    # off: first come, first served (by priority). A generated token costs this many prompt tokens.
    fair_share: bool = True
    fair_share_decode_weight: float = 2.0
    # allowed URI prefixes; the local source opens files only under the file:// ones. Empty: the engine
    # confines nothing (the server refuses every URI without --adapter-source-allow)
    adapter_source_allow: tuple[str, ...] = ()
    cache_address: str | None = None  # adapter-cache sidecar; None: read file:// URIs directly
    cache_token_file: str | None = None  # bearer token for the sidecar (its --token-file)
    host_load_workers: int = 2  # threads preparing adapters on the host (never the scheduler)
    # Validated adapters read from local directories, kept in host memory (LRU) so that one evicted
    # from its slot is copied back without reading and checking it again; 0 turns this off.
    host_cache_bytes: int = 512 << 20
    # Compiled structured-output grammars kept for reuse, in bytes (engine/grammar.py)
    grammar_cache_bytes: int = 256 << 20
    overlap_loads: bool = True  # False: blocking slot copies (benchmark baseline only)
    max_registered_adapters: int = 1024  # adapter names (past it: idle resolver adapters make room, LRU)
    # A host preparation (fetch + validation) running longer fails its load (UNAVAILABLE, retryable)
    # and gives up its worker, so a hung source cannot hold the pool.
    adapter_load_timeout_s: float = 120.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    seed: int = 0  # seeds sampling for requests without a seed of their own
    # auto: the checkpoint's tokenizer.json (refused without one); byte: bytes 0-255 are tokens 0-255
    tokenizer: str = "auto"
    # on: each step runs on a device worker thread while the scheduler plans the next (vLLM's
    # --async-scheduling, SGLang's overlap scheduler); auto: on for accelerators, off on CPU, where
    # the model's threads are the cores the scheduler would overlap with
    async_scheduling: str = "auto"  # auto | on | off
    # Decode steps captured per batch-size bucket over static buffers (engine/decode_graphs.py):
    # auto: CUDA graphs on CUDA, off on CPU (there the C kernels are faster than the compiled torch
    # step, which exists to prove the step capture-safe); on: the device's capture (CPU: torch.compile)
    decode_graphs: str = "auto"  # auto | on | off
    # CUDA: the Triton LoRA kernels where triton is installed; False: torch's batched matmuls
    triton_kernels: bool = True
    # Front ends: tokens per streamed message after a request's first (its end is sent at once);
    # 1 sends each token as it comes to a client that keeps up
    stream_interval: int = 1

    def fixed_loras(self) -> int | None:
        """The fixed-slot pool's slot count (`--max-loras N`), or None for the pool sized by memory."""
        if self.max_loras == "auto":
            return None
        count = int(self.max_loras)
        if count < 1:
            raise ValueError("max_loras must be at least 1 (or auto)")
        return count

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def async_scheduling_on(self) -> bool:
        if self.async_scheduling == "auto":
            return self.torch_device().type != "cpu"
        return self.async_scheduling == "on"

    def decode_graphs_on(self) -> bool:
        if self.decode_graphs == "auto":
            return self.torch_device().type == "cuda"
        return self.decode_graphs == "on"

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        dtype = auto_dtype(self.model, self.torch_device(), self.revision)
        log.info("--dtype auto: %s on %s", str(dtype).removeprefix("torch."), self.torch_device())
        return dtype


def auto_dtype(model: str, device: torch.device, revision: str | None = None) -> torch.dtype:
    """On an accelerator the checkpoint's own `torch_dtype` (what it was trained and shipped in);
    on CPUs bf16 where the CPU computes it natively (AVX512-BF16 / AMX) or where the AVX2 projection
    kernel is preferred (AVX2 without AVX-512: bf16 weights widened as they are read, half fp32's bytes at
    fp32's arithmetic; docs/performance.md, "bf16 on an AVX2-only CPU"), else fp32 (torch's emulated
    bf16 is slower than fp32 there)."""
    if device.type != "cpu":
        return _checkpoint_dtype(model, revision) or torch.float32
    from inference_service.kernels import avx2_linear

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native or avx2_linear.preferred() else torch.float32


def _checkpoint_dtype(model: str, revision: str | None = None) -> torch.dtype | None:
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
