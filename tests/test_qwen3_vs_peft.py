"""Qwen3 (dense), served through the model registry, against transformers + PEFT on a tiny random
Qwen3 checkpoint: QK-norm (an RMSNorm on each head of q and k, before RoPE), no attention bias,
head_dim from config.json (32 here, not hidden_size / num_heads = 16).

One mixed batch: four adapters (ranks 4, 8, 16; rsLoRA; different target modules, q_proj and k_proj
among them, whose deltas the QK-norm then reads) plus base-model requests; logits within 1e-4 (fp32)
at prefill and 12 decode steps, greedy tokens identical, on both CPU LoRA op paths and with chunked
prefill over cached KV. The same weights served as LLaMA (no QK-norm) move the reference's logits
far beyond the tolerance, so a model that skipped the norms could not pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.devices import C_KERNELS_OFF
from harness.engine_helpers import greedy_logits
from harness.models import AdapterSpec, make_adapter, peft_greedy_logits, peft_reference, write_byte_tokenizer
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.lora import backend as lora_backend
from inference_service.models.qwen3 import Qwen3Model

VOCAB = 160
HEAD_DIM = 32
NEW_TOKENS = 13  # prefill + 12 decode steps
TOL = 1e-4
ADAPTERS = [
    AdapterSpec("r4-qk", 4, 8, ("q_proj", "k_proj"), seed=41),
    AdapterSpec("r8-all", 8, 16, seed=42),
    AdapterSpec("r16-mlp", 16, 32, ("gate_proj", "up_proj", "down_proj", "o_proj"), seed=43),
    AdapterSpec("r8-rslora", 8, 8, ("q_proj", "v_proj", "down_proj"), use_rslora=True, seed=44),
]


def make_qwen3_checkpoint(out: Path, seed: int) -> Path:
    """A tiny random Qwen3 checkpoint with random (not all-ones) q_norm and k_norm weights."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape))
    model.save_pretrained(out)
    write_byte_tokenizer(out / "tokenizer.json")
    return out


@pytest.fixture(scope="module")
def qwen3_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    checkpoint = make_qwen3_checkpoint(root / "model", seed=40)
    adapters = {s.name: make_adapter(checkpoint, root / s.name, s) for s in ADAPTERS}
    gen = torch.Generator().manual_seed(45)
    names: list[str | None] = [*adapters, None, "r4-qk", None]
    prompts = [(f"q{i}", torch.randint(3, VOCAB, (n,), generator=gen).tolist(), names[i])
               for i, n in enumerate([6, 14, 3, 19, 9, 1, 11])]
    return checkpoint, adapters, prompts


@pytest.fixture(scope="module")
def reference(qwen3_setup) -> dict[str, torch.Tensor]:
    """PEFT's greedy generation (fp32, CPU): logits at prefill and each decode step."""
    checkpoint, adapters, prompts = qwen3_setup
    return peft_greedy_logits(checkpoint, adapters, prompts, NEW_TOKENS)


def _engine(checkpoint: Path, adapters: dict[str, Path], prompts,
            **config) -> dict[str, tuple[torch.Tensor, list[int]]]:
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", max_loras=4, max_lora_rank=16,
                                   kv_cache_bytes=4 << 20, **config))
    assert isinstance(core.runner.model, Qwen3Model), "the registry should pick Qwen3 from the architecture"
    return greedy_logits(core, adapters, prompts, NEW_TOKENS)


def test_checkpoint_is_what_the_test_means(qwen3_setup):
    checkpoint, _, _ = qwen3_setup
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and not config.get("attention_bias")
    assert config["head_dim"] == HEAD_DIM != config["hidden_size"] // config["num_attention_heads"]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (HEAD_DIM,)
    assert not any(name.endswith(".bias") for name in tensors)


@pytest.mark.parametrize("op", ["CpuLoRAOp", "TorchLoRAOp"])
def test_mixed_batch_matches_peft(qwen3_setup, reference, op, monkeypatch):
    if op == "CpuLoRAOp" and C_KERNELS_OFF:
        pytest.skip("the C kernels are turned off in this run (LORAPLEX_CPU_KERNELS)")
    if op == "TorchLoRAOp":
        monkeypatch.setattr(lora_backend, "available", lambda dtype: False)
    checkpoint, adapters, prompts = qwen3_setup
    ours = _engine(checkpoint, adapters, prompts)
    for rid, _, adapter in prompts:
        logits, tokens = ours[rid]
        assert logits.shape == reference[rid].shape == (NEW_TOKENS, VOCAB), rid
        diff = (logits - reference[rid]).abs().max().item()
        print(f"MEASURE qwen3 {op} {rid}: max |logit diff| {diff:.2e}")
        assert diff < TOL, f"{rid} ({adapter}, {op}): max |logit diff| {diff}"
        assert tokens == reference[rid].argmax(-1).tolist(), f"{rid}: greedy tokens differ"


def test_chunked_prefill_matches_peft(qwen3_setup, reference):
    """A token budget smaller than the prompts: prefill chunks attend over cached (normed, rotated) keys."""
    checkpoint, adapters, prompts = qwen3_setup
    ours = _engine(checkpoint, adapters, prompts, max_num_batched_tokens=6)
    for rid, _, _ in prompts:
        assert (ours[rid][0] - reference[rid]).abs().max().item() < TOL, rid


def test_adapters_and_qk_norm_change_the_output(qwen3_setup, reference, tmp_path):
    """Guards the comparisons above: each adapter moves the logits, and so does the QK-norm (the same
    weights without q_norm/k_norm, as a LLaMA checkpoint, in the reference)."""
    checkpoint, adapters, prompts = qwen3_setup
    tokens = list(range(3, 12))
    ours = _engine(checkpoint, adapters, [("base", tokens, None)] + [(n, tokens, n) for n in adapters])
    for name in adapters:
        assert (ours[name][0][0] - ours["base"][0][0]).abs().max() > 1e-2, name

    plain = tmp_path / "llama"
    plain.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (plain / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(checkpoint / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.endswith(("q_norm.weight", "k_norm.weight"))},
              str(plain / "model.safetensors"), metadata={"format": "pt"})
    model = peft_reference(plain, adapters)
    with torch.no_grad():
        for rid, prompt, adapter in prompts:  # over the reference's own continuation (a 1-token prompt
            # attends to itself alone, whatever q and k are)
            ids = prompt + reference[rid].argmax(-1).tolist()[:-1]
            logits = model(input_ids=torch.tensor([ids]), adapter_names=[adapter or "__base__"]).logits[0]
            moved = (logits[len(prompt) - 1 :] - reference[rid]).abs().max().item()
            print(f"MEASURE qwen3 {rid}: without QK-norm {moved:.4f}")
            assert moved > 100 * TOL, f"{rid}: QK-norm moves the logits by only {moved}"
