"""ModelRunner: owns the model, the KV cache and the LoRAManager; runs one scheduled batch.

Thin on purpose: it packs a batch into tensors, runs the model and samples; everything about
adapters is the LoRAManager's, everything about admission the Scheduler's.
"""

from __future__ import annotations

import logging

import torch

from inference_service.config import EngineConfig
from inference_service.device import InlineExecutor, make_copy_engine
from inference_service.kernels import fused
from inference_service.kernels import paged_attention as cpu_kernels
from inference_service.kernels.lora import make_lora_op
from inference_service.kv_cache import KVCache, kv_bytes_per_block
from inference_service.lora.adapter import BaseModelShapes
from inference_service.lora.manager import LoRAManager
from inference_service.lora.ops import build_lora_batch
from inference_service.lora.sidecar_source import SidecarSource
from inference_service.lora.source import AdapterSource, LocalDirectorySource
from inference_service.metrics_sink import MetricsSink
from inference_service.models.llama import AttentionBatch, ForwardBatch, LlamaModel, PrefillSegment
from inference_service.request import Request
from inference_service.sampling import attach_logprobs, process_logits, sample
from inference_service.scheduler import ScheduledBatch
from inference_service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_CPU_DEFAULT_BUDGET = 256 << 20


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: Tokenizer,
        source: AdapterSource | None,
        metrics: MetricsSink,
    ) -> None:
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.device, self.dtype = model.device, model.dtype
        shapes = model.config.lora_shapes()
        budget = self._memory_budget()
        model.lora_op = make_lora_op(self.device, self.dtype)
        # LoRA slots first, then the KV cache from what is left: adapters never starve for memory.
        self.lora = LoRAManager(
            num_slots=config.max_loras,
            max_rank=config.max_lora_rank,
            shapes=shapes,
            device=self.device,
            dtype=model.lora_op.slot_dtype(self.dtype),
            source=source or self._default_source(shapes),
            copy_engine=make_copy_engine(self.device, config.overlap_loads),
            host_workers=config.host_load_workers,
            metrics=metrics,
            # Blocking mode (benchmark baseline): preparation and copy both stall the scheduler.
            host_executor=None if config.overlap_loads else InlineExecutor(),
            b_rank_major=model.lora_op.b_rank_major,
            max_registered=config.max_registered_adapters,
            load_timeout_s=config.adapter_load_timeout_s,
        )
        model.attach_lora_buffers(self.lora.pool.group_buffers)
        lora_bytes = self.lora.pool.nbytes
        kv_bytes = config.kv_cache_bytes if config.kv_cache_bytes is not None else budget - lora_bytes
        per_block = kv_bytes_per_block(model.config, config.block_size, self.dtype)
        num_blocks = kv_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"no memory left for the KV cache: budget {budget} B, LoRA slots {lora_bytes} B, "
                f"a KV block needs {per_block} B"
            )
        self.kv = KVCache(model.config, num_blocks, config.block_size, self.device, self.dtype)
        # Kernels are built (or loaded) now, not in the first request's forward pass.
        if cpu_kernels.available(self.device, self.dtype):
            log.info("decode attention: C kernel over the paged KV cache")
        if fused.available(self.device, self.dtype):
            log.info("norms, RoPE with the KV write, SiLU-and-multiply: fused C kernels")
        log.info("LoRA op: %s, slots in %s", type(model.lora_op).__name__, self.lora.pool.dtype)
        log.info(
            "memory: LoRA slots %.1f MiB (%d x rank %d), KV cache %.1f MiB (%d blocks of %d tokens)",
            lora_bytes / 2**20, config.max_loras, config.max_lora_rank, self.kv.nbytes / 2**20, num_blocks,
            config.block_size,
        )

    def _default_source(self, shapes: BaseModelShapes) -> AdapterSource:
        if self.config.cache_address:
            return SidecarSource(self.config.cache_address, shapes, self.config.max_lora_rank,
                                 token_file=self.config.cache_token_file)
        return LocalDirectorySource(shapes, self.config.max_lora_rank, self.config.host_cache_bytes,
                                    allow=self.config.adapter_source_allow)

    def _memory_budget(self) -> int:
        if self.config.memory_budget_bytes is not None:
            return self.config.memory_budget_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return _CPU_DEFAULT_BUDGET

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[str, tuple[int, torch.Tensor | None]]:
        """Forward one step; returns (next token, logits if the request asked for them) for requests
        whose chunk reached the end. The token is negative where that row could not be sampled
        (`sampling.NON_FINITE`, `SAMPLING_FAILED`): the engine ends that request alone."""
        forward, sampled = self._prepare(batch)
        # Sampling too: its reductions run on the model's threads as well (see ThreadCopyEngine).
        with self.lora.computing():
            logits = self.model(forward, self.kv.layers)
            if not sampled:
                return {}
            processed = process_logits(logits, sampled, self.tokenizer.eos_token_ids)  # return_logits: raw
            tokens = sample(processed, [r.params for r in sampled], [r.generator for r in sampled])
            attach_logprobs(processed, sampled, tokens)
        return {
            r.request_id: (t, logits[i] if r.params.return_logits else None)
            for i, (r, t) in enumerate(zip(sampled, tokens, strict=True))
        }

    def _prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[Request]]:
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        # Ordered by slot, so the LoRA op usually sees contiguous, equally long groups (no gathers).
        slotted = sorted(((self._slot(r), r, n) for r, n in batch.items), key=lambda item: item[0])
        for slot, request, num_tokens in slotted:
            start, row = request.num_computed_tokens, len(input_ids)
            end = start + num_tokens
            input_ids.extend(request.token_ids(start, end))
            positions.extend(range(start, end))
            table = request.block_table
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            token_slots.extend([slot] * num_tokens)
            if num_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSegment(row, row + num_tokens, start, self._tensor(table)))
            if end == request.num_tokens:
                logits_rows.append(row + num_tokens - 1)
                sampled.append(request)
        attention = AttentionBatch(slot_mapping=self._tensor(slot_mapping), prefills=prefills)
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            attention.decode_rows = self._tensor(decode_rows)
            attention.decode_block_tables = self._tensor(padded)
            attention.decode_lens = self._tensor(decode_lens)
        forward = ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            attention=attention,
            lora=build_lora_batch(token_slots, self.lora.pool.num_slots, self.device, self._slot_ranks(slotted)),
            logits_rows=self._tensor(logits_rows),
        )
        return forward, sampled

    def _slot_ranks(self, slotted: list[tuple[int, Request, int]]) -> dict[int, int]:
        """The rank of the adapter in each slot the batch uses, where the registry knows it."""
        versions = self.lora.registry.versions
        ranks = {}
        for slot, request, _ in slotted:
            rank = getattr(versions.get(request.adapter_uid), "rank", 0) if slot >= 0 else 0
            if rank > 0:
                ranks[slot] = rank
        return ranks

    def _slot(self, request: Request) -> int:
        if request.adapter_uid is None:
            return -1
        slot = self.lora.slot_of(request.adapter_uid)
        assert slot is not None, f"{request.request_id} scheduled before its adapter was loaded"
        return slot

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

