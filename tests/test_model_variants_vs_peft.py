"""Checkpoint features the LLaMA family allows, against transformers + PEFT on tiny random checkpoints:
linear RoPE scaling (`rope_scaling {"rope_type": "linear", "factor": 2}`) and biases on the attention
and MLP projections (`attention_bias`, `mlp_bias`). One mixed batch (two adapters on every target
module, plus the base model), logits within 1e-4 (fp32) at prefill and 12 decode steps, greedy
tokens identical. Each case also checks that the feature changes the reference's logits, so a
model that ignored it could not pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.engine_helpers import greedy_logits
from harness.models import AdapterSpec, make_adapter, make_checkpoint, peft_greedy_logits, peft_reference
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore

NEW_TOKENS = 13  # prefill + 12 decode steps
TOL = 1e-4
VOCAB = 160
ADAPTERS = [AdapterSpec("r8-all", 8, 16, seed=21), AdapterSpec("r4-rslora", 4, 8, use_rslora=True, seed=22)]
# A long prompt reaches positions where the rotation angles of the scaled and unscaled RoPE differ most.
PROMPTS = [("a", list(range(3, 43)), "r8-all"), ("b", [7, 19, 4, 88, 5, 61, 9], "r4-rslora"),
           ("c", list(range(100, 123)), None)]
VARIANTS = {
    "rope-linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "attention-and-mlp-bias": dict(rope_scaling=None, attention_bias=True, mlp_bias=True),
}


def _sharpen_attention(checkpoint: Path, factor: float = 8.0) -> None:
    """At transformers' initial scale (std 0.02) attention is nearly uniform, so positions (and the
    RoPE that encodes them) barely move the logits: scale q_proj and k_proj up, saved in place."""
    (path,) = checkpoint.glob("*.safetensors")
    tensors = load_file(str(path))
    for name in tensors:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = tensors[name] * factor
    save_file(tensors, str(path), metadata={"format": "pt"})


def _randomise_biases(checkpoint: Path, seed: int) -> list[str]:
    """transformers initialises every bias to zero, which would make a model that drops them pass:
    give each one random values, saved in place."""
    (path,) = checkpoint.glob("*.safetensors")
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    biases = sorted(name for name in tensors if name.endswith(".bias"))
    for name in biases:
        tensors[name] = torch.randn(tensors[name].shape, generator=gen) * 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})
    return biases


def _engine(checkpoint: Path, adapters: dict[str, Path]) -> dict[str, tuple[torch.Tensor, list[int]]]:
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", max_loras=2, max_lora_rank=8,
                                   kv_cache_bytes=4 << 20))
    return greedy_logits(core, adapters, PROMPTS, NEW_TOKENS)


def _reference(checkpoint: Path, adapters: dict[str, Path]) -> dict[str, torch.Tensor]:
    return peft_greedy_logits(checkpoint, adapters, PROMPTS, NEW_TOKENS)


def _forced(checkpoint: Path, adapters: dict[str, Path], generated: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The reference's logits over each prompt and the given continuation (one forward pass)."""
    model = peft_reference(checkpoint, adapters)
    with torch.no_grad():
        return {rid: model(input_ids=torch.tensor([tokens + generated[rid][:-1]]),
                           adapter_names=[adapter or "__base__"]).logits[0, len(tokens) - 1:].float()
                for rid, tokens, adapter in PROMPTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_variant_matches_peft(tmp_path: Path, variant: str) -> None:
    checkpoint = make_checkpoint(tmp_path / "model", "llama", seed=31, vocab_size=VOCAB, **VARIANTS[variant])
    config = json.loads((checkpoint / "config.json").read_text())
    if variant == "rope-linear":  # transformers 5 writes rope_parameters; older versions rope_scaling
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        assert rope["rope_type"] == "linear" and rope["factor"] == 2.0, config
        _sharpen_attention(checkpoint)
    else:
        biases = _randomise_biases(checkpoint, seed=32)
        assert {b.rsplit(".", 2)[-2] for b in biases} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"}, biases
    adapters = {s.name: make_adapter(checkpoint, tmp_path / s.name, s) for s in ADAPTERS}
    ours, ref = _engine(checkpoint, adapters), _reference(checkpoint, adapters)
    for rid, _, adapter in PROMPTS:
        logits, tokens = ours[rid]
        assert logits.shape == ref[rid].shape == (NEW_TOKENS, VOCAB), rid
        diff = (logits - ref[rid]).abs().max().item()
        print(f"MEASURE {variant} {rid}: max |logit diff| {diff:.2e}")
        assert diff < TOL, f"{variant} {rid} ({adapter}): max |logit diff| {diff}"
        assert tokens == ref[rid].argmax(-1).tolist(), f"{variant} {rid}: greedy tokens differ"

    # The same weights without the feature: the reference moves far beyond the tolerance.
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in checkpoint.iterdir():
        if f.is_file():
            (plain / f.name).write_bytes(f.read_bytes())
    if variant == "rope-linear":
        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(config.get(key), dict):
                config[key] = {k: v for k, v in config[key].items() if k not in ("factor",)} | {"rope_type": "default"}
    else:
        tensors = load_file(str(plain / "model.safetensors"))
        save_file({k: torch.zeros_like(v) if k.endswith(".bias") else v for k, v in tensors.items()},
                  str(plain / "model.safetensors"), metadata={"format": "pt"})
    (plain / "config.json").write_text(json.dumps(config))
    without = _forced(plain, adapters, {rid: ours[rid][1] for rid, _, _ in PROMPTS})
    for rid, _, _ in PROMPTS:
        moved = (without[rid] - ref[rid]).abs().max().item()
        print(f"MEASURE {variant} {rid}: without the feature {moved:.4f}")
        assert moved > 100 * TOL, f"{variant} {rid}: the feature moves the logits by only {moved}"
