"""A LLaMA stack's decode step in one C call (`kernels/decode_stack.c`), where every kernel it needs runs.

The layer forward in llama.py makes about a dozen calls into C and torch per layer; in a batch-32
decode step on SmolLM2 the Python between them held the main thread for ~5 of ~25 ms while the other
core waited. `DecodeStack.run` hands the whole step to C, which calls the very kernels the layer
forward calls, in the same order, so the result is bit-identical (tests/test_decode_stack.py).

It is the engine's fast path, not the model's: the platform plan turns it on (`--decode-stack`, and
only for a family whose layers are LLaMA's, as models/registry.py declares), the model runner builds
it and asks it first each step, and the model knows nothing of it. Where it applies (`build` checks
once, `hidden` per step; otherwise the runner takes the model's layer forward):
- on CPU, every projection on one packed kernel that C can call (AMX's or AVX-512 BF16's, in bf16;
  AVX2's or Q8_0/Q4_0's, in bf16 or fp32), the C fused per-token ops and the C decode attention built
  for the model's dtype, and the C LoRA op (or no adapters in the step);
- batches of decodes alone (a prefill's attention is torch's SDPA).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_service.kernels import amx_linear, avx2_linear, bf16_linear, fused, quant_linear
from inference_service.kernels import paged_attention as attention_kernels
from inference_service.kernels.bindings import CFunction, function
from inference_service.lora.backend import CpuLoRAOp
from inference_service.models.attention import CpuPagedAttention, KVLayer
from inference_service.models.batch import ForwardBatch
from inference_service.models.fused_ops import CFusedOps
from inference_service.models.layers import LoRALinear
from inference_service.models.llama import LlamaModel

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


# kernels.h's DecodeKernels, DecodeProjection, DecodeLayer and DecodeStep, field for field (the layouts
# are compared in tests/test_kernel_build.py).
class _Kernels(ctypes.Structure):
    _fields_ = [("linear", _P), ("add_rms_norm", _P), ("rope_and_cache", _P), ("silu_mul", _P),
                ("attention", _P), ("lora", _P)]


class _Projection(ctypes.Structure):
    _fields_ = [("weight", _P), ("bias", _P), ("out_features", _I64), ("in_features", _I64), ("lora_a", _P),
                ("lora_b", _P), ("lora_cols", _P), ("lora_modules", _I64), ("lora_page_rank", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_attention_norm", _P), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("k_cache", _P), ("v_cache", _P)]


class _Step(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("element_size", "rows", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate",
                                    "block_size", "max_blocks")),
        ("eps", _F32), ("scale", _F32),
        *((name, _P) for name in ("cos", "sin", "final_norm", "slot_mapping", "block_tables", "context_lens",
                                  "lora_runs", "lora_run_pages")),
        ("lora_num_runs", _I64), ("lora_max_rank", _I64), ("lora_scratch", _P),
        *((name, _P) for name in ("normed", "qkv", "q", "attn", "delta", "gate_up", "act")),
        ("op_seconds", _P),
    ]


# What `DecodeStack.profile` adds time to (decode_stack.c's enum, same order).
OPS = ("input add + RMS norm", "qkv", "qkv LoRA", "RoPE + KV write", "attention", "o", "o LoRA",
       "post-attention add + RMS norm", "gate_up", "gate_up LoRA", "SiLU x mul", "down", "down LoRA")


_ACTIVATIONS = ("normed", "qkv", "q", "attn", "delta", "gate_up", "act")


@dataclass
class _Layers:
    """The layer table for one set of KV caches and LoRA buffers, and what its pointers point into."""

    kv_caches: Sequence[KVLayer]
    table: ctypes.Array | None  # None: these caches or buffers are not the kernels' (layer forward)
    keep_alive: list[object]
    lora_modules: int = 0  # the most modules of one projection with LoRA (the LoRA scratch's width / rank)


class DecodeStack:
    """Runs `model`'s decode steps in C; `build` gives None where it cannot."""

    def __init__(self, model: LlamaModel, kernels: _Kernels, run_fn: ctypes._CFuncPtr) -> None:  # type: ignore[name-defined]
        self.model, self.kernels, self._run_fn = model, kernels, run_fn
        self.lora_op = model.lora_op
        self._layers: _Layers | None = None
        c = model.config
        # Widths of the activations (_ACTIVATIONS' order), each [rows, width] in one workspace.
        self._widths = (c.hidden_size, c.q_size + 2 * c.kv_size, c.q_size, c.q_size, c.hidden_size,
                        2 * c.intermediate_size, c.intermediate_size)
        self._workspace = torch.empty(0, dtype=model.dtype)
        self._lora_scratch = torch.empty(0, dtype=torch.float32)
        # Seconds per op (OPS) added up over the steps run while set (bench/decode_profile.py).
        self.profile: torch.Tensor | None = None

    @classmethod
    def build(cls, model: LlamaModel) -> DecodeStack | None:
        run_fn = _run_function()
        if run_fn is None or model.device.type != "cpu":
            return None
        projections = [p for layer in model.layers for p in layer.projections()]
        if all(isinstance(p.packed, amx_linear.AMXWeight) for p in projections):
            linear = amx_linear.kernel_address()
        elif all(isinstance(p.packed, bf16_linear.BF16Weight) for p in projections):
            linear = bf16_linear.kernel_address()
        elif all(isinstance(p.packed, avx2_linear.AVX2Weight) for p in projections):
            linear = avx2_linear.kernel_address(model.dtype)
        elif all(isinstance(p.packed, quant_linear.QuantWeight) for p in projections) and len(
                types := {getattr(p.packed, "type_name", None) for p in projections}) == 1:
            linear = quant_linear.kernel_address(str(types.pop()), model.dtype)  # one kernel for every layer
        else:
            return None
        if not isinstance(model.compute.fused, CFusedOps) or not isinstance(model.attention, CpuPagedAttention):
            return None
        norm, rope, silu = (fused.kernel_address(name, model.dtype) for name in ("add_rms_norm", "rope_and_cache",
                                                                                 "silu_mul"))
        if linear is None or norm is None or rope is None or silu is None:
            return None
        kernels = _Kernels(linear=linear, add_rms_norm=norm, rope_and_cache=rope, silu_mul=silu, attention=None,
                           lora=_lora_kernel(model.lora_op))
        return cls(model, kernels, run_fn)

    def hidden(self, batch: ForwardBatch, kv_caches: Sequence[KVLayer]) -> torch.Tensor | None:
        """What `model.hidden` gives (the final norm's output at `batch.logits_rows`) for a batch of
        decodes the stack can run, or None: the caller runs the layer forward."""
        if self.model.lora_op is not self.lora_op:  # replaced (a benchmark's baseline): its kernel, its layouts
            self.lora_op, self.kernels.lora, self._layers = self.model.lora_op, _lora_kernel(self.model.lora_op), None
        att = batch.attention
        if att.prefills or att.decode_rows is None or att.decode_rows.shape[0] != batch.input_ids.shape[0]:
            return None
        x = self.model.embed_tokens(batch.input_ids)
        rope = self.model.rotary(batch.positions, x.dtype)
        normed = self.run(x, rope, batch, kv_caches)
        return None if normed is None else normed.index_select(0, batch.logits_rows)  # the norm is per row

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
            kv_caches: Sequence[KVLayer]) -> torch.Tensor | None:
        """The final norm of the stack's output [T, hidden] for a decode-only batch (x, the embeddings,
        is overwritten with the last layer's output), or None where the layer forward must run."""
        att, lora = batch.attention, batch.lora
        if att.prefills or att.decode_rows is None or att.decode_rows.shape[0] != x.shape[0] or not x.shape[0]:
            return None
        if lora is not None and (self.kernels.lora is None or lora.runs is None or lora.run_pages is None):
            return None
        tables, lens = att.decode_block_tables, att.decode_lens
        assert tables is not None and lens is not None  # set together with decode_rows
        cos, sin = rope
        indices = (att.slot_mapping, tables, lens)
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in indices) or not (
            x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and cos.dtype == x.dtype
        ):
            return None
        if self._layers is None or self._layers.kv_caches is not kv_caches:
            self._layers = self._build_layers(kv_caches)
        table = self._layers.table
        if table is None:
            return None
        c, rows = self.model.config, x.shape[0]
        needed = rows * sum(self._widths)
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed * 5 // 4, dtype=self.model.dtype)  # headroom: batches vary
        base, element_size = self._workspace.data_ptr(), self._workspace.element_size()
        offsets, at = {}, 0
        for name, width in zip(_ACTIVATIONS, self._widths, strict=True):
            offsets[name] = base + element_size * at
            at += rows * width
        max_rank = lora.max_rank if lora is not None else 0
        scratch = rows * self._layers.lora_modules * max_rank  # the kernel's y [rows, modules x rank]
        if self._lora_scratch.numel() < scratch:
            self._lora_scratch = torch.empty(scratch * 5 // 4, dtype=torch.float32)
        _, block_size, _, _ = kv_caches[0][0].shape
        step = _Step(
            element_size=element_size, rows=rows, hidden=c.hidden_size, q_heads=c.num_heads,
            kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            intermediate=c.intermediate_size, block_size=block_size, max_blocks=tables.shape[1],
            eps=c.rms_norm_eps, scale=c.head_dim**-0.5, cos=cos.data_ptr(), sin=sin.data_ptr(),
            final_norm=self.model.norm.weight.data_ptr(), slot_mapping=att.slot_mapping.data_ptr(),
            block_tables=tables.data_ptr(), context_lens=lens.data_ptr(),
            lora_runs=None if lora is None else lora.runs.data_ptr(),  # type: ignore[union-attr]
            lora_run_pages=None if lora is None else lora.run_pages.data_ptr(),  # type: ignore[union-attr]
            lora_num_runs=0 if lora is None else lora.runs.shape[0],  # type: ignore[union-attr]
            lora_max_rank=max_rank, lora_scratch=self._lora_scratch.data_ptr(), **offsets,
            op_seconds=None if self.profile is None else self.profile.data_ptr(),
        )
        out = torch.empty_like(x)
        status = self._run_fn(ctypes.byref(self.kernels), table, len(table), ctypes.byref(step),
                              x.data_ptr(), out.data_ptr())
        if status != 0:
            raise MemoryError("decode stack: a kernel could not allocate its scratch buffers")
        return out

    def _build_layers(self, kv_caches: Sequence[KVLayer]) -> _Layers:
        c = self.model.config
        k_cache = kv_caches[0][0]
        unusable = _Layers(kv_caches, None, [])
        if k_cache.dtype != self.model.dtype or not all(k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return unusable
        attention = attention_kernels.kernel_address(self.model.dtype, c.num_heads, c.num_kv_heads, c.head_dim,
                                                     k_cache.shape[1])
        if attention is None:
            return unusable
        self.kernels.attention = attention
        keep_alive: list[object] = []
        table = (_Layer * len(self.model.layers))()
        for entry, layer, (k, v) in zip(table, self.model.layers, kv_caches, strict=True):
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, projection in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.feed_forward.gate_up),
                                     ("down", layer.feed_forward.down)):
                if not self._describe(getattr(entry, name), projection, keep_alive):
                    return unusable
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        modules = max((p.lora_modules for entry in table for p in (entry.qkv, entry.o, entry.gate_up, entry.down)
                       if p.lora_a), default=0)
        return _Layers(kv_caches, table, keep_alive, modules)

    def _describe(self, entry: _Projection, projection: LoRALinear, keep_alive: list[object]) -> bool:
        packed = projection.packed
        assert isinstance(packed, amx_linear.AMXWeight | bf16_linear.BF16Weight | avx2_linear.AVX2Weight
                          | quant_linear.QuantWeight)  # build()
        bias = projection.bias
        if bias is not None:
            if bias.dtype != self.model.dtype:
                return False
            bias = bias.data.contiguous()
            keep_alive.append(bias)
        entry.weight, entry.bias = packed.storage.data_ptr(), None if bias is None else bias.data_ptr()
        entry.out_features, entry.in_features = packed.out_features, packed.in_features
        buffers = projection.lora.buffers
        entry.lora_a = None
        if buffers is None or self.kernels.lora is None:  # no C LoRA op: `run` takes base-only steps
            return True
        a, bs = buffers
        assert isinstance(self.lora_op, CpuLoRAOp)
        if a.dtype != self.model.dtype or not a.is_contiguous():
            return False
        pointers, cols = self.lora_op.layout(a, bs)
        keep_alive.extend((pointers, cols))
        entry.lora_a, entry.lora_b, entry.lora_cols = a.data_ptr(), ctypes.addressof(pointers), cols.data_ptr()
        entry.lora_modules, entry.lora_page_rank = len(bs), a.shape[1] // len(bs)
        return True


def _run_function() -> CFunction | None:
    return function("decode_stack", "decode_stack")


def _lora_kernel(op: object) -> int | None:
    """The C LoRA op's kernel, which C can call; None for another op (the stack then takes base-model steps)."""
    return op.kernel_address if isinstance(op, CpuLoRAOp) else None
