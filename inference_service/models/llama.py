"""LLaMA-family decoder (Llama 2/3, Mistral, Qwen2) over a flat token batch with paged KV and LoRA.

One forward runs a whole scheduler step: prefill chunks and decode tokens of many requests,
packed into one [T] token batch. Base projections are fused (qkv, gate+up) for fewer matmuls;
LoRA deltas are added per target module into slices of the fused outputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from adapter_cache.adapter_format import BaseModelShapes
from adapter_cache.errors import FailedPreconditionError
from inference_service.kernels import fused
from inference_service.kernels import paged_attention as cpu_kernels
from inference_service.lora.ops import LoRABatch, LoRAOp, SlicedB, TorchLoRAOp
from inference_service.models import linear as dense

_SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    @classmethod
    def from_hf(cls, data: dict, name: str = "") -> ModelConfig:
        model_type = data.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise FailedPreconditionError(f"unsupported model_type {model_type!r}")
        if data.get("hidden_act", "silu") != "silu":
            raise FailedPreconditionError(f"unsupported hidden_act {data.get('hidden_act')!r}")
        heads = data["num_attention_heads"]
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        max_pos = data.get("max_position_embeddings", 2048)
        window = data.get("sliding_window")
        if window and data.get("use_sliding_window", True):
            # Serving within the window keeps full attention exact without a windowed mask.
            max_pos = min(max_pos, window)
        attention_bias = bool(data.get("attention_bias", False))
        # transformers 5 writes `rope_parameters` (theta included); older checkpoints rope_theta/rope_scaling.
        rope = data.get("rope_parameters") or {}
        rope_scaling = data.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if (rope_scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
            raise FailedPreconditionError("partial rotary embeddings are not supported")
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_layers=data["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or data["hidden_size"] // heads,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            rope_theta=data.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(data.get("mlp_bias", False)),
            model_type=model_type,
            bos_token_id=data.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def lora_shapes(self) -> BaseModelShapes:
        h, i = self.hidden_size, self.intermediate_size
        return BaseModelShapes(
            num_layers=self.num_layers,
            features={
                "q_proj": (h, self.q_size),
                "k_proj": (h, self.kv_size),
                "v_proj": (h, self.kv_size),
                "o_proj": (self.q_size, h),
                "gate_proj": (h, i),
                "up_proj": (h, i),
                "down_proj": (i, h),
            },
            # The fused projections of DecoderLayer, in its column order.
            fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
        )


@dataclass
class PrefillSegment:
    """One request's prefill chunk: rows [start, end) of the batch, on top of `num_computed` cached."""

    start: int
    end: int
    num_computed: int
    block_table: torch.Tensor  # [n_blocks] covering num_computed + (end - start) tokens


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] flat KV position where each token's K/V is written
    decode_rows: torch.Tensor | None = None  # [Bd] batch rows of single-token (decode) requests
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None = None  # [Bd] context length of each decode row (incl. its token)
    prefills: list[PrefillSegment] = field(default_factory=list)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionBatch
    lora: LoRABatch | None
    logits_rows: torch.Tensor  # [S] rows whose next-token logits are needed


class RotaryEmbedding(nn.Module):
    """RoPE with HF's rotate-half convention; linear and Llama-3 frequency scaling."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = config.rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise FailedPreconditionError(f"unsupported rope scaling {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D]; cos/sin [T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused_out = fused.add_rms_norm_(x, None, self.weight, self.eps)
        if fused_out is not None:
            return fused_out
        # HF's order: normalise in fp32, cast back, then scale. One fused op for the first part.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its norm); on CPU one kernel pass, which adds into `residual` in place."""
        normed = fused.add_rms_norm_(residual, delta, self.weight, self.eps)
        if normed is not None:
            return residual, normed
        residual = residual + delta
        return residual, self(residual)


class LoRASlices:
    """LoRA of the modules that share one fused base projection.

    `targets` lists (module, output slice start, end). Once attached, `buffers` are the group's
    slot buffers (A of every module stacked along the rank axis, and each module's B with its
    output columns), so one op adds the deltas of all of them to the whole fused output.
    """

    def __init__(self, targets: list[tuple[str, int, int]]) -> None:
        self.targets = targets
        self.modules = tuple(module for module, _, _ in targets)
        self.buffers: tuple[torch.Tensor, list[SlicedB]] | None = None

    def apply(self, op: LoRAOp, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch | None) -> None:
        if lora is None or self.buffers is None:
            return
        op.apply(x, out, *self.buffers, lora)


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def _pack_into(module: DecoderLayer | LlamaModel, name: str, weight_attr: str) -> None:
    """Prepack a weight for the CPU GEMM and drop the dense copy, so weights are held once."""
    weight: nn.Parameter = getattr(module, weight_attr)
    packed = dense.pack(weight.data)
    if packed is not None:
        module.packed[name] = packed
        weight.data = weight.data.new_empty(0)


def _param(rows: int, cols: int | None, device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    shape = (rows,) if cols is None else (rows, cols)
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.config, self.index = c, index
        h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps, device, dtype)
        self.qkv_weight = _param(q + 2 * kv, h, device, dtype)
        self.qkv_bias = _param(q + 2 * kv, None, device, dtype) if c.qkv_bias else None
        self.o_weight = _param(h, q, device, dtype)
        self.o_bias = _param(h, None, device, dtype) if c.o_bias else None
        self.gate_up_weight = _param(2 * i, h, device, dtype)
        self.gate_up_bias = _param(2 * i, None, device, dtype) if c.mlp_bias else None
        self.down_weight = _param(h, i, device, dtype)
        self.down_bias = _param(h, None, device, dtype) if c.mlp_bias else None
        self.lora_qkv = LoRASlices([("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)])
        self.lora_o = LoRASlices([("o_proj", 0, h)])
        self.lora_gate_up = LoRASlices([("gate_proj", 0, i), ("up_proj", i, 2 * i)])
        self.lora_down = LoRASlices([("down_proj", 0, h)])
        self.packed: dict[str, torch.Tensor] = {}

    def lora_slices(self) -> list[LoRASlices]:
        return [self.lora_qkv, self.lora_o, self.lora_gate_up, self.lora_down]

    def pack_weights(self) -> None:
        for name in _PROJECTIONS:
            _pack_into(self, name, f"{name}_weight")

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, getattr(self, f"{name}_weight"), getattr(self, f"{name}_bias"), self.packed.get(name))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
        op: LoRAOp,
        scratch: GatherScratch,
    ) -> torch.Tensor:
        c = self.config
        residual = x
        x = self.input_layernorm(x)
        qkv = self._project("qkv", x)
        self.lora_qkv.apply(op, x, qkv, batch.lora)
        k_cache, v_cache = kv
        # On CPU one kernel rotates q and k in place and writes k and v to the cache.
        cached = fused.rope_and_cache(qkv, c.num_heads, c.num_kv_heads, c.head_dim, *rope,
                                      batch.attention.slot_mapping, k_cache, v_cache)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, k, v = (t.reshape(-1, heads, c.head_dim) for t, heads in ((q, c.num_heads), (k, c.num_kv_heads),
                                                                      (v, c.num_kv_heads)))
        if not cached:
            q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        attn = paged_attention(q, k, v, kv, batch.attention, scratch, cached).reshape(-1, c.q_size)
        out = self._project("o", attn)
        self.lora_o.apply(op, attn, out, batch.lora)
        residual, x = self.post_attention_layernorm.add_and_norm(residual, out)
        gate_up = self._project("gate_up", x)
        self.lora_gate_up.apply(op, x, gate_up, batch.lora)
        act = fused.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = self._project("down", act)
        self.lora_down.apply(op, act, out, batch.lora)
        return residual + out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    attn: AttentionBatch,
    scratch: GatherScratch,
    cached: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into their blocks (unless already `cached`), then attend: decode
    batched, prefill per segment.

    q [T, Hq, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D].
    """
    k_cache, v_cache = kv
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not cached:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, attn.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, attn.slot_mapping, v)
    all_decode = attn.decode_rows is not None and not attn.prefills and attn.decode_rows.shape[0] == q.shape[0]
    out = None if all_decode else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if attn.decode_rows is not None:
        tables, lens = attn.decode_block_tables, attn.decode_lens
        assert tables is not None and lens is not None  # set together with decode_rows
        # Rows are numbered in batch order, so a batch of decodes only is rows 0..T-1: no gathers.
        queries = q if all_decode else q.index_select(0, attn.decode_rows)  # [Bd, Hq, D]
        # On CPU, read the blocks in place; elsewhere (or without the kernel) gather them, then SDPA.
        result = cpu_kernels.decode_attention(queries, k_cache, v_cache, tables, lens)
        if result is None:
            batch_size = tables.shape[0]
            keys = scratch.gather(0, k_cache, tables).view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = scratch.gather(1, v_cache, tables).view(batch_size, -1, num_kv_heads, head_dim).transpose(1, 2)
            valid = torch.arange(keys.shape[2], device=q.device)[None, :] < lens[:, None]
            result = F.scaled_dot_product_attention(
                queries.unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :], enable_gqa=True
            ).squeeze(2)
        if out is None:  # all rows are decodes: the result is the output
            return result
        out.index_copy_(0, attn.decode_rows, result)
    assert out is not None  # only batches of decodes alone return above
    for seg in attn.prefills:
        queries = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
        if seg.num_computed == 0:
            keys = k[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
            values = v[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
            result = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
        else:
            context = seg.num_computed + seg.end - seg.start
            keys = scratch.gather(0, k_cache, seg.block_table).view(-1, num_kv_heads, head_dim)[:context]
            values = scratch.gather(1, v_cache, seg.block_table).view(-1, num_kv_heads, head_dim)[:context]
            query_pos = torch.arange(seg.num_computed, context, device=q.device)[:, None]
            mask = torch.arange(context, device=q.device)[None, :] <= query_pos
            result = F.scaled_dot_product_attention(
                queries,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                enable_gqa=True,
            )
        out[seg.start : seg.end] = result.squeeze(0).transpose(0, 1)
    return out


class GatherScratch:
    """Reused destinations for the K and V block gathers of every layer and step.

    A fresh tensor per gather (tens of MB in a large decode batch) made glibc hand the pages back
    and fault them in again each time: the gather plus attention ran ~5x slower on CPU.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def gather(self, which: int, cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Whole blocks by index (one memcpy per block, ~2x faster than advanced indexing)."""
        rows, row_size = tables.numel(), cache[0].numel()
        buffer = self._buffers[which]
        if buffer is None or buffer.numel() < rows * row_size or buffer.dtype != cache.dtype or (
            buffer.device != cache.device
        ):
            # Grow with headroom: decode contexts lengthen a block at a time.
            buffer = torch.empty(rows * row_size * 5 // 4, dtype=cache.dtype, device=cache.device)
            self._buffers[which] = buffer
        out = buffer[: rows * row_size].view(rows, row_size)
        torch.index_select(cache.view(cache.shape[0], -1), 0, tables.reshape(-1), out=out)
        return out.view(*tables.shape, *cache.shape[1:])


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.device, self.dtype = config, device, dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, device, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.lm_head = _param(config.vocab_size, config.hidden_size, device, dtype)
        self.rotary = RotaryEmbedding(config, device)
        self.lora_op: LoRAOp = TorchLoRAOp(device)  # the model runner picks the op for its device
        self.gather_scratch = GatherScratch()
        self.packed: dict[str, torch.Tensor] = {}

    def pack_weights(self) -> None:
        """Once the weights are in: prepack the projections for the CPU GEMM (no-op elsewhere)."""
        _pack_into(self, "lm_head", "lm_head")
        for layer in self.layers:
            layer.pack_weights()

    def attach_lora_buffers(
        self, buffers: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, list[SlicedB]]]
    ) -> None:
        """Point every fused projection at its group's slot buffers (owned by the LoRA memory pool)."""
        for layer in self.layers:
            for slices in layer.lora_slices():
                slices.buffers = buffers[(layer.index, slices.modules)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary(batch.positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, batch, kv, self.lora_op, self.gather_scratch)
        x = self.norm(x.index_select(0, batch.logits_rows))
        return dense.linear(x, self.lm_head, None, self.packed.get("lm_head")).float()

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Missing or extra weights are errors."""
        c = self.config
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise FailedPreconditionError(f"checkpoint is missing weight {name}")
            used.add(name)
            return tensors[name]

        def put(dst: torch.Tensor, *names: str) -> None:
            dst.copy_(torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0]))

        with torch.no_grad():
            put(self.embed_tokens.weight, "model.embed_tokens.weight")
            put(self.norm.weight, "model.norm.weight")
            lm_head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
            put(self.lm_head, lm_head)
            for layer in self.layers:
                p = f"model.layers.{layer.index}"
                put(layer.input_layernorm.weight, f"{p}.input_layernorm.weight")
                put(layer.post_attention_layernorm.weight, f"{p}.post_attention_layernorm.weight")
                put(layer.qkv_weight, *(f"{p}.self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj")))
                put(layer.o_weight, f"{p}.self_attn.o_proj.weight")
                put(layer.gate_up_weight, f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
                put(layer.down_weight, f"{p}.mlp.down_proj.weight")
                if layer.qkv_bias is not None:
                    put(layer.qkv_bias, *(f"{p}.self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")))
                if layer.o_bias is not None:
                    put(layer.o_bias, f"{p}.self_attn.o_proj.bias")
                if layer.gate_up_bias is not None:
                    put(layer.gate_up_bias, f"{p}.mlp.gate_proj.bias", f"{p}.mlp.up_proj.bias")
                    put(layer.down_bias, f"{p}.mlp.down_proj.bias")
        unused = set(tensors) - used - {"lm_head.weight"}
        unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
        if unused:
            raise FailedPreconditionError(f"checkpoint has weights this model does not use: {sorted(unused)[:5]}")
