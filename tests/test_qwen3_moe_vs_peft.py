"""Qwen3-MoE, served through the model registry, against transformers + PEFT on a tiny random
Qwen3-MoE checkpoint (8 experts, top-2, norm_topk_prob, QK-norm; a random router so rows spread over
the experts).

One mixed batch: adapters of ranks 4, 8 and 16 on attention only, on the experts only (PEFT's
`target_parameters` on the stacked experts), on both, on one expert projection only, on the experts
named as modules (which PEFT saves as target_parameters with rank/alpha patterns), plus base-model
rows; logits within 1e-4 (fp32) at prefill and 12 decode steps, greedy tokens identical, on both CPU
LoRA ops, with chunked prefill, prefix-cache hits and preemption; bf16 tracks PEFT. An adapter in
the per-expert layout (one Linear per expert, as PEFT saved them before transformers stacked the
experts) that covers only some experts is served like the stacked adapter with those experts' LoRA
zeroed. Router LoRA is refused with
INVALID_ARGUMENT; an expert adapter on a dense base model with FAILED_PRECONDITION.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_cache.adapter_format import load_adapter_dir
from adapter_cache.errors import AdapterError, AdapterIncompatibleError
from harness.devices import C_KERNELS_OFF
from harness.engine_helpers import greedy_logits, load_adapters, run_to_completion
from harness.gguf_files import write_gguf
from harness.models import AdapterSpec, make_adapter, make_checkpoint, write_byte_tokenizer
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.kv_cache import kv_bytes_per_block
from inference_service.engine.request import Request, SamplingParams
from inference_service.lora import backend as lora_backend
from inference_service.lora.ops import TorchLoRAOp, build_lora_batch
from inference_service.lora.step_buffers import ExpertStepBuffers, LoRAStepBuffers
from inference_service.models.config import ModelConfig
from inference_service.models.fused_ops import TorchFusedOps
from inference_service.models.gguf import GGUFFile
from inference_service.models.qwen3_moe import Qwen3MoeModel, SparseMoE

VOCAB = 160
EXPERTS = 8
NEW_TOKENS = 13  # prefill + 12 decode steps
TOL = 1e-4
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
STACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = [
    AdapterSpec("r4-attn", 4, 8, ATTENTION, seed=61),
    AdapterSpec("r8-experts", 8, 16, ("o_proj",), seed=62, options={"target_parameters": STACKED}),
    AdapterSpec("r16-all", 16, 32, ATTENTION, use_rslora=True, seed=63, options={"target_parameters": STACKED}),
    AdapterSpec("r8-down", 8, 8, ("v_proj",), seed=64, options={"target_parameters": ["experts.down_proj"]}),
    # Expert projections named as modules: PEFT turns them into target_parameters, gate_up_proj at rank
    # 2r with alpha 2·alpha through rank_pattern/alpha_pattern.
    AdapterSpec("r4-by-name", 4, 12, ("q_proj", "gate_proj", "up_proj", "down_proj"), seed=66),
]
SOME_EXPERTS = (0, 2, 5)  # the per-expert adapter's experts (of "r8-experts")


def make_moe_checkpoint(out: Path, seed: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1.0 + 0.5 * torch.randn(param.shape))
            elif name.endswith("mlp.gate.weight"):  # the router: rows spread over the experts, and
                param.normal_(0.0, 0.15)  # each row's second expert weighs in (no near one-hot routing)
            elif ".mlp.experts." in name:  # experts that move the logits well beyond the tolerance
                param.normal_(0.0, 0.1)
    model.save_pretrained(out)
    write_byte_tokenizer(out / "tokenizer.json")
    return out


def per_expert_adapter(stacked: Path, out: Path, experts: tuple[int, ...]) -> Path:
    """`stacked` (target_parameters on gate_up and down) as one Linear per expert, keeping `experts`."""
    config = json.loads((stacked / "adapter_config.json").read_text())
    tensors = load_file(str(stacked / "adapter_model.safetensors"))
    result = {}
    for key, tensor in tensors.items():
        if ".mlp.experts." not in key:
            result[key] = tensor
            continue
        prefix, which = key.split(".mlp.experts.")[0], key.split(".")[-2]
        wrapped_gate_up = ".base_layer." in key
        parts = ("gate_proj", "up_proj") if wrapped_gate_up else ("down_proj",)
        rank = config["r"]
        for e in experts:
            for i, part in enumerate(parts):
                if which == "lora_A":
                    value = tensor[e * rank : (e + 1) * rank]
                else:
                    b = tensor[:, e::EXPERTS]
                    value = b.chunk(len(parts))[i]
                result[f"{prefix}.mlp.experts.{e}.{part}.{which}.weight"] = value.clone()
    config.update(target_parameters=None, target_modules=[*config["target_modules"], "gate_proj", "up_proj",
                                                              "down_proj"])
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(result, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def zero_other_experts(stacked: Path, out: Path, experts: tuple[int, ...]) -> Path:
    """`stacked` with every expert's LoRA but `experts` zeroed (PEFT's form of the same adapter)."""
    config = json.loads((stacked / "adapter_config.json").read_text())
    tensors = load_file(str(stacked / "adapter_model.safetensors"))
    rank = config["r"]
    for key, tensor in tensors.items():
        if ".mlp.experts." in key and key.endswith("lora_A.weight"):
            for e in set(range(EXPERTS)) - set(experts):
                tensor[e * rank : (e + 1) * rank] = 0.0
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_moe")
    checkpoint = make_moe_checkpoint(root / "model", seed=60)
    adapters = {s.name: make_adapter(checkpoint, root / s.name, s) for s in ADAPTERS}
    gen = torch.Generator().manual_seed(65)
    names: list[str | None] = [*adapters, None, "r4-attn", None]
    prompts = [(f"q{i}", torch.randint(3, VOCAB, (n,), generator=gen).tolist(), names[i])
               for i, n in enumerate([6, 14, 3, 19, 9, 8, 1, 11])]
    return checkpoint, adapters, prompts


def peft_logits(checkpoint: Path, adapters: dict[str, Path], prompts, new_tokens: int) -> dict[str, torch.Tensor]:
    """PEFT's greedy generation (fp32, CPU), one PeftModel per adapter (PEFT takes one set of
    target_parameters per model) and the plain model for base rows."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = {}
    for name in {adapter for _, _, adapter in prompts}:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name]))
        model.eval()
        with torch.no_grad():
            for rid, tokens, adapter in prompts:
                if adapter != name:
                    continue
                out = model.generate(
                    torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=0)
                result[rid] = torch.cat(out.logits).float()
    return result


@pytest.fixture(scope="module")
def reference(moe_setup) -> dict[str, torch.Tensor]:
    checkpoint, adapters, prompts = moe_setup
    return peft_logits(checkpoint, adapters, prompts, NEW_TOKENS)


def _engine(checkpoint: Path, adapters: dict[str, Path], prompts,
            **config) -> dict[str, tuple[torch.Tensor, list[int]]]:
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", max_loras=5, max_lora_rank=16,
                                   kv_cache_bytes=4 << 20, **config))
    assert isinstance(core.runner.model, Qwen3MoeModel), "the registry should pick Qwen3-MoE from the architecture"
    return greedy_logits(core, adapters, prompts, NEW_TOKENS)


def _assert_matches(ours, reference, prompts, what: str) -> None:
    for rid, _, adapter in prompts:
        logits, tokens = ours[rid]
        assert logits.shape == reference[rid].shape == (NEW_TOKENS, VOCAB), rid
        diff = (logits - reference[rid]).abs().max().item()
        print(f"MEASURE qwen3-moe {what} {rid} ({adapter}): max |logit diff| {diff:.2e}")
        assert diff < TOL, f"{rid} ({adapter}, {what}): max |logit diff| {diff}"
        assert tokens == reference[rid].argmax(-1).tolist(), f"{rid}: greedy tokens differ"


def test_rows_spread_over_the_experts(moe_setup):
    """Guards the comparisons: the prompts' rows reach every expert of the first layer, and the
    second of each row's two experts matters."""
    from transformers import AutoModelForCausalLM

    checkpoint, _, prompts = moe_setup
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([t for _, tokens, _ in prompts for t in tokens])
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        _, weights, experts = model.model.layers[0].mlp.gate(hidden)
    assert set(experts.reshape(-1).tolist()) == set(range(EXPERTS))
    assert weights[:, 1].mean() > 0.3, "each row's second expert should weigh in"


@pytest.mark.parametrize("op", ["CpuLoRAOp", "TorchLoRAOp"])
def test_mixed_batch_matches_peft(moe_setup, reference, op, monkeypatch):
    if op == "CpuLoRAOp" and C_KERNELS_OFF:
        pytest.skip("the C kernels are turned off in this run (LORAPLEX_CPU_KERNELS)")
    if op == "TorchLoRAOp":
        monkeypatch.setattr(lora_backend, "available", lambda dtype: False)
    checkpoint, adapters, prompts = moe_setup
    _assert_matches(_engine(checkpoint, adapters, prompts), reference, prompts, op)


def test_chunked_prefill_matches_peft(moe_setup, reference):
    checkpoint, adapters, prompts = moe_setup
    ours = _engine(checkpoint, adapters, prompts, max_num_batched_tokens=6)
    for rid, _, _ in prompts:
        assert (ours[rid][0] - reference[rid]).abs().max().item() < TOL, rid


def test_expert_lora_groupings_live_in_the_managers_static_buffers(moe_setup, reference, monkeypatch):
    """Every MoE layer of every step (prefill and decode, chunked) groups its (token, expert) pairs in
    the LoRA manager's expert buffers, written in place: one storage for all of them, allocated once,
    and the logits still PEFT's."""
    seen: set[tuple[int, int, int]] = set()
    calls = []
    group = ExpertStepBuffers.group

    def recording(self, lora, token_of_pair, expert_of_pair):  # observes the real method, changes nothing
        batch = group(self, lora, token_of_pair, expert_of_pair)
        seen.add((batch.pages.data_ptr(), batch.runs.data_ptr(), batch.run_pages.data_ptr()))
        calls.append(token_of_pair.shape[0])
        return batch

    monkeypatch.setattr(ExpertStepBuffers, "group", recording)
    checkpoint, adapters, prompts = moe_setup
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", max_loras=5, max_lora_rank=16,
                                   kv_cache_bytes=4 << 20, max_num_batched_tokens=16))
    buffers = core.lora.expert_step_buffers(16, 2)
    assert all(layer.feed_forward.expert_lora is buffers for layer in core.runner.model.layers)
    storage = (buffers.pair_pages.data_ptr(), buffers.runs.data_ptr(), buffers.pair_pages.data_ptr())
    _assert_matches(greedy_logits(core, adapters, prompts, NEW_TOKENS), reference, prompts, "expert buffers")
    assert len(calls) >= 2 * NEW_TOKENS and len(set(calls)) > 1, "steps of different sizes, each layer grouped"
    assert seen == {storage}


def test_experts_run_one_matmul_each_over_their_rows(moe_setup, monkeypatch):
    """The MoE block groups by expert: one gate/up and one down matmul per expert that some row chose,
    over all of its rows (never one per token), and the result is the per-token sum of its experts'
    outputs weighted by the renormalised router weights."""
    checkpoint, _, _ = moe_setup
    config = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))
    torch.manual_seed(5)
    moe = SparseMoE(config, torch.device("cpu"), torch.float32, TorchFusedOps())
    for param in (moe.router, moe.gate_up, moe.down):
        param.data.normal_(0.0, 0.2)
    x = torch.randn(40, config.hidden_size)
    rows: list[int] = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, out=None: rows.append(a.shape[0]) or mm(a, b, out=out))
    out = moe(x, TorchLoRAOp(torch.device("cpu")), None)
    monkeypatch.undo()
    weights, experts = moe.route(x)
    assert len(rows) == 2 * experts.unique().numel() and sum(rows) == 2 * x.shape[0] * config.num_experts_per_tok
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t].tolist(), strict=True):
            gate, up = (moe.gate_up[e] @ x[t]).chunk(2)
            expected[t] += w * (moe.down[e] @ (torch.nn.functional.silu(gate) * up))
    assert (out - expected).abs().max() < 1e-5


def test_decode_graphs_asked_for_run_uncaptured_and_exact(moe_setup, reference):
    """decode_graphs on: an MoE model's steps run uncaptured (its layer reads the experts' row counts
    on the host, which a captured step cannot), with PEFT's logits, rather than failing to capture."""
    checkpoint, adapters, prompts = moe_setup
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", max_loras=5, max_lora_rank=16,
                                   kv_cache_bytes=4 << 20, decode_graphs="on"))
    assert core.runner.graphs is None
    _assert_matches(greedy_logits(core, adapters, prompts, NEW_TOKENS), reference, prompts, "decode graphs on")


def test_expert_grouping_from_static_step_buffers_equals_the_per_step_batch():
    """The grouping reads a step's runs whichever way the batch was built: the per-step batch
    (`build_lora_batch`) and the static decode-step buffers (with padding rows and unused runs)
    give every pair the same pages and rank."""
    page_rank, zero_page, max_pages, per_expert = 4, 9, 3, 10
    slots = [-1, 0, 0, 5, -1, 5, 2]
    slot_pages = {0: (0, 1, 2), 5: (5,), 2: (2, 3)}
    ranks = {0: 12, 5: 3, 2: 6}
    per_step = build_lora_batch(slots, slot_pages, ranks, page_rank, zero_page, torch.device("cpu"))
    static = LoRAStepBuffers(8, max_pages, page_rank, zero_page, torch.device("cpu"))
    static.fill([(slot_pages[s], ranks[s]) if s >= 0 else ((), 0) for s in slots])
    experts = ExpertStepBuffers(8, 2, max_pages, page_rank, zero_page, per_expert, torch.device("cpu"))
    token_of_pair = torch.tensor([0, 3, 6, 1, 2, 5, 4, 0, 3, 6, 1, 2, 5, 4])
    expert_of_pair = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3])
    results = []
    for batch, rows in ((per_step, 7), (static.batch(8), 8)):
        pairs = experts.group(batch, token_of_pair, expert_of_pair)
        results.append((pairs.pages.clone(), pairs.runs.clone()))
        assert pairs.num_groups == 14 and experts.token_ranks[:rows].tolist()[:7] == [
            ranks.get(s, 0) for s in slots]
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    pages, runs = results[0]
    expected = [[p + e * per_expert for p in (*slot_pages.get(slots[t], ()), *[zero_page] * max_pages)[:max_pages]]
                for t, e in zip(token_of_pair.tolist(), expert_of_pair.tolist(), strict=True)]
    assert pages.tolist() == expected
    assert runs[:, 3].tolist() == [ranks.get(slots[t], 0) for t in token_of_pair.tolist()]


def test_gguf_file_serves_the_safetensors_logits(moe_setup, tmp_path):
    """The checkpoint converted to a qwen3moe GGUF file as llama.cpp's converter writes it (experts
    stacked in ffn_{gate,up,down}_exps, the router in ffn_gate_inp, QK-norms in attn_{q,k}_norm):
    served with the same adapters, the same logits as the safetensors checkpoint."""
    checkpoint, adapters, prompts = moe_setup
    path = write_gguf(checkpoint, tmp_path / "moe.gguf", "F32")
    from_file = EngineCore(EngineConfig(model=str(path), device="cpu", max_loras=5, max_lora_rank=16,
                                        kv_cache_bytes=4 << 20, tokenizer="byte"))
    assert isinstance(from_file.runner.model, Qwen3MoeModel)
    ours = greedy_logits(from_file, adapters, prompts, NEW_TOKENS)
    theirs = _engine(checkpoint, adapters, prompts)
    for rid, _, _ in prompts:
        assert (ours[rid][0] - theirs[rid][0]).abs().max().item() < 1e-5, rid
        assert ours[rid][1] == theirs[rid][1], rid


def test_dense_qwen3_gguf_serves_the_safetensors_logits(tmp_path):
    """Dense Qwen3 as a GGUF file (QK-norms as attn_q_norm/attn_k_norm, q/k rows unpermuted as
    llama.cpp keeps them for this architecture): the safetensors checkpoint's logits."""
    checkpoint = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=3)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    for name in tensors:
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            tensors[name] = 1.0 + 0.5 * torch.randn(tensors[name].shape)
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    path = write_gguf(checkpoint, tmp_path / "qwen3.gguf", "F32")
    prompts = [("a", list(range(5, 17)), None), ("b", [7, 3, 99, 150], None)]
    ours = greedy_logits(EngineCore(EngineConfig(model=str(path), device="cpu", kv_cache_bytes=4 << 20,
                                                 tokenizer="byte")), {}, prompts, 6)
    theirs = greedy_logits(EngineCore(EngineConfig(model=str(checkpoint), device="cpu", kv_cache_bytes=4 << 20)),
                           {}, prompts, 6)
    for rid, _, _ in prompts:
        assert (ours[rid][0] - theirs[rid][0]).abs().max().item() < 1e-5 and ours[rid][1] == theirs[rid][1], rid


def test_gguf_quantized_experts_read_each_experts_blocks(moe_setup, tmp_path):
    """A Q8_0 file's stacked expert tensor: each expert's weight is that expert's blocks dequantized
    (served dense), within Q8_0's step of the checkpoint's."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    checkpoint, _, _ = moe_setup
    file = GGUFFile(write_gguf(checkpoint, tmp_path / "moe-q8.gguf", "Q8_0"))
    weights = file.state_dict("bf16")
    stacked = file.tensors["blk.1.ffn_up_exps.weight"]
    assert GGMLQuantizationType(stacked.type_id) == GGMLQuantizationType.Q8_0
    whole = dequantize(stacked.data, GGMLQuantizationType.Q8_0).reshape(EXPERTS, 48, 64)
    original = load_file(str(checkpoint / "model.safetensors"))
    for e in (0, 5, 7):
        name = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
        assert name in weights and weights.quantized(name) is None
        assert torch.equal(weights[name], torch.from_numpy(whole[e]))
        assert (weights[name] - original[name]).abs().max() < original[name].abs().max() / 100
    assert ModelConfig.from_hf(file.hf_config()).num_experts_per_tok == 2


def _serve(core: EngineCore, batch) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Each request's logits at every step and how many prompt tokens it found cached."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logits=True)
    for rid, tokens, adapter in batch:
        core.add_request(Request(rid, tokens, params), adapter)
    outs = run_to_completion(core)
    return ({rid: torch.stack([x.cpu() for o in out for x in (o.logits or [])]) for rid, out in outs.items()},
            {rid: out[-1].cached_tokens for rid, out in outs.items()})


def _core(checkpoint: Path, adapters: dict[str, Path], **config) -> EngineCore:
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", max_loras=5, max_lora_rank=16,
                                   block_size=4, **config))
    load_adapters(core, adapters)
    return core


def test_prefix_cache_hits_match_peft(moe_setup, reference):
    """Each prompt sent again after it ran: served from the prefix cache (4-token blocks, cached but
    its last token), logits as PEFT's."""
    checkpoint, adapters, prompts = moe_setup
    core = _core(checkpoint, adapters, kv_cache_bytes=4 << 20)
    _serve(core, prompts)
    logits, cached = _serve(core, [(f"{rid}-again", tokens, adapter) for rid, tokens, adapter in prompts])
    for rid, tokens, _ in prompts:
        assert cached[f"{rid}-again"] == (len(tokens) - 1) // 4 * 4, rid
        assert (logits[f"{rid}-again"] - reference[rid]).abs().max().item() < TOL, rid
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    core.shutdown()


def test_preempted_requests_match_peft(moe_setup, reference):
    """A KV cache of 10 blocks of 4 for eight requests of up to 32 tokens: requests are preempted and
    recomputed, on their adapters, with logits as PEFT's."""
    checkpoint, adapters, prompts = moe_setup
    config = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))
    core = _core(checkpoint, adapters, kv_cache_bytes=10 * kv_bytes_per_block(config, 4, torch.float32),
                 prefix_cache=False)
    logits, _ = _serve(core, prompts)
    assert core.scheduler.num_preemptions > 0
    for rid, _, _ in prompts:
        assert (logits[rid] - reference[rid]).abs().max().item() < TOL, rid
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    core.shutdown()


def _forced_logits(checkpoint: Path, adapters: dict[str, Path], prompts, generated: dict[str, list[int]],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """PEFT's logits (as fp32) in `dtype` at the prompt's last token and each generated one but the
    last, teacher-forced on `generated`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = {}
    for name in {adapter for _, _, adapter in prompts}:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(adapters[name]))
        model.eval()
        with torch.no_grad():
            for rid, tokens, adapter in prompts:
                if adapter == name:
                    ids = tokens + generated[rid][:-1]
                    result[rid] = model(input_ids=torch.tensor([ids])).logits[0, len(tokens) - 1 :].float()
    return result


HALF_FACTOR = 2.5  # as tests/test_engine_vs_peft.py: the bound is bf16's own cost to PEFT, times this


def test_bfloat16_engine_tracks_peft(moe_setup):
    """bf16: per request, the median over its steps of the engine's largest logit distance from PEFT
    in fp32 (teacher-forced on the engine's tokens) is within HALF_FACTOR x the largest such median
    of PEFT in bf16, and that bound is below how far the base model's prefill is from an adapter's.

    Medians, not maxima: in bf16 a row whose two best router probabilities nearly tie can pick a
    different second expert, which moves that one step's logits by ~0.2-0.6 (measured: PEFT in bf16
    did so at one step of one request, the engine at one step of two others; every other step of
    both stays within ~0.05). Which rows flip depends on rounding order, not on a fault."""
    checkpoint, adapters, prompts = moe_setup
    ours = _engine(checkpoint, adapters, prompts, dtype="bfloat16")
    generated = {rid: tokens for rid, (_, tokens) in ours.items()}
    ref = _forced_logits(checkpoint, adapters, prompts, generated, torch.float32)
    ref_half = _forced_logits(checkpoint, adapters, prompts, generated, torch.bfloat16)

    def median_step(logits: torch.Tensor, rid: str) -> float:
        return (logits.float() - ref[rid]).abs().amax(-1).median().item()

    bound = HALF_FACTOR * max(median_step(ref_half[rid], rid) for rid, _, _ in prompts)
    for rid, _, adapter in prompts:
        diff = median_step(ours[rid][0], rid)
        print(f"MEASURE qwen3-moe bf16 {rid} ({adapter}): median step diff {diff:.4f} bound {bound:.4f}")
        assert diff < bound, f"{rid} ({adapter}): median step |logit diff| {diff}, bound {bound}"
        if adapter is not None:
            without = (ref[rid][0] - _base_prefill(checkpoint, prompts, rid)).abs().max().item()
            assert without > bound, f"{rid}: without its adapter the prefill is only {without} off, bound {bound}"


def _base_prefill(checkpoint: Path, prompts, rid: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    tokens = next(t for r, t, _ in prompts if r == rid)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_adapters_change_the_output(moe_setup):
    checkpoint, adapters, _ = moe_setup
    tokens = list(range(3, 12))
    ours = _engine(checkpoint, adapters, [("base", tokens, None)] + [(n, tokens, n) for n in adapters])
    for name in adapters:
        assert (ours[name][0][0] - ours["base"][0][0]).abs().max() > 1e-2, name


def test_per_expert_adapter_on_some_experts(moe_setup, tmp_path):
    """One Linear per expert, only some experts targeted: the missing experts' LoRA is zero."""
    checkpoint, adapters, prompts = moe_setup
    some = {"some-experts": per_expert_adapter(adapters["r8-experts"], tmp_path / "some", SOME_EXPERTS)}
    zeroed = {"some-experts": zero_other_experts(adapters["r8-experts"], tmp_path / "zeroed", SOME_EXPERTS)}
    rows = [(rid, tokens, "some-experts") for rid, tokens, _ in prompts[:3]] + [("b", prompts[3][1], None)]
    reference = peft_logits(checkpoint, zeroed, rows, NEW_TOKENS)
    _assert_matches(_engine(checkpoint, some, rows), reference, rows, "per-expert")


def _with_config(adapter: Path, out: Path, **changes) -> Path:
    out.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text()) | changes
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    return out


def test_router_lora_is_refused_as_invalid_argument(moe_setup, tmp_path):
    checkpoint, adapters, _ = moe_setup
    shapes = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text())).lora_shapes()
    router_param = _with_config(adapters["r8-experts"], tmp_path / "p", target_parameters=["mlp.gate.weight"])
    router_module = _with_config(adapters["r4-attn"], tmp_path / "m", target_modules=["q_proj", "gate"])
    for path in (router_param, router_module):
        with pytest.raises(AdapterError, match="router") as info:
            load_adapter_dir(path, shapes, 16)
        assert info.value.code == "INVALID_ARGUMENT"
    tensors = load_file(str(adapters["r4-attn"] / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.mlp.gate.lora_B.weight"] = torch.zeros(EXPERTS, 4)
    router_tensor = _with_config(adapters["r4-attn"], tmp_path / "t")
    save_file(tensors, str(router_tensor / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="router"):
        load_adapter_dir(router_tensor, shapes, 16)


def test_expert_modules_by_name_become_peft_target_parameters(moe_setup):
    """Guards "r4-by-name": PEFT saved it as stacked experts with gate_up at rank 2r (what the mixed
    batch above then serves exactly)."""
    _, adapters, _ = moe_setup
    config = json.loads((adapters["r4-by-name"] / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    assert list(config["rank_pattern"].values()) == [8] and list(config["alpha_pattern"].values()) == [24]


def test_dense_mlp_adapter_on_an_moe_model_is_a_failed_precondition(moe_setup, tmp_path):
    checkpoint, adapters, _ = moe_setup
    shapes = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text())).lora_shapes()
    tensors = load_file(str(adapters["r4-attn"] / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = torch.zeros(48, 4)
    dense_mlp = _with_config(adapters["r4-attn"], tmp_path / "d", target_modules=["q_proj", "gate_proj"])
    save_file(tensors, str(dense_mlp / "adapter_model.safetensors"))
    with pytest.raises(AdapterIncompatibleError, match="gate_proj") as info:
        load_adapter_dir(dense_mlp, shapes, 16)
    assert info.value.code == "FAILED_PRECONDITION"


def test_expert_adapter_on_a_dense_model_is_a_failed_precondition(moe_setup):
    _, adapters, _ = moe_setup
    dense = ModelConfig.from_hf({"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "head_dim": 32}).lora_shapes()
    with pytest.raises(AdapterIncompatibleError, match="experts") as info:
        load_adapter_dir(adapters["r8-experts"], dense, 16)
    assert info.value.code == "FAILED_PRECONDITION"
