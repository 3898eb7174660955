"""Captured decode steps, one per batch-size bucket, over static buffers (models/decode_step.py).

How a bucket's step is captured is decided once, from the device:
- `cuda_graph` (CUDA): warmed up on a side stream, then captured with `torch.cuda.CUDAGraph` and
  replayed; the step's LoRA op and attention are the model's own (the Triton kernels where triton
  is installed, which launch inside a graph like any kernel);
- `compile` (CPU): `torch.compile(fullgraph=True, dynamic=False)`: one graph per bucket, no
  break (a host sync inside the step fails the compile), with torch's LoRA op and attention (the C
  kernels are opaque to the compiler);
- `eager`: the same step uncaptured (the reference the others are checked against).

Each step reads only the static buffers: the inputs here (`DecodeInputs`) and the LoRA metadata
the LoRA manager owns (`LoRAManager.step_buffers`). `run` fills both in place and replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, Protocol

import torch

from inference_service.lora.manager import LoRAManager
from inference_service.lora.ops import LoRAOp, TorchLoRAOp
from inference_service.lora.step_buffers import RowAdapter
from inference_service.models.attention import AttentionBackend, KVLayer, TritonPagedAttention
from inference_service.models.decode_step import (
    DEFAULT_BUCKETS,
    DecodeInputs,
    StaticDecodeAttention,
    bucket_for,
    check_capturable,
    decode_tokens,
)
from inference_service.models.llama import LlamaModel

log = logging.getLogger(__name__)

CaptureMode = Literal["cuda_graph", "compile", "eager"]


class CapturedStep(Protocol):
    def __call__(self) -> torch.Tensor:
        """Run the bucket's step over the current contents of the static buffers; its tokens."""
        ...


def capture_mode_for(device: torch.device) -> CaptureMode:
    """CUDA graphs on CUDA; on CPU the compiled step (which proves the step capture-safe there)."""
    return "cuda_graph" if device.type == "cuda" else "compile"


class DecodeGraphs:
    """A captured decode step per bucket, built on first use (or by `capture_all`)."""

    def __init__(
        self, model: LlamaModel, kv_caches: list[KVLayer], block_size: int, lora: LoRAManager, max_blocks: int,
        pad_slot: int, mode: CaptureMode, buckets: tuple[int, ...] = DEFAULT_BUCKETS, non_finite: int = -1,
    ) -> None:
        """`non_finite`: the token of a row whose logits have no finite maximum (the engine ends that
        request alone, as after its uncaptured greedy pick)."""
        check_capturable(model)
        self.model, self.kv_caches, self.block_size, self.lora = model, kv_caches, block_size, lora
        self.mode, self.buckets, self.non_finite = mode, tuple(sorted(buckets)), non_finite
        device = model.device
        self.inputs = DecodeInputs(self.buckets[-1], max_blocks, pad_slot, device)
        self.lora_buffers = lora.step_buffers(self.buckets[-1])
        self.op, self.attention = self._ops(model, mode)
        self._steps: dict[int, CapturedStep] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if mode == "cuda_graph" else None

    @staticmethod
    def _ops(model: LlamaModel, mode: CaptureMode) -> tuple[LoRAOp, AttentionBackend]:
        """On CUDA the model's own (no host sync in either); elsewhere torch's, which compile."""
        if mode == "cuda_graph" and isinstance(model.attention, TritonPagedAttention):
            return model.lora_op, model.attention
        if mode == "cuda_graph":
            return model.lora_op, StaticDecodeAttention()
        return TorchLoRAOp(model.device, b_rank_major=model.lora_op.b_rank_major), StaticDecodeAttention()

    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets whose step is captured so far."""
        return tuple(sorted(self._steps))

    def bucket_for(self, rows: int) -> int | None:
        return bucket_for(rows, self.buckets)

    def fits(self, rows: int, longest_table: int) -> bool:
        """Whether a decode step of `rows` rows, tables of at most `longest_table` blocks, has a bucket."""
        return self.bucket_for(rows) is not None and longest_table <= self.inputs.max_blocks

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]], adapters: list[RowAdapter]
            ) -> torch.Tensor:
        """One decode step of these rows (each sequence's newest token, its position, block table and
        adapter's pages and rank, ((), 0) for the base model): their greedy next tokens [rows], on the
        device."""
        bucket = self.bucket_for(len(tokens))
        assert bucket is not None, f"{len(tokens)} rows: no bucket holds them (largest {self.buckets[-1]})"
        self.inputs.fill(tokens, positions, tables, self.block_size)
        self.lora.fill_step_buffers(adapters)
        return self.step(bucket)()[: len(tokens)]

    def step(self, bucket: int) -> CapturedStep:
        step = self._steps.get(bucket)
        if step is None:
            start = time.perf_counter()
            step = self._steps[bucket] = self._capture(bucket)
            log.info("decode step for %d rows: %s in %.1f s", bucket, self.mode, time.perf_counter() - start)
        return step

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (a CUDA graph pool is sized by its first graph)."""
        for bucket in reversed(self.buckets):
            self.step(bucket)

    def body(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The bucket's step uncaptured: what each mode captures (and a graph-break check traces)."""
        batch = self.inputs.batch(bucket, self.lora_buffers.batch(bucket))
        model, kv, op, attention, non_finite = self.model, self.kv_caches, self.op, self.attention, self.non_finite

        def eager() -> torch.Tensor:
            return decode_tokens(model, kv, op, attention, batch, non_finite)

        return eager

    def _capture(self, bucket: int) -> CapturedStep:
        eager = self.body(bucket)
        if self.mode == "eager":
            return _no_grad(eager)
        if self.mode == "compile":
            return _no_grad(torch.compile(eager, fullgraph=True, dynamic=False))
        return _cuda_graph(eager, self._graph_pool)


def _no_grad(fn: Callable[[], torch.Tensor]) -> CapturedStep:
    def run() -> torch.Tensor:
        with torch.no_grad():
            return fn()

    return run


def _cuda_graph(fn: Callable[[], torch.Tensor], pool: object) -> CapturedStep:
    """`fn` captured in a CUDA graph: warmed up on a side stream first (lazy inits, Triton's
    compiles and autotuning happen outside the capture), then replayed; its output tensor is the
    graph's and is overwritten by the next replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        output = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay
