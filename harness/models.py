"""Tiny Hugging Face checkpoints and PEFT adapters made on the spot (no downloads).

transformers and peft are dev dependencies: only tests and benchmarks import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

FAMILIES: dict[str, dict] = {
    # GQA + Llama-3 rope scaling
    "llama": dict(
        model_type="llama",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(model_type="qwen2"),  # qkv bias
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen3": dict(model_type="qwen3", head_dim=32),  # QK-norm
    # Qwen3-MoE: 8 experts, top-2 renormalised, QK-norm
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, head_dim=32),
}
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_checkpoint(out: Path, family: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                    **overrides: object) -> Path:
    """Save a tiny random LLaMA-family checkpoint with transformers.save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    params = dict(
        vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )
    params.update(spec)
    params.update(overrides)
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    write_byte_tokenizer(out / "tokenizer.json")
    return out


def write_byte_tokenizer(path: Path) -> Path:
    """A tokenizer.json that maps UTF-8 bytes to ids 0-255 (no BOS): a checkpoint needs a tokenizer
    to be served (the loader refuses one without), and these random models have no real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    to_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}  # GPT-2's bytes_to_unicode
    tok = Tokenizer(models.BPE({to_char[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return path


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = tuple(ALL_MODULES)
    use_rslora: bool = False
    seed: int = 0
    # More LoraConfig fields (rank_pattern, alpha_pattern, layers_to_transform, ...), as PEFT takes them.
    options: dict = field(default_factory=dict)


def make_adapter(checkpoint: Path, out: Path, spec: AdapterSpec) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B, saved in PEFT's layout."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules), use_rslora=spec.use_rslora,
        init_lora_weights=False, lora_dropout=0.0, **spec.options,
    )
    torch.manual_seed(spec.seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return out


def peft_reference(checkpoint: Path, adapters: dict[str, Path]):
    """One PeftModel holding every adapter, for reference generations (eval mode, fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


Prompt = tuple[str, list[int], str | None]  # (request id, prompt token ids, adapter or None for the base)


def peft_greedy_logits(checkpoint: Path, adapters: dict[str, Path], prompts: list[Prompt],
                       new_tokens: int) -> dict[str, torch.Tensor]:
    """PEFT's greedy generation (fp32, CPU), per request: its logits at prefill and each decode step."""
    model = peft_reference(checkpoint, adapters)
    result = {}
    with torch.no_grad():
        for rid, tokens, adapter in prompts:
            out = model.generate(
                torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                adapter_names=[adapter or "__base__"], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            result[rid] = torch.cat(out.logits).float()
    return result
