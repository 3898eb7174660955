"""Load a model and tokenizer: a Hugging Face checkpoint directory or the embedded builtin:tiny."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from inference_service.errors import FailedPreconditionError
from inference_service.models.llama import LlamaModel, ModelConfig
from inference_service.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer

log = logging.getLogger(__name__)

BUILTIN_TINY = "builtin:tiny"
# Small enough to start in a second on a laptop CPU, big enough to exercise GQA and every LoRA module.
TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
}
TINY_SEED = 1234


def load_model(spec: str, device: torch.device, dtype: torch.dtype,
               tokenizer_mode: str = "auto") -> tuple[LlamaModel, Tokenizer]:
    """`tokenizer_mode` auto: the checkpoint's tokenizer.json, refused when it has none (a byte
    tokenizer on a real model's ids is garbage text, not an error anyone would notice); byte:
    the byte-level tokenizer, asked for explicitly."""
    if tokenizer_mode not in ("auto", "byte"):
        raise FailedPreconditionError(f"tokenizer must be auto or byte, got {tokenizer_mode!r}")
    if spec == BUILTIN_TINY:
        model = _builtin_tiny(device, dtype)
        model.pack_weights()
        return model, ByteTokenizer()
    root = Path(spec)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FailedPreconditionError(f"{spec}: no config.json (expected a Hugging Face checkpoint dir)")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()), name=root.name)
    tokenizer_path = root / "tokenizer.json"
    tokenizer: Tokenizer
    if tokenizer_mode == "byte":
        tokenizer = ByteTokenizer()
    elif tokenizer_path.is_file():
        tokenizer = FileTokenizer(tokenizer_path, config.eos_token_ids)
    else:
        raise FailedPreconditionError(
            f"{spec}: no tokenizer.json; add the model's tokenizer, or pass --tokenizer byte to serve with "
            "the byte-level tokenizer (text is UTF-8 bytes as token ids 0-255)")
    model = LlamaModel(config, device, dtype)
    model.load_hf_state_dict(_read_safetensors(root))
    model.pack_weights()
    log.info("loaded %s: %d layers, hidden %d, vocab %d", spec, config.num_layers, config.hidden_size,
             config.vocab_size)
    return model, tokenizer


def _read_safetensors(root: Path) -> dict[str, torch.Tensor]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FailedPreconditionError(f"{root}: no *.safetensors weights")
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        raise FailedPreconditionError(f"{root}: weight files listed in the index are missing: {missing}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            tensors.update(load_file(str(root / name)))
        except SafetensorError as exc:
            raise FailedPreconditionError(f"{root / name}: unreadable safetensors file: {exc}") from None
    return tensors


def builtin_tiny_config() -> ModelConfig:
    return ModelConfig.from_hf(TINY_CONFIG, name=BUILTIN_TINY)


def _builtin_tiny(device: torch.device, dtype: torch.dtype) -> LlamaModel:
    """Deterministic random weights: the same seed gives the same model everywhere."""
    config = builtin_tiny_config()
    model = LlamaModel(config, device, dtype)
    gen = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "layernorm" in name or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
    return model
