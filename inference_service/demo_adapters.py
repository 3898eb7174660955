"""Random PEFT LoRA adapters shaped for a base model (builtin:tiny by default).

`python -m inference_service.demo_adapters OUT_DIR [--count N]` writes OUT_DIR/demo-<i>/
{adapter_config.json, adapter_model.safetensors} and prints a preload file path. Used by
`make run` (no downloads), the `loraplex-demo` console script, and the tests and benches
(`write_peft_adapter`, the one adapter writer).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference_service.models.config import ModelConfig
from inference_service.models.loader import builtin_tiny_config

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def module_features(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA-targetable projection."""
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (h, q_out),
        "k_proj": (h, kv_out),
        "v_proj": (h, kv_out),
        "o_proj": (q_out, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def write_peft_adapter(
    out_dir: str | Path,
    config: ModelConfig | None = None,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] = ATTENTION + MLP,
    seed: int = 0,
    scale: float = 0.2,
    num_layers: int | None = None,
) -> Path:
    """Writes a PEFT adapter whose lora_B is non-zero, so it visibly changes the output."""
    config = config or builtin_tiny_config()
    features = module_features(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers if num_layers is None else num_layers):
        for module in target_modules:
            part = "self_attn" if module in ATTENTION else "mlp"
            in_f, out_f = features[module]
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * scale
    save_file(tensors, str(out / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.name or "builtin:tiny",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(peft_config, indent=2))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)
    root = Path(args.out_dir).resolve()
    entries = []
    for i in range(args.count):
        path = write_peft_adapter(root / f"demo-{i}", rank=args.rank, seed=i)
        entries.append({"name": f"demo-{i}", "uri": path.as_uri(), "pinned": i == 0})
    preload = root / "preload.json"
    preload.write_text(json.dumps(entries, indent=2))
    print(preload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
