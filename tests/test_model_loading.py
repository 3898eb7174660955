"""Model loading: HF checkpoint dirs (with and without tokenizer.json), builtin:tiny determinism,
and the FailedPrecondition errors for checkpoints we cannot serve."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from adapter_cache.errors import FailedPreconditionError
from harness.engine_helpers import run_to_completion
from harness.models import make_checkpoint
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import FinishReason, Request, SamplingParams
from inference_service.models.loader import BUILTIN_TINY, load_model
from inference_service.tokenizer import ByteTokenizer, FileTokenizer

VOCAB = 160  # make_checkpoint's vocab_size; bos 1, eos 2
CPU = torch.device("cpu")


def write_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer over the checkpoint's vocab: [UNK] <s> </s> w0 … w156, BOS prepended."""
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["[UNK]", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny llama checkpoint (with make_checkpoint's byte-level tokenizer.json)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", "llama")


@pytest.fixture
def copy(checkpoint, tmp_path):
    """A writable copy of the checkpoint, to break."""
    def make() -> Path:
        return Path(shutil.copytree(checkpoint, tmp_path / "copy"))
    return make


def engine(model: str, **config: object) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", kv_cache_bytes=4 << 20, **config))


def serve(core: EngineCore, prompt: list[int], params: SamplingParams, rid: str = "r"):
    core.validate(prompt, params)
    core.add_request(Request(rid, prompt, params), None)
    return run_to_completion(core)[rid]


# ---- tokenizers ---------------------------------------------------------------------------------


def test_checkpoint_with_tokenizer_json_uses_it(copy):
    root = copy()
    write_tokenizer(root / "tokenizer.json")
    core = engine(str(root))
    try:
        tok = core.tokenizer
        assert isinstance(tok, FileTokenizer)
        assert tok.vocab_size == VOCAB == core.model_info.vocab_size
        assert tok.eos_token_ids == (2,)  # from config.json, not the tokenizer
        ids = tok.encode("w5 w17 w100")
        assert ids == [1, 8, 20, 103]  # BOS added as the file says
        assert tok.decode(ids) == "w5 w17 w100"  # special tokens skipped
        assert tok.decode([*ids, 2]) == "w5 w17 w100"

        outs = serve(core, ids, SamplingParams(max_new_tokens=12, ignore_eos=True))
        tokens = [t for o in outs for t in o.new_token_ids]
        assert outs[-1].finish_reason is FinishReason.LENGTH and len(tokens) == 12
        assert all(0 <= t < VOCAB for t in tokens)
        # the text as written after the prompt (its separating space included)
        assert "".join(o.text for o in outs) == tok.decode(ids + tokens)[len(tok.decode(ids)):]
    finally:
        core.shutdown()


def test_checkpoint_without_tokenizer_json_is_refused_unless_bytes_are_asked_for(copy):
    root = copy()
    (root / "tokenizer.json").unlink()
    with pytest.raises(FailedPreconditionError, match="no tokenizer.json.*--tokenizer byte"):
        load_model(str(root), CPU, torch.float32)
    model, tok = load_model(str(root), CPU, torch.float32, tokenizer_mode="byte")
    assert isinstance(tok, ByteTokenizer)
    assert model.config.vocab_size == VOCAB and model.config.eos_token_ids == (2,)


def test_builtin_tiny_uses_the_byte_tokenizer():
    model, tok = load_model(BUILTIN_TINY, CPU, torch.float32)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == model.config.vocab_size == 258
    assert tok.eos_token_ids == model.config.eos_token_ids == (257,)
    text = "héllo, wörld €"
    assert tok.decode(tok.encode(text)) == text


# ---- determinism --------------------------------------------------------------------------------


def test_builtin_tiny_is_deterministic_across_loads():
    first, _ = load_model(BUILTIN_TINY, CPU, torch.float32)
    second, _ = load_model(BUILTIN_TINY, CPU, torch.float32)
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    del first, second

    params = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True)
    prompt = [256, *b"determinism"]
    logits = []
    for _ in range(2):
        core = engine(BUILTIN_TINY)
        try:
            outs = serve(core, prompt, params)
            logits.append(torch.stack([x for o in outs for x in (o.logits or [])]))
        finally:
            core.shutdown()
    assert logits[0].shape == (6, 258)
    assert torch.equal(logits[0], logits[1])


# ---- checkpoints we cannot serve ----------------------------------------------------------------


def edit_config(root: Path, **changes: object) -> None:
    path = root / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(root: Path, change) -> None:
    (path,) = root.glob("*.safetensors")
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("model_type", ["gpt2", "gemma", "mixtral", "llama4"])
def test_unsupported_model_type(copy, model_type):
    root = copy()
    edit_config(root, model_type=model_type)
    with pytest.raises(FailedPreconditionError, match="model_type"):
        load_model(str(root), CPU, torch.float32)


@pytest.mark.parametrize("changes, match", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope"),
    (dict(rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.5}), "partial rotary"),
], ids=["gelu", "yarn", "partial-rotary"])
def test_unsupported_architecture_features(copy, changes, match):
    root = copy()
    edit_config(root, **changes)
    with pytest.raises(FailedPreconditionError, match=match):
        load_model(str(root), CPU, torch.float32)


def test_missing_config(tmp_path, checkpoint):
    with pytest.raises(FailedPreconditionError, match="config.json"):
        load_model(str(tmp_path / "nowhere"), CPU, torch.float32)
    shutil.copy(next(checkpoint.glob("*.safetensors")), tmp_path)
    with pytest.raises(FailedPreconditionError, match="config.json"):
        load_model(str(tmp_path), CPU, torch.float32)


def test_missing_weight_files(copy):
    root = copy()
    for path in root.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(FailedPreconditionError, match="safetensors"):
        load_model(str(root), CPU, torch.float32)


def test_missing_one_weight(copy):
    root = copy()
    edit_weights(root, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(FailedPreconditionError, match="k_proj"):
        load_model(str(root), CPU, torch.float32)


def test_missing_shard(copy):
    root = copy()
    (path,) = root.glob("*.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in load_file(str(path))}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    path.rename(root / "model-00001-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FailedPreconditionError, match="model-00002-of-00002"):
        load_model(str(root), CPU, torch.float32)


def test_unused_weights_rejected(copy):
    root = copy()
    edit_weights(root, lambda t: t.update({"model.layers.9.self_attn.q_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(FailedPreconditionError, match="does not use"):
        load_model(str(root), CPU, torch.float32)


def test_engine_surfaces_the_failed_precondition(copy):
    root = copy()
    edit_config(root, model_type="bert")
    with pytest.raises(FailedPreconditionError) as info:
        engine(str(root))
    assert info.value.code == "FAILED_PRECONDITION"


def test_corrupt_weight_file(copy):
    root = copy()
    (path,) = root.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(FailedPreconditionError, match="safetensors"):
        load_model(str(root), CPU, torch.float32)


# ---- memory: LoRA slot buffers first, the KV cache from what is left -------------------------------

def _allocated(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views share one), as allocated."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _sizes(**config: object) -> tuple[int, int, int]:
    """(LoRA slot bytes, KV cache bytes, KV bytes per block) of an engine sized automatically: no
    kv_cache_bytes, so the KV cache gets the budget less the LoRA slots."""
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu", **config))
    try:
        runner = core.runner
        lora = _allocated([t for a, b in runner.lora._pool.buffers.values() for t in (a, b)])
        kv = _allocated([t for pair in runner.kv.layers for t in pair])
        assert lora == runner.lora.slots_nbytes and kv == runner.kv.nbytes  # what the runner sized with
        return lora, kv, runner.kv.nbytes // runner.kv.num_blocks
    finally:
        core.shutdown()


def test_kv_cache_gets_the_budget_less_the_lora_slots():
    """More slots or a larger max rank take their bytes from the KV cache, block for block (the
    default budget, from the machine's memory: tests/test_memory_budget.py)."""
    total = budget = 24 << 20
    sizes = {(slots, rank): _sizes(max_loras=slots, max_lora_rank=rank, memory_budget_bytes=budget)
             for slots, rank in [(1, 8), (4, 8), (4, 64), (16, 64)]}
    for (slots, rank), (lora, kv, per_block) in sizes.items():
        left = total - lora - kv
        assert 0 <= left < per_block, f"{slots} x rank {rank}: {lora} B LoRA + {kv} B KV of {total} B"
    small_lora, small_kv, per_block = sizes[(1, 8)]
    for lora, kv, _ in sizes.values():
        if lora > small_lora:
            assert kv < small_kv
        # within one block's rounding of each: the KV cache lost exactly what the slots took
        assert abs((small_kv - kv) - (lora - small_lora)) < per_block
    assert sizes[(16, 64)][0] > 8 * sizes[(1, 8)][0]  # the comparison spans a real difference


def test_lora_slots_that_leave_no_kv_block_are_refused():
    lora, _, per_block = _sizes(max_loras=4, max_lora_rank=64, memory_budget_bytes=64 << 20)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        _sizes(max_loras=4, max_lora_rank=64, memory_budget_bytes=lora + per_block - 1)
    assert _sizes(max_loras=4, max_lora_rank=64, memory_budget_bytes=lora + per_block)[1] == per_block
