"""The batched multi-LoRA engine against transformers + PEFT on the same tiny checkpoints.

One mixed batch: 4 adapters (ranks 4, 8, 16; one rsLoRA; different target modules) plus
base-model requests, prompts of different lengths; logits within 1e-4 (fp32) at prefill and for
16 decode steps, greedy token ids identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.engine_helpers import load_adapters, run_to_completion
from harness.models import AdapterSpec, make_adapter, make_checkpoint, peft_reference
from inference_service.config import EngineConfig
from inference_service.engine_core import EngineCore
from inference_service.request import Request, SamplingParams

ADAPTERS = [
    AdapterSpec("r4-attn", 4, 8, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("r8-all", 8, 16, seed=2),
    AdapterSpec("r16-mlp", 16, 32, ("gate_proj", "up_proj", "down_proj", "o_proj"), seed=3),
    AdapterSpec("r16-rslora", 16, 16, use_rslora=True, seed=4),
]
NEW_TOKENS = 17  # prefill + 16 decode steps
TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def family_setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = make_checkpoint(root / "model", request.param)
    adapters = {s.name: make_adapter(checkpoint, root / s.name, s) for s in ADAPTERS}
    return checkpoint, adapters


def _prompts(vocab: int) -> list[tuple[str, list[int], str | None]]:
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 11, 3, 17, 8, 1, 13]
    names: list[str | None] = [s.name for s in ADAPTERS] + [None, None, ADAPTERS[1].name]
    return [
        (f"req{i}", torch.randint(3, vocab, (n,), generator=gen).tolist(), names[i])
        for i, n in enumerate(lengths)
    ]


def _engine_logits(checkpoint: Path, adapters: dict[str, Path], prompts, **config) -> dict[str, torch.Tensor]:
    core = EngineCore(EngineConfig(model=str(checkpoint), max_loras=4, max_lora_rank=16,
                                   kv_cache_bytes=4 << 20, **config))
    load_adapters(core, adapters)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True)
    for rid, tokens, adapter in prompts:
        core.add_request(Request(rid, tokens, params), adapter)
    outputs = run_to_completion(core)
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    return {rid: torch.stack([x for o in outs for x in (o.logits or [])]) for rid, outs in outputs.items()}


def _reference_logits(checkpoint: Path, adapters: dict[str, Path], prompts) -> dict[str, torch.Tensor]:
    model = peft_reference(checkpoint, adapters)
    result = {}
    with torch.no_grad():
        for rid, tokens, adapter in prompts:
            out = model.generate(
                torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                adapter_names=[adapter or "__base__"], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
            )
            result[rid] = torch.cat(out.logits).float()
    return result


def test_mixed_batch_matches_peft(family_setup):
    checkpoint, adapters = family_setup
    prompts = _prompts(160)
    ours = _engine_logits(checkpoint, adapters, prompts)
    ref = _reference_logits(checkpoint, adapters, prompts)
    for rid, _, adapter in prompts:
        assert ours[rid].shape == ref[rid].shape == (NEW_TOKENS, 160), rid
        diff = (ours[rid] - ref[rid]).abs().max().item()
        assert diff < TOL, f"{rid} ({adapter}): max |logit diff| {diff}"
        assert torch.equal(ours[rid].argmax(-1), ref[rid].argmax(-1)), f"{rid}: greedy tokens differ"


def test_adapters_change_the_output(family_setup):
    """Guards the comparison above against a LoRA path that silently does nothing."""
    checkpoint, adapters = family_setup
    tokens = list(range(3, 12))
    prompts = [("base", tokens, None)] + [(name, tokens, name) for name in adapters]
    ours = _engine_logits(checkpoint, adapters, prompts)
    for name in adapters:
        assert (ours[name][0] - ours["base"][0]).abs().max() > 1e-2, name


def test_chunked_prefill_matches_peft(family_setup):
    """A token budget smaller than the prompts forces prefill in chunks over cached KV."""
    checkpoint, adapters = family_setup
    prompts = _prompts(160)
    ours = _engine_logits(checkpoint, adapters, prompts, max_num_batched_tokens=6)
    ref = _reference_logits(checkpoint, adapters, prompts)
    for rid, _, _ in prompts:
        assert (ours[rid] - ref[rid]).abs().max().item() < TOL, rid


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    checkpoint = make_checkpoint(tmp_path / "sharded", "llama", seed=3, max_shard_size="60KB")
    assert (checkpoint / "model.safetensors.index.json").is_file()
    assert len(list(checkpoint.glob("*.safetensors"))) > 1
    adapter = make_adapter(checkpoint, tmp_path / "a", AdapterSpec("a", 8, 16, seed=9))
    prompts = [("x", [5, 9, 33, 7], "a"), ("y", [4, 4, 4, 4, 4, 4], None)]
    ours = _engine_logits(checkpoint, {"a": adapter}, prompts)
    ref = _reference_logits(checkpoint, {"a": adapter}, prompts)
    for rid, _, _ in prompts:
        assert (ours[rid] - ref[rid]).abs().max().item() < TOL


def test_bfloat16_engine_with_fp32_cpu_slots_tracks_peft(family_setup):
    """A bf16 model (its LoRA slots stay fp32 on CPU, see `lora_slot_dtype`): prefill logits stay
    within bf16 error of the fp32 reference (up to 0.033 seen, on logits of magnitude ~0.5), far
    below what each adapter moves them by (0.5 to 0.8)."""
    checkpoint, adapters = family_setup
    prompts = _prompts(160)
    ours = _engine_logits(checkpoint, adapters, prompts, dtype="bfloat16")
    ref = _reference_logits(checkpoint, adapters, prompts)
    for rid, _, adapter in prompts:
        diff = (ours[rid][0].float() - ref[rid][0]).abs().max().item()
        assert diff < 0.08, f"{rid} ({adapter}): max |prefill logit diff| {diff}"
    base = _engine_logits(checkpoint, {}, [(rid, t, None) for rid, t, _ in prompts], dtype="bfloat16")
    for rid, _, adapter in prompts:
        if adapter is not None:
            assert (ours[rid][0].float() - base[rid][0].float()).abs().max() > 0.3, rid
