"""Load a model and tokenizer: a Hugging Face checkpoint (directory or id), a GGUF file, or builtin:tiny."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from adapter_cache.errors import FailedPreconditionError
from inference_service.models.compute import ModelCompute, portable
from inference_service.models.config import ModelConfig
from inference_service.models.gguf import GGUFFile
from inference_service.models.llama import LlamaModel
from inference_service.models.quantized import QUANTIZED_DTYPES, WEIGHTS_DTYPES
from inference_service.models.registry import CausalLM, model_class
from inference_service.models.source import BUILTIN_PREFIX, ModelSource, resolve_model
from inference_service.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer

log = logging.getLogger(__name__)

BUILTIN_TINY = f"{BUILTIN_PREFIX}tiny"
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
               tokenizer_mode: str = "auto", revision: str | None = None,
               pack_weights: bool = True, weights_dtype: str = "auto",
               compute: ModelCompute | None = None) -> tuple[CausalLM, Tokenizer]:
    """`spec`: builtin:tiny, a checkpoint directory, a .gguf file (or a directory holding one), or a
    Hugging Face id (`revision` pins it) found in the Hugging Face cache (models/source.py).
    `tokenizer_mode` auto: the checkpoint's tokenizer (tokenizer.json, or the GGUF file's own),
    refused when it has none (a byte tokenizer on a real model's ids is garbage text, not an error
    anyone would notice); byte: the byte-level tokenizer, asked for explicitly. `pack_weights=False`
    keeps the dense weights (what a captured decode step reads) instead of the CPU GEMM's packing.
    `weights_dtype` (models/quantized.py): auto keeps a GGUF file's Q8_0/Q4_0 projections quantized where
    they can be served so (on CPU, packed), q8_0 or q4_0 asks for that type (quantizing others), bf16
    dequantizes. `compute`: the attention backend, fused ops and weight packing the platform plan chose
    (inference_service/platform); without one torch's ops, nothing packed."""
    compute = compute or portable()
    if tokenizer_mode not in ("auto", "byte"):
        raise FailedPreconditionError(f"tokenizer must be auto or byte, got {tokenizer_mode!r}")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise FailedPreconditionError(
            f"weights dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {weights_dtype!r}")
    source = resolve_model(spec, revision)
    quantized_ok = device.type == "cpu" and pack_weights
    if weights_dtype in QUANTIZED_DTYPES and source.kind != "gguf":
        raise FailedPreconditionError(
            f"--weights-dtype {weights_dtype} serves a GGUF file's weights; {spec} is not one")
    if weights_dtype in QUANTIZED_DTYPES and not quantized_ok:
        raise FailedPreconditionError(
            f"--weights-dtype {weights_dtype} is served on CPU with packed weights only (here: {device}"
            f"{'' if pack_weights else ', dense weights for captured decode steps'}); use bf16 or auto")
    if not quantized_ok:
        weights_dtype = "bf16"
    if source.kind == "builtin":
        if spec != BUILTIN_TINY:
            raise FailedPreconditionError(f"unknown builtin model {spec!r} (there is {BUILTIN_TINY})")
        model = _builtin_tiny(device, dtype, compute)
        if pack_weights:
            model.pack_weights()
        return model, ByteTokenizer()
    assert source.path is not None  # set for every kind but builtin
    start = time.perf_counter()
    if source.kind == "gguf":
        model, tokenizer = _load_gguf(source, device, dtype, tokenizer_mode, weights_dtype, compute)
    else:
        model, tokenizer = _load_hf_dir(source, device, dtype, tokenizer_mode, compute)
    if pack_weights:
        model.pack_weights()
    if model.weight_bytes_saved:
        log.info("weights: projections kept quantized (--weights-dtype %s), %.1f MiB less than in %s",
                 weights_dtype, model.weight_bytes_saved / 2**20, dtype)
    c = model.config
    log.info("loaded %s (%s) in %.1f s: %d layers, hidden %d, vocab %d", spec, source.path,
             time.perf_counter() - start, c.num_layers, c.hidden_size, c.vocab_size)
    return model, tokenizer


def _load_hf_dir(source: ModelSource, device: torch.device, dtype: torch.dtype,
                 tokenizer_mode: str, compute: ModelCompute) -> tuple[CausalLM, Tokenizer]:
    root = source.path
    assert root is not None
    hf_config = json.loads((root / "config.json").read_text())
    model_cls = model_class(hf_config)
    config = ModelConfig.from_hf(hf_config, name=source.name)
    tokenizer_path = root / "tokenizer.json"
    tokenizer: Tokenizer
    if tokenizer_mode == "byte":
        tokenizer = ByteTokenizer()
    elif tokenizer_path.is_file():
        tokenizer = FileTokenizer(tokenizer_path, config.eos_token_ids)
    else:
        raise FailedPreconditionError(
            f"{root}: no tokenizer.json; add the model's tokenizer, or pass --tokenizer byte to serve with "
            "the byte-level tokenizer (text is UTF-8 bytes as token ids 0-255)")
    model = model_cls(config, device, dtype, compute)
    model.load_hf_state_dict(_read_safetensors(root))
    return model, tokenizer


def _load_gguf(source: ModelSource, device: torch.device, dtype: torch.dtype,
               tokenizer_mode: str, weights_dtype: str, compute: ModelCompute) -> tuple[CausalLM, Tokenizer]:
    assert source.path is not None
    gguf = GGUFFile(source.path)
    hf_config = gguf.hf_config()
    model_cls = model_class(hf_config)
    config = ModelConfig.from_hf(hf_config, name=source.name)
    tokenizer: Tokenizer = ByteTokenizer() if tokenizer_mode == "byte" else FileTokenizer(
        gguf.tokenizer(), config.eos_token_ids)
    model = model_cls(config, device, dtype, compute)
    # Dequantized one tensor at a time as the model takes it, cast to `dtype` on copy; projections
    # kept quantized (weights_dtype) are taken as blocks.
    model.load_hf_state_dict(gguf.state_dict(weights_dtype))
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


def _builtin_tiny(device: torch.device, dtype: torch.dtype, compute: ModelCompute) -> LlamaModel:
    """Deterministic random weights: the same seed gives the same model everywhere."""
    config = builtin_tiny_config()
    model = LlamaModel(config, device, dtype, compute)
    gen = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "layernorm" in name or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
    return model
