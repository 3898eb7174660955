"""Q8_0 and Q4_0 base weights served as blocks (kernels/quant_linear, --weights-dtype): the kernel against
gguf-py's dequantization of the same blocks then F.linear in fp32, and the engine on a Q8_0 / Q4_0 GGUF
against the engine on the same file dequantized (with and without adapters in one batch).

Tolerances: the kernel's fp32 output within 1e-4 of the sum of |x_k w_k| (+ |bias|) per output, the
scale of fp32 rounding in a dot product (measured: ~3e-7 of it); bf16 outputs within one bf16 step of
the fp32 reference. Engine logits within 1e-4 absolute, greedy tokens equal.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from adapter_cache.errors import FailedPreconditionError
from harness.engine_helpers import greedy_logits
from harness.gguf_files import make_base_checkpoint, write_gguf
from harness.platform import compute_for
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.kernels import bindings, build, quant_linear, variants
from inference_service.models.config import ModelConfig
from inference_service.models.gguf import GGUFFile
from inference_service.models.loader import load_model

CPU = torch.device("cpu")
TYPES = ["Q8_0", "Q4_0"]
KERNEL_TOL = 1e-4
LOGITS_TOL = 1e-4
NEW_TOKENS = 10
# (out, in): odd panel counts, a single block, an input of 3 blocks, SmolLM2's widths
SHAPES = [(16, 32), (48, 96), (272, 160), (1040, 576), (576, 1536)]
ROWS = [1, 2, 7, 32]

pytestmark = pytest.mark.skipif(not quant_linear.available(), reason="no C compiler: the kernel is not built")


def _weight(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(blocks of a random [n, k] weight, gguf-py's dequantization of those blocks)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType[qtype])
    return blocks, torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]).reshape(n, k).copy())


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per output, the sum of the magnitudes fp32 rounding is relative to."""
    return F.linear(x.float().abs(), w.abs(), None if bias is None else bias.float().abs())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_fp32_kernel_equals_dequantized_reference(qtype, n, k, rows):
    blocks, reference_w = _weight(qtype, n, k, seed=n + k)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    weight = quant_linear.pack(qtype, blocks, n, k, torch.float32)
    assert weight is not None
    for b in (None, bias):
        got = weight(x, b)
        expected = F.linear(x, reference_w, b)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert ((got - expected).abs() <= KERNEL_TOL * _bound(x, reference_w, b)).all()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(48, 96), (1040, 576)])
def test_a_rows_output_does_not_depend_on_its_batch(qtype, n, k):
    blocks, _ = _weight(qtype, n, k, seed=3)
    weight = quant_linear.pack(qtype, blocks, n, k, torch.float32)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(0))
    together = weight(x, None)
    for rows in (1, 2, 7):
        assert torch.equal(weight(x[:rows], None), together[:rows])


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_kernel_equals_dequantized_reference_rounded(qtype, rows):
    n, k = 272, 160
    blocks, reference_w = _weight(qtype, n, k, seed=5)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    weight = quant_linear.pack(qtype, blocks, n, k, torch.bfloat16)
    expected = F.linear(x.float(), reference_w, bias.float())
    step = 2.0**-7 * expected.abs() + KERNEL_TOL * _bound(x, reference_w, bias)  # one bf16 step
    got = weight(x, bias)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - expected).abs() <= step).all()
    as_float = weight.float_output(x, bias)  # the LM head's form: bf16-rounded values as fp32
    assert as_float.dtype == torch.float32 and torch.equal(as_float, got.float())


@pytest.mark.parametrize("qtype", TYPES)
def test_portable_c_build_equals_the_avx2_one(tmp_path, qtype):
    """The kernel built without AVX2/FMA/F16C (the x86-64 variant, for CPUs without them) on the same panels."""
    library = tmp_path / "quant_portable.so"
    compiler = build.find_compiler()
    assert compiler is not None
    build.compile_library(compiler, "quant_linear", variants.X86_64[0].flags, library)
    portable = ctypes.CDLL(str(library))
    assert portable.quant_linear_vectorised() == 0
    n, k, rows = 272, 160, 7
    blocks, reference_w = _weight(qtype, n, k, seed=7)
    weight = quant_linear.pack(qtype, blocks, n, k, torch.float32)
    x, bias = torch.randn(rows, k), torch.randn(n)
    out = torch.empty(rows, n)
    symbol = f"quant_linear_{qtype.lower()}_f32"
    fn = getattr(portable, symbol)
    signature = bindings.LIBRARIES["quant_linear"][symbol]  # the table's types, on this other build
    fn.restype, fn.argtypes = signature.restype, list(signature.argtypes)
    assert fn(x.data_ptr(), weight.storage.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, n, k, 0) == 0
    expected = F.linear(x, reference_w, bias)
    assert ((out - expected).abs() <= KERNEL_TOL * _bound(x, reference_w, bias)).all()
    # the same sums in the same order (k increasing, FMA): equal to the vector build's bit for bit
    assert torch.equal(out, weight(x, bias))


def test_q8_0_panels_hold_each_columns_scale_and_weights():
    n, k = 32, 64
    blocks, _ = _weight("Q8_0", n, k, seed=11)
    packed = quant_linear.panels("Q8_0", blocks, n, k).reshape(n // 16, k // 32, 544)
    rows = blocks.reshape(n, k // 32, 34)
    for column in (0, 5, 17, 31):
        for block in range(k // 32):
            panel, c = divmod(column, 16)
            stored = packed[panel, block]
            assert bytes(stored[2 * c: 2 * c + 2]) == bytes(rows[column, block, :2])  # the fp16 scale
            assert bytes(stored[32 + c::16]) == bytes(rows[column, block, 2:])  # its 32 int8, k by k


def test_q4_0_panels_hold_each_columns_scale_and_nibbles():
    n, k = 32, 64
    blocks, _ = _weight("Q4_0", n, k, seed=12)
    packed = quant_linear.panels("Q4_0", blocks, n, k).reshape(n // 16, k // 32, 288)
    rows = blocks.reshape(n, k // 32, 18)
    for column in (0, 5, 8, 17, 31):
        for block in range(k // 32):
            panel, c = divmod(column, 16)
            stored = packed[panel, block]
            assert bytes(stored[2 * c: 2 * c + 2]) == bytes(rows[column, block, :2])
            qs = rows[column, block, 2:]
            expected = np.concatenate([qs & 0xF, qs >> 4])  # GGUF: weight i low nibble, i + 16 high
            byte = stored[32 + c % 8::8]  # per k, 8 bytes: column c % 8 low, c % 8 + 8 high
            assert (((byte >> 4) if c >= 8 else (byte & 0xF)) == expected).all()


# Engine level: tiny LLaMA GGUFs with Q8_0 or Q4_0 projections (and a vocabulary of whole 16-column panels,
# so the LM head runs on the kernel too).


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q8")
    checkpoint = make_base_checkpoint(root / "llama", "llama", seed=3, vocab_size=288, tie_word_embeddings=True)
    return {qtype: write_gguf(checkpoint, root / f"tiny-{qtype}.gguf", qtype) for qtype in (*TYPES, "F32")}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, files) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q8-adapters")
    config = ModelConfig.from_hf(GGUFFile(files["Q8_0"]).hf_config())
    return {name: write_peft_adapter(root / name, config, rank=4, alpha=8.0, seed=seed, scale=0.3)
            for seed, name in enumerate(("a", "b"))}


PROMPTS = [("base", [1, 40, 72, 69, 3, 77], None), ("a", [5, 6, 7, 8, 9, 10, 11], "a"),
           ("b", [100, 101], "b"), ("a2", [60, 61, 62], "a")]


def _core(path: Path, weights_dtype: str) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", weights_dtype=weights_dtype,
                                   kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8))


def _projection_kernels(core: EngineCore) -> set[str]:
    model = core.runner.model
    packed = [p.packed for layer in model.layers for p in layer.projections()] + [model.packed_lm_head]
    return {type(p).__name__ for p in packed}


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("with_adapters", [False, True])
def test_engine_on_blocks_equals_the_dequantized_engine(files, adapters, qtype, with_adapters):
    prompts = PROMPTS if with_adapters else [(rid, tokens, None) for rid, tokens, _ in PROMPTS]
    used = adapters if with_adapters else {}
    quantized = _core(files[qtype], "auto")
    assert _projection_kernels(quantized) == {"QuantWeight"}
    assert quantized.runner.model.weight_bytes_saved > 0
    # decode steps run in C on the same kernel (and the C LoRA op)
    assert quantized.runner.decode_stack is not None
    ours = greedy_logits(quantized, used, prompts, NEW_TOKENS)
    dequantized = _core(files[qtype], "bf16")
    assert "QuantWeight" not in _projection_kernels(dequantized)
    reference = greedy_logits(dequantized, used, prompts, NEW_TOKENS)
    for rid, (logits, tokens) in reference.items():
        assert ours[rid][1] == tokens, rid
        assert (ours[rid][0] - logits).abs().max().item() < LOGITS_TOL, rid
    if with_adapters:  # the adapters change the output: the LoRA side path ran on the quantized base
        base = dict(greedy_logits(_core(files[qtype], "auto"), {}, [("a", PROMPTS[1][1], None)], NEW_TOKENS))
        assert not torch.allclose(base["a"][0], ours["a"][0])


@pytest.mark.parametrize("qtype", TYPES)
def test_requantizing_another_type_gives_llama_cpps_blocks(files, qtype):
    """An F32 file served with --weights-dtype q8_0 (q4_0) holds the blocks the Q8_0 (Q4_0) file was
    written with (both quantized by gguf-py from the same weights, q/k rows permuted or not): every
    projection's packed copy and the LM head's, byte for byte. (The embedding stays the file's own.)"""

    def packed(path: Path, weights_dtype: str) -> list[torch.Tensor]:
        model, _ = load_model(str(path), CPU, torch.float32, weights_dtype=weights_dtype,
                              compute=compute_for(CPU, torch.float32))
        weights = [p.packed for layer in model.layers for p in layer.projections()] + [model.packed_lm_head]
        assert all(isinstance(w, quant_linear.QuantWeight) and w.type_name == qtype for w in weights)
        return [w.storage for w in weights]

    for requantized, from_file in zip(packed(files["F32"], qtype.lower()), packed(files[qtype], "auto"), strict=True):
        assert torch.equal(requantized, from_file)
    model, _ = load_model(str(files["F32"]), CPU, torch.float32,
                          compute=compute_for(CPU, torch.float32))  # auto keeps an F32 file dense
    assert model.weight_bytes_saved == 0


def test_the_budget_is_measured_with_the_quantized_weights_resident_and_the_saving_logged(files, monkeypatch,
                                                                                         caplog):
    """The budget (adapter pool + KV cache) is a share of the memory available once the weights are
    loaded (engine/memory.py): measured after the quantized weights are resident, so the memory they
    save against dense ones is in what is measured; the saving is logged at start."""
    from inference_service.engine import core as engine_core

    events: list[str] = []
    real_load, real_budget = engine_core.load_model, engine_core.default_budget

    def load(*args, **kwargs):  # type: ignore[no-untyped-def]
        loaded = real_load(*args, **kwargs)
        events.append("weights loaded")
        return loaded

    def budget(device):  # type: ignore[no-untyped-def]
        events.append("budget measured")
        return real_budget(device)

    monkeypatch.setattr(engine_core, "load_model", load)
    monkeypatch.setattr(engine_core, "default_budget", budget)

    def start(weights_dtype: str) -> tuple[int, list[str]]:
        events.clear()
        caplog.clear()
        with caplog.at_level("INFO", logger="inference_service.engine.core"):
            core = EngineCore(EngineConfig(model=str(files["Q8_0"]), device="cpu", dtype="float32",
                                           weights_dtype=weights_dtype))
        saved = core.runner.model.weight_bytes_saved
        core.shutdown()
        assert events == ["weights loaded", "budget measured"]
        return saved, [r.getMessage() for r in caplog.records if "quantized weights take" in r.getMessage()]

    saved, logged = start("auto")
    assert saved > 0 and logged == [f"quantized weights take {saved / 2**20:.1f} MiB less than dense ones"]
    assert start("bf16") == (0, [])


def test_q8_0_is_refused_where_it_cannot_be_served(files):
    with pytest.raises(FailedPreconditionError, match="not one"):
        load_model("builtin:tiny", CPU, torch.float32, weights_dtype="q8_0")
    with pytest.raises(FailedPreconditionError, match="packed weights only"):
        load_model(str(files["Q8_0"]), CPU, torch.float32, weights_dtype="q8_0", pack_weights=False)
    with pytest.raises(FailedPreconditionError, match="weights dtype must be one of"):
        load_model(str(files["Q8_0"]), CPU, torch.float32, weights_dtype="q4_k")
    # auto with dense weights (a captured decode step) dequantizes, as before
    model, _ = load_model(str(files["Q8_0"]), CPU, torch.float32, pack_weights=False,
                          compute=compute_for(CPU, torch.float32))
    assert model.weight_bytes_saved == 0 and model.layers[0].qkv.weight.numel() > 0


def test_a_fused_projection_of_mixed_types_is_served_dense(files):
    """q/k/v fused into one projection: when the file holds v in another kept type than q and k, that
    projection is dequantized (one panel layout per projection); the others stay blocks."""
    from inference_service.models.gguf import GGUFStateDict
    from inference_service.models.llama import LlamaModel
    from inference_service.models.quantized import QuantizedWeight, quantize_blocks

    class MixedTypes(GGUFStateDict):
        def quantized(self, name: str) -> QuantizedWeight | None:
            weight = super().quantized(name)
            return quantize_blocks(self[name].numpy(), "Q4_0") if weight and "v_proj" in name else weight

    file = GGUFFile(files["Q8_0"])
    model = LlamaModel(ModelConfig.from_hf(file.hf_config()), CPU, torch.float32, compute_for(CPU, torch.float32))
    model.load_hf_state_dict(MixedTypes(file, "auto"))
    model.pack_weights()
    for layer in model.layers:
        assert not isinstance(layer.qkv.packed, quant_linear.QuantWeight)
        assert isinstance(layer.o.packed, quant_linear.QuantWeight) and layer.o.packed.type_name == "Q8_0"
