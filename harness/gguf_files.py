"""Tiny GGUF files written on the spot with the `gguf` package's GGUFWriter, as llama.cpp's
convert_hf_to_gguf.py writes them: llama.cpp tensor names, q/k rows permuted for LLaMA, norms
kept F32, a byte-level BPE tokenizer ("gpt2") and a ChatML template in the metadata.

Quantized types gguf.quants can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from the
checkpoint's weights; K-quants, which it cannot quantize, are random blocks with sane scales
(`random_blocks`), so a K-quant file is its own model, not a copy of the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from harness.models import make_checkpoint

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = ["Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "Ġ s", "a t", "e n", "Ġ w", "o r", "Ġ c",
          "i s", "a n"]
# Block layout of each type: (bytes per block, byte offsets of its fp16 scale fields), from ggml-common.h.
BLOCKS = {"Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q5_1": (24, (0, 2)), "Q8_0": (34, (0,)),
          "Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
          "Q6_K": (210, (208,))}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# hidden and intermediate sizes that are multiples of 256, the K-quants' block
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges): 3 control tokens, the 256 byte symbols, the merges."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    symbols = [chr(b if b in printable else next(extra)) for b in range(256)]
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIAL + symbols + merged
    types = [3] * len(SPECIAL) + [1] * (len(symbols) + len(merged))
    return tokens, types, MERGES


SPM_PIECES = ["▁", "▁t", "he", "▁the", "▁a", "in", "er", "on", "▁w", "is", "an", "▁is", "or", "▁of", "▁in"]


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, llama.cpp token types, scores) of a small SentencePiece BPE vocabulary as Llama 2's
    GGUF files hold one: <unk> <s> </s>, the chat markers, 256 <0xNN> byte tokens, pieces best
    first, single letters; no merges (they follow from the scores)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *(f"<0x{b:02X}>" for b in range(256)),
              *SPM_PIECES, *letters]
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * (len(SPM_PIECES) + len(letters))
    scores = [0.0] * 261 + [-float(i) for i in range(len(SPM_PIECES))] + [-100.0 - i for i in range(len(letters))]
    return tokens, types, scores


def make_base_checkpoint(out: Path, family: str = "llama", seed: int = 0, tokenizer_model: str = "gpt2",
                         **overrides: object) -> Path:
    """A random HF checkpoint the GGUF fixtures are converted from (its vocab: byte_level_vocab, or
    sentencepiece_vocab for tokenizer_model "llama")."""
    tokens = (sentencepiece_vocab() if tokenizer_model == "llama" else byte_level_vocab())[0]
    params: dict[str, object] = dict(SHAPE, vocab_size=len(tokens), tie_word_embeddings=False)
    if family == "llama":
        params["rope_scaling"] = None  # GGUF has no llama3 scaling keys (llama.cpp stores rope_freqs)
    params.update(overrides)
    return make_checkpoint(out, family, seed=seed, **params)


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of a block type, its fp16 scales set to small finite values
    (random fp16 bits would be inf/NaN one time in 32)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert block_bytes == BLOCKS[qtype][0] and cols % block_elems == 0
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in BLOCKS[qtype][1]:
        scales = (rng.uniform(0.2, 1.0, size=blocks.shape[0]) * 1e-3).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_elems * block_bytes)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: each head's rows from halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
ARCHITECTURES = {"qwen3_moe": "qwen3moe"}  # model_type → llama.cpp's name, where they differ
UNPERMUTED = ("qwen2", "qwen3", "qwen3_moe")  # NEOX RoPE in llama.cpp: q/k rows as HF has them


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MoE weights (`model.layers.N.mlp.experts.E.gate_proj.weight`) stacked [experts, out, in]
    under `model.layers.N.mlp.experts.gate_proj.weight`, as llama.cpp's converter stacks them."""
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"]:
            stacked.setdefault(".".join(parts[:5] + parts[6:]), {})[int(parts[5])] = value
        else:
            out[name] = value
    for name, experts in stacked.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest.startswith("mlp.experts."):  # stacked (_stack_experts)
        return f"blk.{layer}.ffn_{rest.split('.')[2].removesuffix('_proj')}_exps.weight"
    return f"blk.{layer}.{_NAMES[rest]}"


def write_gguf(checkpoint: Path, out: Path, qtype: str = "F32", *, arch: str | None = None,
               tokenizer_model: str = "gpt2", extra_tensors: dict[str, np.ndarray] | None = None,
               seed: int = 0, drop_keys: tuple[str, ...] = (), extra_uint32: dict[str, int] | None = None,
               tensor_types: dict[str, str] | None = None) -> Path:
    """Convert a checkpoint (make_base_checkpoint) to GGUF with its 2-D weights in `qtype` (`tensor_types`: another
    type for the tensors it names by their GGUF names, as llama.cpp's quantizer mixes them);
    `drop_keys` left out of its metadata and `extra_uint32` added (malformed files for tests)."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    family = config["model_type"]
    arch = arch or ARCHITECTURES.get(family, family)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    qt = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{family}-{qtype}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if config.get("head_dim"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model(tokenizer_model)
    if tokenizer_model == "llama":
        tokens, types, scores = sentencepiece_vocab()
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
    else:
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    tensors = _stack_experts(load_file(str(checkpoint / "model.safetensors")))
    for index, (name, value) in enumerate(sorted(tensors.items())):
        data = value.to(torch.float32).numpy()
        if family not in UNPERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, heads if "q_proj" in name else kv_heads)
        target = gguf_name(name)
        tensor_type = (tensor_types or {}).get(target, qtype)
        if tensor_type != qtype:
            writer.add_tensor(target, gguf.quants.quantize(data, gguf.GGMLQuantizationType[tensor_type]),
                              raw_dtype=gguf.GGMLQuantizationType[tensor_type])
        elif data.ndim == 3 and qtype not in ("F32", "F16"):  # stacked experts: each expert's matrix quantized
            if data.shape[-1] % 32:  # rows not whole blocks: kept F32, as llama.cpp's converter falls back
                writer.add_tensor(target, data)
            else:
                writer.add_tensor(target, np.stack([gguf.quants.quantize(m, qt) for m in data]), raw_dtype=qt)
        elif data.ndim == 1 or qtype == "F32":
            writer.add_tensor(target, data)
        elif qtype in K_QUANTS:
            writer.add_tensor(target, random_blocks(qtype, *data.shape, seed=seed * 1000 + index), raw_dtype=qt)
        elif qtype == "F16":
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data, qt), raw_dtype=qt)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    for key, number in (extra_uint32 or {}).items():
        writer.add_uint32(key, number)
    for key in drop_keys:
        del writer.kv_data[0][key]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def nested_arrays_gguf(out: Path, depth: int) -> Path:
    """A GGUF v3 file whose one metadata value is an array of an array of ... `depth` deep (no
    writer makes that; the bytes are the format's: ggml/docs/gguf.md)."""
    import struct

    key = b"general.nested"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    out.write_bytes(header + struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0))
    return out
