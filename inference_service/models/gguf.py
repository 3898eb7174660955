"""GGUF checkpoints (llama.cpp's format): config, weights, tokenizer and chat template from one file.

The file is read by gguf_reader.py (memory-mapped); weights are dequantized with the `gguf`
package as the loader asks for each one (a lazy mapping), so a quantized file never sits in memory
as a whole fp32 state dict; the model's own parameters take the serving dtype on copy. Tensor and
metadata names follow llama.cpp (gguf-py/gguf/constants.py and tensor_mapping.py); llama.cpp's
converter permutes the rows of LLaMA's q/k projections for its interleaved RoPE, which
`_unpermute` undoes, as transformers does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from adapter_cache.errors import FailedPreconditionError
from inference_service.models.gguf_reader import read_gguf
from inference_service.models.gguf_tokenizer import build_tokenizer
from inference_service.models.quantized import KEPT_TYPES, QuantizedWeight, quantize_blocks

log = logging.getLogger(__name__)

# GGUF architecture → our model_type. Mistral converts to "llama" in GGUF; the Qwen families keep
# HF's rotate-half RoPE in llama.cpp (NEOX), so their q/k rows are not permuted.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
_PERMUTED_QK = {"llama"}

# Tensor types dequantized here (gguf.quants), each checked against an independent reference in
# tests/test_gguf_loading.py.
DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = (*DENSE_TYPES, "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # an MoE layer's router
}
# An MoE layer's experts, stacked [experts, out, in] in one tensor each (llama.cpp's `_exps`); the
# state dict names each expert's slice as transformers' per-expert checkpoints do.
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                   "ffn_down_exps.weight": "down_proj"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None: one this model family lacks)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` (rows of each head: pairs → halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """One opened .gguf file: its metadata (as Python values) and tensors (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._metadata, self.tensors = read_gguf(path)
        except (ValueError, OSError) as exc:
            raise FailedPreconditionError(f"{path}: not a readable GGUF file: {exc}") from None
        self.architecture = str(self.get("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            raise FailedPreconditionError(
                f"{path}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})")

    def get(self, key: str, default: Any = None) -> Any:
        return self._metadata.get(key, default)

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def count(self, key: str, default: int | None = None) -> int:
        """A positive integer of the architecture's metadata; a missing or malformed one is named."""
        value = self.arch(key, default)
        if value is None:
            raise FailedPreconditionError(f"{self.path}: GGUF metadata {self.architecture}.{key} is missing")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FailedPreconditionError(
                f"{self.path}: GGUF metadata {self.architecture}.{key} must be a positive integer, got {value!r:.40}")
        return value

    def expert_names(self, gguf_name: str) -> list[str]:
        """The HF names of each expert's slice of a stacked expert tensor ([] for any other tensor)."""
        match = _LAYER_NAME.fullmatch(gguf_name)
        tensor = self.tensors[gguf_name]
        if not match or match.group(2) not in _EXPERT_TENSORS or len(tensor.shape) != 3:
            return []
        layer, module = match.group(1), _EXPERT_TENSORS[match.group(2)]
        return [f"model.layers.{layer}.mlp.experts.{e}.{module}.weight" for e in range(int(tensor.shape[2]))]

    def hf_config(self) -> dict[str, Any]:
        """The file's hyperparameters as a Hugging Face config.json would give them."""
        try:
            return self._hf_config()
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:  # a field of the wrong kind
            raise FailedPreconditionError(f"{self.path}: malformed GGUF metadata: {exc!r:.200}") from None

    def _hf_config(self) -> dict[str, Any]:
        heads = self.count("attention.head_count")
        hidden = self.count("embedding_length")
        tokens = self.get("tokenizer.ggml.tokens")
        vocab = self.arch("vocab_size") or (len(tokens) if tokens else None)
        if vocab is None:
            vocab = int(self.tensors["token_embd.weight"].shape[-1])
        eos = [int(self.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if self.get(k) is not None]
        config: dict[str, Any] = {
            "model_type": ARCHITECTURES[self.architecture],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self.count("feed_forward_length", self.arch("expert_feed_forward_length")),
            "num_hidden_layers": self.count("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.count("attention.head_count_kv", heads),
            "head_dim": int(self.arch("attention.key_length") or self.arch("rope.dimension_count")
                            or hidden // heads),
            "rms_norm_eps": float(self.arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": self.count("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(eos)) or None,
        }
        if self.architecture == "qwen3moe":
            # llama.cpp's qwen3moe graph always renormalises the top-k weights (norm_topk_prob).
            config.update(num_experts=self.count("expert_count"), num_experts_per_tok=self.count("expert_used_count"),
                          moe_intermediate_size=self.count("expert_feed_forward_length"), norm_topk_prob=True)
        scaling = self.arch("rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise FailedPreconditionError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported")
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(self.arch("rope.scaling.factor"))}
        if "rope_freqs.weight" in self.tensors:
            # Llama 3.1's frequency factors, stored as a tensor: serving without them would be wrong.
            raise FailedPreconditionError(f"{self.path}: GGUF rope frequency factors (rope_freqs) are not supported")
        return config

    def check_tensor_types(self) -> None:
        """Fail before any weight is read when a tensor's type cannot be dequantized here."""
        from gguf import GGMLQuantizationType

        for tensor in self.tensors.values():
            type_name = GGMLQuantizationType(tensor.type_id).name
            if type_name not in SUPPORTED_TYPES:
                raise FailedPreconditionError(
                    f"{self.path}: tensor {tensor.name} has GGUF type {type_name}, which is not "
                    f"supported (supported: {', '.join(SUPPORTED_TYPES)})")

    def dequantize(self, name: str, expert: int | None = None) -> np.ndarray:
        """One tensor as float32, in PyTorch's (row-major, HF) shape; of a stacked expert tensor, one
        expert's matrix (only its blocks are read)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        # GGUF lists dimensions innermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        blocks = tensor.data
        if expert is not None:
            blocks, shape = blocks[expert], shape[1:]
        data = dequantize(blocks, GGMLQuantizationType(tensor.type_id))
        return data.reshape(shape).astype(np.float32, copy=False)

    def type_name(self, name: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].type_id).name

    def dominant_type(self) -> str:
        """The type holding most of the file's matrix elements (2-D tensors)."""
        elements: dict[str, int] = {}
        for name, tensor in self.tensors.items():
            if len(tensor.shape) == 2:
                kind = self.type_name(name)
                elements[kind] = elements.get(kind, 0) + int(tensor.shape[0]) * int(tensor.shape[1])
        return max(elements, key=elements.__getitem__) if elements else "F32"

    def state_dict(self, weights_dtype: str = "bf16") -> GGUFStateDict:
        self.check_tensor_types()
        return GGUFStateDict(self, weights_dtype)

    def tokenizer(self) -> Tokenizer:
        return build_tokenizer({k: v for k, v in self._metadata.items() if k.startswith("tokenizer.ggml.")},
                               str(self.path))

    def chat_template(self) -> str | None:
        template = self.get("tokenizer.chat_template")
        return template if isinstance(template, str) else None

    def special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad token texts, as chat templates refer to them."""
        tokens = self.get("tokenizer.ggml.tokens") or []
        out: dict[str, str] = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = self.get(f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                out[name] = tokens[int(token_id)]
        return out


class GGUFStateDict(Mapping[str, torch.Tensor]):
    """HF-named float32 weights of a GGUF file, dequantized (and q/k un-permuted) when read; with a
    `weights_dtype` other than bf16 (models/quantized.py), projections as blocks (`quantized`)."""

    def __init__(self, file: GGUFFile, weights_dtype: str = "bf16") -> None:
        self._file = file
        # auto keeps the file's quantization only where its weights are mostly of a kept type: a Q4_1 or
        # Q4_K file whose token embedding alone is Q8_0 (llama.cpp's usual mix) is served dense, not
        # with one matrix (the tied LM head) on another kernel than the rest.
        if weights_dtype == "auto" and file.dominant_type() not in KEPT_TYPES:
            weights_dtype = "bf16"
        self.weights_dtype = weights_dtype
        config = file.hf_config()
        self._heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        # Tensors without an HF name keep their GGUF name, so the loader's "weights this model does
        # not use" error names them.
        self._names = {hf_tensor_name(name) or name: name for name in file.tensors if not file.expert_names(name)}
        self._experts = {hf: (name, e) for name in file.tensors for e, hf in enumerate(file.expert_names(name))}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._experts:
            data = self._file.dequantize(*self._experts[name])
            return torch.from_numpy(np.array(data, copy=not data.flags.writeable or not data.flags.c_contiguous))
        data = self._file.dequantize(self._names[name])
        if self._file.architecture in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _unpermute(data, self._heads[name.split(".")[-2]])
        # F32 tensors come back as views of the read-only memory map: copy those.
        return torch.from_numpy(np.array(data, copy=not data.flags.writeable or not data.flags.c_contiguous))

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Weight `name` [out, in] as blocks, or None where it is served dense: weights dtype bf16, or
        auto and the tensor is not of a type kept as blocks, or an input size that is not whole blocks."""
        if name in self._experts:  # the experts are served dense
            return None
        gguf_name = self._names[name]
        tensor = self._file.tensors[gguf_name]
        if self.weights_dtype == "bf16" or len(tensor.shape) != 2 or tensor.shape[0] % 32:
            return None
        out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
        type_name = self._file.type_name(gguf_name)
        wanted = self.weights_dtype.upper()
        if self.weights_dtype == "auto":
            # A matrix in a quantized type no kernel reads (llama.cpp's quantizer writes a Q4_0 or Q8_0
            # file's LM head, or its tied token embedding, as Q6_K) is served as Q8_0, as fine as any
            # type of 8 bits or fewer, rather than dequantized to twice the bytes in bf16.
            wanted = type_name if type_name in KEPT_TYPES or type_name in DENSE_TYPES else "Q8_0"
        if wanted not in KEPT_TYPES:
            return None
        if type_name != wanted:  # quantized at load as llama.cpp would have
            return quantize_blocks(self[name].numpy(), wanted)
        blocks = tensor.data
        if self._file.architecture in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            blocks = _unpermute(blocks, self._heads[name.split(".")[-2]])  # whole rows: blocks move with them
        return QuantizedWeight(type_name, blocks, out_features, in_features)

    def __contains__(self, name: object) -> bool:  # Mapping's default would dequantize the tensor
        return name in self._names or name in self._experts

    def __iter__(self) -> Iterator[str]:
        yield from self._names
        yield from self._experts

    def __len__(self) -> int:
        return len(self._names) + len(self._experts)


def find_gguf(directory: Path) -> Path | None:
    """The one .gguf file in a directory without a config.json (None: there is none)."""
    files = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        raise FailedPreconditionError(
            f"{directory}: several GGUF files ({', '.join(p.name for p in files)}); pass --model the one to serve")
    return files[0] if files else None
