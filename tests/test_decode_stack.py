"""The decode stack (a LLaMA decode step in one C call, models/decode_stack.py, the runner's fast path)
against the layer forward it replaces: the same logits bit for bit, step by step in a real engine with
adapters, and the layer forward wherever the stack cannot run or the platform plan turns it off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.adapters import write_tiny_adapter
from harness.engine_helpers import load_adapters, run_to_completion
from harness.platform import plan_for
from harness.real_model import require_real_model
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.model_runner import ModelRunner, padded_tables
from inference_service.engine.request import Request, SamplingParams
from inference_service.kernels import amx_linear, avx2_linear, bf16_linear
from inference_service.lora.ops import TorchLoRAOp
from inference_service.models import registry
from inference_service.models.batch import ForwardBatch
from inference_service.models.config import ModelConfig
from inference_service.models.loader import BUILTIN_TINY
from inference_service.platform import Platform

# A stack is built on C-callable projections: AMX's and AVX-512 BF16's in bf16, the AVX2 kernel's in bf16
# and fp32 (none on oneDNN's). Each is tested wherever its instructions exist, whether or not this CPU
# prefers it (tests/test_model_kernels.py tests the preference).
each_stack = pytest.mark.parametrize(("kernel", "dtype"), [("amx", "bfloat16"), ("bf16", "bfloat16"),
                                                           ("avx2", "bfloat16"), ("avx2", "float32")])


def use_kernel(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """The model's projections on `kernel` ("amx", "bf16" or "avx2"); a skip only where its instructions
    are absent."""
    if kernel == "amx":
        if not amx_linear.available():
            pytest.skip("no AMX on this CPU (or no compiler)")
        return
    if kernel == "bf16":
        if not bf16_linear.available():
            pytest.skip("no AVX-512 BF16 on this CPU (or no compiler)")
        monkeypatch.setattr(amx_linear, "available", lambda: False)
        return
    if not avx2_linear.available():
        pytest.skip("no AVX2 and FMA on this CPU (or no compiler)")
    monkeypatch.setattr(avx2_linear, "preferred", lambda: True)
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    monkeypatch.setattr(bf16_linear, "available", lambda: False)


def use_any_kernel(monkeypatch: pytest.MonkeyPatch) -> bool:
    """The projections on a kernel a stack can call, AMX's where it runs, else AVX-512 BF16's, else the
    AVX2 kernel; False where none runs."""
    if amx_linear.available() or bf16_linear.available():
        return True
    if avx2_linear.available():
        use_kernel(monkeypatch, "avx2")
        return True
    return False


class BothPaths:
    """Wraps the runner's pass through the layers (`ModelRunner.hidden`, the LM head's input): each step
    runs the model's layer forward, then the decode stack, and records whether the stack ran and whether
    the two LM head inputs (hence the logits) are equal bit for bit."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.stack_steps = self.layer_steps = 0
        self.mismatches: list[float] = []
        runner.hidden = self  # type: ignore[method-assign]

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        kv_caches, stack = self.runner.kv.layers, self.runner.decode_stack
        reference = self.runner.model.hidden(batch, kv_caches)
        hidden = stack.hidden(batch, kv_caches) if stack is not None else None  # the step's K/V rewritten alike
        if hidden is None:
            self.layer_steps += 1
            return reference
        self.stack_steps += 1
        if not torch.equal(hidden, reference):
            self.mismatches.append((hidden.float() - reference.float()).abs().max().item())
        return hidden


def run_mixed(core: EngineCore, names: list[str | None], prompts: list[list[int]], new_tokens: int) -> None:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", prompt, params), names[i % len(names)])
    run_to_completion(core)


def tiny_engine(tmp_path: Path, dtype: str = "bfloat16", **settings: str) -> tuple[EngineCore, list[str | None]]:
    adapters = {"a": write_tiny_adapter(tmp_path / "a", seed=1, rank=4),
                "b": write_tiny_adapter(tmp_path / "b", seed=2, rank=8)}
    core = EngineCore(EngineConfig(model=BUILTIN_TINY, device="cpu", dtype=dtype, max_num_seqs=8, max_loras=2,
                                   max_lora_rank=8, **settings))
    load_adapters(core, adapters, preload=True)
    return core, [None, *adapters]


@each_stack
def test_stack_logits_equal_the_layer_forward_with_adapters(monkeypatch, tmp_path, kernel, dtype):
    """builtin:tiny (head_dim 32: the portable attention kernel), base and two adapters of ranks 4
    and 8 in one batch, prompts of different lengths: every decode step's logits bit for bit."""
    use_kernel(monkeypatch, kernel)
    core, names = tiny_engine(tmp_path, dtype)
    both = BothPaths(core.runner)
    run_mixed(core, names, [list(range(3, 3 + 5 * i + 1)) for i in range(6)], 24)
    core.shutdown()
    assert both.stack_steps >= 20 and both.layer_steps >= 1  # decodes in C, the prefill in Python
    assert both.mismatches == []


@each_stack
def test_stack_logits_equal_the_layer_forward_with_biases(monkeypatch, tmp_path, kernel, dtype):
    """A checkpoint with biases on every projection (Qwen2's q/k/v, `mlp_bias`), random, with an
    adapter: the stack adds each bias where the packed projection does."""
    use_kernel(monkeypatch, kernel)
    from safetensors.torch import load_file, save_file

    from harness.models import AdapterSpec, make_adapter, make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "model", "llama", seed=5, attention_bias=True, mlp_bias=True)
    (weights,) = checkpoint.glob("*.safetensors")
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(6)
    biases = [name for name in tensors if name.endswith(".bias")]
    tensors.update({name: torch.randn(tensors[name].shape, generator=gen) for name in biases})
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert len(biases) == 2 * 7
    adapter = make_adapter(checkpoint, tmp_path / "r8", AdapterSpec("r8", 8, 16, seed=7))
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", dtype=dtype, max_loras=1,
                                   max_lora_rank=8, kv_cache_bytes=4 << 20))
    assert core.runner.model.layers[0].qkv.bias is not None
    load_adapters(core, {"r8": adapter}, preload=True)
    both = BothPaths(core.runner)
    run_mixed(core, [None, "r8"], [[5, 9, 14], [3, 4, 5, 6, 7, 8], [20, 21]], 10)
    run_mixed(core, [None], [[5, 9, 14], [30, 31]], 6)  # base-model steps alone
    core.shutdown()
    assert both.stack_steps >= 14 and both.mismatches == []


@pytest.mark.parametrize("kernel", ["amx", "bf16", "avx2"])
def test_stack_logits_equal_the_layer_forward_on_the_real_model(monkeypatch, tmp_path, kernel):
    """SmolLM2 (head_dim 64: the AMX attention kernel where the CPU has AMX), 30 layers, bf16, base and
    two PEFT adapters on all seven modules (r8 and r16), one batch."""
    from inference_service.demo_adapters import write_peft_adapter

    use_kernel(monkeypatch, kernel)
    path = require_real_model()
    core = EngineCore(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", max_num_seqs=8,
                                   max_loras=2, max_lora_rank=16))
    config = core.runner.model.config
    adapters = {f"r{rank}": write_peft_adapter(tmp_path / f"r{rank}", config, rank=rank, alpha=16.0, seed=rank,
                                               scale=0.05) for rank in (16, 8)}
    load_adapters(core, adapters, preload=True)
    both = BothPaths(core.runner)
    run_mixed(core, [None, *adapters], [list(range(100, 100 + 7 * i + 3)) for i in range(6)], 12)
    run_mixed(core, [None], [list(range(200, 200 + 9 * i + 5)) for i in range(4)], 6)  # base model alone
    core.shutdown()
    assert both.stack_steps >= 15 and both.mismatches == []


def decode_stack_row(core: EngineCore) -> str:
    return dict(core.model_info.platform)["decode stack"]


def test_stack_is_not_built_where_its_kernels_do_not_run(monkeypatch, tmp_path):
    """Projections on oneDNN (AMX and AVX2 forced off, fp32 and bf16) and `--decode-stack off` keep the
    layer forward, and the platform plan says why."""
    monkeypatch.setattr(avx2_linear, "available", lambda: False)  # an AVX-512 CPU without AMX or AVX-512 BF16
    monkeypatch.setattr(bf16_linear, "available", lambda: False)
    core, names = tiny_engine(tmp_path, "float32")
    run_mixed(core, names, [[3, 4, 5]], 2)
    assert core.runner.decode_stack is None
    assert decode_stack_row(core) in ("off (the projections are not all packed for one C kernel)",
                                      "off (its C kernels are not all in use here)")  # (none load here)
    core.shutdown()
    monkeypatch.setattr(amx_linear, "available", lambda: False)
    core, names = tiny_engine(tmp_path / "onednn")
    assert core.runner.decode_stack is None
    core.shutdown()
    monkeypatch.undo()
    if not use_any_kernel(monkeypatch):
        return  # the cases below need a stack that would otherwise be built
    core, names = tiny_engine(tmp_path / "on")
    assert core.runner.decode_stack is not None and decode_stack_row(core).startswith("on (")
    core.shutdown()
    core, names = tiny_engine(tmp_path / "off", decode_stack="off")
    assert core.runner.decode_stack is None and decode_stack_row(core) == "off (--decode-stack off)"
    core.shutdown()
    core, names = tiny_engine(tmp_path / "kernels-off", kernels="off")
    assert core.runner.decode_stack is None and decode_stack_row(core) == "off (--kernels off)"
    core.shutdown()


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_a_family_the_stack_does_not_run_is_declared_off_with_its_reason(monkeypatch, model_type):
    """The registry, not the model, says which families' layers the C stack runs: Qwen3's QK-norm (and
    Qwen3-MoE's sparse block) keep the layer forward, and the plan says why."""
    if not use_any_kernel(monkeypatch):
        pytest.skip("no AMX, and no AVX2 and FMA, on this CPU: no kernel a stack can call")
    plan = plan_for("cpu", torch.bfloat16)
    assert plan.decode_stack  # what a LLaMA would get here
    fields = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=2,
                  num_experts_per_tok=1, moe_intermediate_size=32)
    config = ModelConfig.from_hf({"model_type": model_type, **fields})
    model = registry.family(model_type).model_class(config, torch.device("cpu"), torch.bfloat16,
                                                    plan.model_compute())
    final, stack = Platform.with_model(plan, model)
    assert stack is None and not final.decode_stack
    assert final.decode_stack_why == registry.family(model_type).no_decode_stack
    assert "QK-norm" in dict(final.rows())["decode stack"]


def test_stack_leaves_adapter_steps_to_a_lora_op_it_cannot_call(monkeypatch, tmp_path):
    """With torch's LoRA op (fp32 pages) the stack takes base-model steps only; adapter steps run
    the layer forward, and both give the layer forward's logits."""
    if not use_any_kernel(monkeypatch):
        pytest.skip("no AMX, and no AVX2 and FMA, on this CPU: no kernel a stack can call")
    core, names = tiny_engine(tmp_path)
    model = core.runner.model
    model.lora_op = TorchLoRAOp(model.device)  # pages stay the model's dtype: the torch op reads them
    both = BothPaths(core.runner)
    run_mixed(core, [None], [[3, 4, 5, 6]] * 2, 6)
    base_steps = both.stack_steps
    run_mixed(core, names[1:], [[3, 4, 5, 6]] * 2, 6)
    core.shutdown()
    assert base_steps >= 4 and both.stack_steps == base_steps and both.mismatches == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=40), min_size=1, max_size=12))
def test_padded_tables_hold_each_table_then_block_zero(tables: list[list[int]]) -> None:
    """The decode step's block tables, one row each, as the attention kernels read them: a table's
    blocks in order, block 0 after its end."""
    padded = padded_tables(tables)
    width = max(len(t) for t in tables)
    assert padded.dtype == torch.int64 and padded.shape == (len(tables), width) and padded.is_contiguous()
    assert padded.tolist() == [t + [0] * (width - len(t)) for t in tables]
