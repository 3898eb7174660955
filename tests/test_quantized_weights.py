"""Q8_0 and Q4_0 base weights served as blocks (kernels/quant_linear, --weights-dtype): the kernel against
gguf-py's dequantization of the same blocks then F.linear in fp32, and the engine on a Q8_0 / Q4_0 GGUF
against the engine on the same file dequantized (with and without adapters in one batch).

The kernel quantizes its activations per 32-value block to int8 (as llama.cpp does), so its outputs
differ from x times the dequantized weight by the activations' rounding: at most, per output, the sum
over blocks of the block's max |x| / 254 times the block's sum of |w| (`activation_error_bound`);
fp32 rounding adds 1e-4 of the sum of |x_k w_k| (+ |bias|) at most (measured: ~3e-7 of it); bf16
outputs one bf16 step more. Against the int8 product itself (the same rounding done here in float64)
the kernel is exact up to that fp32 rounding, and every build (AVX-512 VNNI, AVX2, portable C) gives
the same bits. Engine logits within 0.1 absolute of the dequantized engine's (measured up to 0.053 on
these models, whose logits reach 2), and greedy tokens equal but where the reference's top two logits are
closer than twice the logits' difference at that step (a near-tie the activations' rounding may break
the other way; the sequences part there).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

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
LOGITS_TOL = 0.1
NEW_TOKENS = 10
# (out, in): odd panel counts, a single block, an input of 3 blocks, SmolLM2's widths
SHAPES = [(16, 32), (48, 96), (272, 160), (1040, 576), (576, 1536)]
ROWS = [1, 2, 7, 9, 32]  # below, at and between the kernels' row tiles (4 on AVX2, 8 on AVX-512)

pytestmark = pytest.mark.skipif(not quant_linear.available(), reason="no C compiler: the kernel is not built")


def _weight(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(blocks of a random [n, k] weight, gguf-py's dequantization of those blocks)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize(w, GGMLQuantizationType[qtype])
    return blocks, torch.from_numpy(dequantize(blocks, GGMLQuantizationType[qtype]).reshape(n, k).copy())


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Per output, the sum of the magnitudes fp32 rounding is relative to."""
    return F.linear(x.float().abs(), w.abs(), None if bias is None else bias.float().abs())


def _int8_product(x: torch.Tensor, reference_w: torch.Tensor) -> torch.Tensor:
    """x's rows rounded per block as the kernel rounds them (scale max |x| / 127 in fp32, x times its
    inverse to nearest even; a block whose scale has no finite inverse as zeros), times the dequantized
    weight, in float64."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(torch.isfinite(1 / scale), 1 / scale, torch.zeros_like(scale))  # 0: taken as zeros
    rounded = (torch.round(blocks * inverse) * scale).reshape(rows, k)
    return F.linear(rounded.double(), reference_w.double())


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_fp32_kernel_is_within_the_int8_activations_bound_of_the_dequantized_reference(qtype, n, k, rows):
    blocks, reference_w = _weight(qtype, n, k, seed=n + k)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    weight = quant_linear.pack(qtype, blocks, n, k, torch.float32)
    assert weight is not None
    for b in (None, bias):
        got = weight(x, b)
        expected = F.linear(x, reference_w, b)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        rounding = KERNEL_TOL * _bound(x, reference_w, b)
        assert ((got - expected).abs() <= quant_linear.activation_error_bound(x, reference_w) + rounding).all()
        # and the int8 product exactly, up to fp32 rounding
        int8 = _int8_product(x, reference_w) + (0 if b is None else b.double())
        assert ((got.double() - int8).abs() <= rounding.double()).all()


def test_the_int8_activations_bound_is_reached_by_the_worst_input():
    """The stated bound is tight: x whose every value but its block's maximum sits just under half a
    step above a multiple of the step, on the side of its column-0 weight's sign, errs by ~31/32 of it."""
    n, k = 16, 64
    blocks, reference_w = _weight("Q8_0", n, k, seed=1)
    step = 0.01
    sign = torch.sign(reference_w[0])
    x = sign * (torch.randint(0, 120, (k,), generator=torch.Generator().manual_seed(1)) + 0.499) * step
    x[::32] = sign[::32] * 127 * step  # each block's maximum: exact in int8
    x = x[None]
    got = quant_linear.pack("Q8_0", blocks, n, k, torch.float32)(x, None)
    ratio = ((got - F.linear(x, reference_w)).abs() / quant_linear.activation_error_bound(x, reference_w))[0, 0]
    assert 0.9 < ratio.item() <= 1.0


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(48, 96), (1040, 576)])
def test_a_rows_output_does_not_depend_on_its_batch(qtype, n, k):
    blocks, _ = _weight(qtype, n, k, seed=3)
    weight = quant_linear.pack(qtype, blocks, n, k, torch.float32)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(0))
    together = weight(x, None)
    for rows in (1, 2, 7, 9):
        assert torch.equal(weight(x[:rows], None), together[:rows])
        assert torch.equal(weight(x[rows:2 * rows], None), together[rows:2 * rows])


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_bf16_kernel_equals_dequantized_reference_rounded(qtype, rows):
    n, k = 272, 160
    blocks, reference_w = _weight(qtype, n, k, seed=5)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    weight = quant_linear.pack(qtype, blocks, n, k, torch.bfloat16)
    expected = F.linear(x.float(), reference_w, bias.float())
    int8 = quant_linear.activation_error_bound(x, reference_w)
    step = 2.0**-7 * (expected.abs() + int8) + int8 + KERNEL_TOL * _bound(x, reference_w, bias)  # + one bf16 step
    got = weight(x, bias)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - expected).abs() <= step).all()
    as_float = weight.float_output(x, bias)  # the LM head's form: bf16-rounded values as fp32
    assert as_float.dtype == torch.float32 and torch.equal(as_float, got.float())


# The AVX-512 VNNI build with the AMX-INT8 tiles' C model (kernels/amx_tiles.h) in place of the hardware's:
# the tile code an AMX host runs, run and checked on any AVX-512 VNNI host.
_VNNI_BUILD = next(v for v in variants.X86_64 if v.name == "avx512-bf16")
AMX_MODEL = variants.Variant("amx-int8-model", (*_VNNI_BUILD.flags, "-DLORAPLEX_AMX_EMULATE"), _VNNI_BUILD.requires, 0)


def _variant(name: str) -> variants.Variant:
    return next(v for v in (*variants.X86_64, AMX_MODEL) if v.name == name)


def _runs_here(name: str) -> bool:
    """Whether this CPU runs the build of variant `name`."""
    return _variant(name).requires <= variants.cpu_flags()


# Each build's path by quant_linear_vectorised(): portable C, AVX2, AVX-512 VNNI, AMX-INT8 tiles from 16 rows
# (sapphirerapids: where this process may use them).
BUILDS = [("x86-64", 0), ("x86-64-v3", 1), ("x86-64-v4", 1), ("avx512-bf16", 2), ("amx-int8-model", 3),
          ("sapphirerapids", 3)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> Callable[[str], ctypes.CDLL]:
    """The kernel compiled with a variant's flags, once per variant for the module."""
    root, built = tmp_path_factory.mktemp("quant-builds"), {}

    def of(variant: str) -> ctypes.CDLL:
        if variant not in built:
            compiler = build.find_compiler()
            assert compiler is not None
            build.compile_library(compiler, "quant_linear", _variant(variant).flags, root / f"{variant}.so")
            built[variant] = ctypes.CDLL(str(root / f"{variant}.so"))
        return built[variant]

    return of


@pytest.mark.parametrize("variant,path", BUILDS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_gives_the_loaded_builds_bits(builds, variant, path, qtype, dtype):
    """The kernel built for each instruction set this CPU runs (the AVX2 path forced on an AVX-512 CPU
    too) on the same panels: the same integer sums and fp32 operations, so the same bits."""
    if not _runs_here(variant):
        pytest.skip(f"this CPU cannot run the {variant} build")
    other = builds(variant)
    assert other.quant_linear_vectorised() == path
    n, k = 272, 160
    blocks, reference_w = _weight(qtype, n, k, seed=7)
    weight = quant_linear.pack(qtype, blocks, n, k, dtype)
    fn = _typed(other, f"quant_linear_{qtype.lower()}_{'f32' if dtype == torch.float32 else 'bf16'}")
    for rows in (1, 3, 7, 9, 32):
        x, bias = torch.randn(rows, k).to(dtype), torch.randn(n).to(dtype)
        if rows >= 8:  # blocks of zeros (scale 0) and of subnormals (a scale that rounds to 0 or near it)
            x[5], x[6] = 0.0, x[6] * 1e-39
        out = torch.empty(rows, n, dtype=dtype)
        assert fn(x.data_ptr(), weight.storage.data_ptr(), bias.data_ptr(), out.data_ptr(), rows, n, k, 0) == 0
        assert torch.equal(out, weight(x, bias)), rows
        if dtype == torch.float32:
            expected = F.linear(x, reference_w, bias)
            bound = quant_linear.activation_error_bound(x, reference_w) + KERNEL_TOL * _bound(x, reference_w, bias)
            assert ((out - expected).abs() <= bound).all()
    # a NaN or an infinity in a row: every output of that row non-finite (NaN), the other rows untouched
    x = torch.randn(4, k).to(dtype)
    x[1, 40], x[2, 100] = float("nan"), float("inf")
    out = torch.empty(4, n, dtype=dtype)
    assert fn(x.data_ptr(), weight.storage.data_ptr(), None, out.data_ptr(), 4, n, k, 0) == 0
    assert out[1:3].isnan().all()
    finite = x[[0, 3]]
    assert torch.equal(out[[0, 3]], weight(finite, None))
    assert other.quant_linear_amx_faults() == 0


# What a block of activations may hold: ordinary values, all zeros (scale 0), subnormals (a scale that
# rounds to 0 or near it), one NaN or one infinity (the row's outputs NaN), or values near fp32's largest.
_BLOCK_KINDS = ("normal", "zeros", "subnormal", "nan", "inf", "huge")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(qtype="Q8_0", wide=False, rows=1, blocks=1, kinds=["subnormal"], seed=0, panels=2)  # an inverse beyond fp32
@example(qtype="Q4_0", wide=True, rows=9, blocks=18, kinds=["normal"] * 15 + ["nan", "zeros", "subnormal", "inf"],
         seed=1, panels=3)  # SmolLM2's 576 inputs: groups across rows, specials at a group's last and first blocks
@example(qtype="Q8_0", wide=True, rows=1, blocks=18, kinds=["normal"], seed=2, panels=67)  # fours, then 2 + 1
@example(qtype="Q8_0", wide=False, rows=1, blocks=3, kinds=["normal", "nan"], seed=3, panels=66)  # fours, then 2
@given(qtype=st.sampled_from(TYPES), wide=st.booleans(), rows=st.integers(1, 40), blocks=st.integers(1, 50),
       kinds=st.lists(st.sampled_from(_BLOCK_KINDS), min_size=1, max_size=64), seed=st.integers(0, 2**16),
       panels=st.sampled_from([*range(1, 10), 65, 66, 67, 72]))  # 64+: a single row's units of four on 2 threads
def test_the_activations_quantize_alike_in_every_build_whatever_the_blocks(builds, qtype, wide, rows, blocks, kinds,
                                                                            seed, panels):
    """The activations' blocks are quantized in groups of 16 that run across rows (AVX-512) or one at a
    time (the other builds), by the calling thread below a few rows and by the team from there, and the
    panels taken one, two or (one row, Q8_0) four at a time: any row count, blocks per row, panel count
    and special blocks anywhere in a group give the portable build's bits."""
    k, n = 32 * blocks, 16 * panels
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    for b in range(rows * blocks):  # the kinds in turn over the flat sequence of blocks
        block = x.view(-1)[32 * b: 32 * (b + 1)]
        kind = kinds[b % len(kinds)]
        at = int(torch.randint(0, 32, (1,), generator=generator))
        if kind == "zeros":
            block.zero_()
        elif kind == "subnormal":
            block.mul_(1e-39)
        elif kind == "nan":
            block[at] = float("nan")
        elif kind == "inf":
            block[at] = float("-inf") if at % 2 else float("inf")
        elif kind == "huge":
            block.mul_(1e37)
    dtype = torch.bfloat16 if wide else torch.float32
    x = x.to(dtype)
    weight_blocks, _ = _weight(qtype, n, k, seed=seed)
    weight = quant_linear.pack(qtype, weight_blocks, n, k, dtype)
    symbol = f"quant_linear_{qtype.lower()}_{'bf16' if wide else 'f32'}"
    outputs = {}
    for variant, _ in BUILDS:
        if not _runs_here(variant):
            continue
        out = torch.empty(rows, n, dtype=dtype)
        assert _typed(builds(variant), symbol)(x.data_ptr(), weight.storage.data_ptr(), None, out.data_ptr(), rows,
                                               n, k, 0) == 0
        outputs[variant] = out
    for variant, out in outputs.items():
        assert torch.equal(out.isnan(), outputs["x86-64"].isnan()), variant
        assert torch.equal(out.nan_to_num(), outputs["x86-64"].nan_to_num()), variant
    if kinds == ["subnormal"] and not wide:  # every block below 1 / FLT_MAX x 127: taken as zeros
        assert not outputs["x86-64"].any()


def _typed(library: ctypes.CDLL, symbol: str) -> ctypes._CFuncPtr:
    """`symbol` of a library built here, typed as the bindings table types it."""
    fn = getattr(library, symbol)
    signature = bindings.LIBRARIES["quant_linear"][symbol]
    fn.restype, fn.argtypes = signature.restype, list(signature.argtypes)
    return fn


@pytest.mark.parametrize("variant", ["amx-int8-model", "sapphirerapids"])
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype,float_output", [(torch.float32, 0), (torch.bfloat16, 0), (torch.bfloat16, 1)])
def test_amx_tiles_give_the_vnni_tiles_bits(builds, variant, qtype, dtype, float_output):
    """The AMX-INT8 path (16 rows and more) against the same build's VNNI tiles (`quant_linear_allow_amx(0)`)
    on the same panels: one and two 16-row tiles, a partial second tile, several 32-row blocks, one panel
    and odd panel counts (a unit of one panel at the end), with and without bias, rows of zeros, of
    subnormals and non-finite rows; equal bits, and nothing the hardware would fault on (the C model counts
    it). The sapphirerapids build runs the hardware's tiles where this CPU has them."""
    if not _runs_here(variant):
        pytest.skip(f"this CPU cannot run the {variant} build")
    library = builds(variant)
    if library.quant_linear_vectorised() != quant_linear.AMX_PATH:
        pytest.skip("Linux does not let this process use AMX's tile state")
    fn = _typed(library, f"quant_linear_{qtype.lower()}_{'f32' if dtype == torch.float32 else 'bf16'}")
    allow = _typed(library, "quant_linear_allow_amx")
    generator = torch.Generator().manual_seed(3)
    for n, k in [(16, 32), (48, 96), (272, 160), (64, 576)]:
        blocks, _ = _weight(qtype, n, k, seed=n)
        panels = torch.from_numpy(quant_linear.panels(qtype, blocks, n, k))
        for rows in (15, 16, 17, 31, 32, 33, 70):
            x = torch.randn(rows, k, generator=generator).to(dtype)
            x[3], x[5], x[7, 0] = 0.0, x[5] * 1e-39, float("nan")
            x[9, k - 1] = float("inf")
            for bias in (None, torch.randn(n, generator=generator).to(dtype)):
                outputs = {}
                for tiles in (1, 0):
                    assert allow(tiles) == (quant_linear.AMX_PATH if tiles else quant_linear.VNNI_PATH)
                    out = torch.empty(rows, n, dtype=torch.float32 if float_output else dtype)
                    assert fn(x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(),
                              out.data_ptr(), rows, n, k, float_output) == 0
                    outputs[tiles] = out
                allow(1)
                bits = torch.int32 if outputs[1].dtype == torch.float32 else torch.int16  # NaNs compared too
                assert torch.equal(outputs[1].view(bits), outputs[0].view(bits)), (n, k, rows)
                assert outputs[1][[7, 9]].isnan().all() and outputs[1][:7].isfinite().all()
    assert library.quant_linear_amx_faults() == 0


def test_the_start_up_check_keeps_tiles_that_agree_and_drops_those_that_do_not(builds, caplog):
    """`settle_amx` on the tiles' C model: its probes agree bit for bit with the VNNI tiles. Tiles whose
    outputs differ (a fault no host here can cause: stood in for by flipping a bit of every tiled output)
    are turned off, so every call takes the VNNI tiles, and the log says why."""
    if not _runs_here(AMX_MODEL.name):
        pytest.skip("this CPU cannot run the AVX-512 VNNI build the tiles' model extends")
    library = builds("amx-int8-model")
    check = quant_linear.check_amx(lambda name: _typed(library, name), timed_shape=(64, 96), repeats=1)
    assert check.equal and check.tiles_us > 0 and check.vnni_us > 0
    assert library.quant_linear_vectorised() == quant_linear.AMX_PATH  # left allowed

    def faulty(name: str) -> Callable[..., int]:
        fn = _typed(library, name)
        if not name.endswith(("_f32", "_bf16")):
            return fn

        def call(x, w, bias, out, m, n, k, float_output) -> int:
            status = fn(x, w, bias, out, m, n, k, float_output)
            if library.quant_linear_vectorised() == quant_linear.AMX_PATH and m >= 16:
                ctypes.c_uint8.from_address(out).value ^= 1
            return status

        return call

    with caplog.at_level("WARNING", logger=quant_linear.__name__):
        check = quant_linear.settle_amx(faulty)
    assert not check.equal and not check.keep
    assert library.quant_linear_vectorised() == quant_linear.VNNI_PATH
    assert any("other bits than the VNNI tiles" in r.getMessage() for r in caplog.records)
    library.quant_linear_allow_amx(1)


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
            weights = stored[32:].reshape(8, 16, 4)[:, c].reshape(-1)  # per group of 4 k, column c's 4 bytes
            assert bytes(weights ^ 0x80) == bytes(rows[column, block, 2:])  # its 32 int8 + 128, k by k


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
            byte = stored[32:].reshape(4, 16, 4)[:, c].reshape(-1)  # k 0-15 low nibbles, k 16-31 high
            assert (np.concatenate([byte & 0xF, byte >> 4]) == expected).all()


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


def _assert_close_up_to_a_near_tie(ours: tuple[torch.Tensor, list[int]], reference: tuple[torch.Tensor, list[int]],
                                   rid: str) -> int:
    """Step by step: logits within LOGITS_TOL and the same token, until a step whose tokens differ, which
    the logits' difference there must explain (the reference's top two closer than twice it: a near-tie
    broken the other way); the sequences then part. Returns the number of tokens compared."""
    for step, (theirs, token) in enumerate(zip(reference[0], reference[1], strict=True)):
        difference = (ours[0][step] - theirs).abs().max().item()
        assert difference < LOGITS_TOL, (rid, step)
        if ours[1][step] != token:
            top = theirs.topk(2).values
            assert (top[0] - top[1]).item() <= 2 * difference, (rid, step)
            return step
    return len(reference[1])


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
    compared = sum(_assert_close_up_to_a_near_tie(ours[rid], reference[rid], rid) for rid in reference)
    assert compared >= len(prompts) * NEW_TOKENS // 2  # most tokens are no near-tie
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


@pytest.mark.parametrize("huge_pages", [True, False])
def test_the_quantized_panels_are_cut_from_one_arena_unless_small_pages_are_asked_for(files, huge_pages):
    """With --huge-pages on (the default) every projection's and the LM head's panels are consecutive
    parts of one allocation (the arena a model of 2 MiB or more gets on huge pages); off, each has its own."""
    model, _ = load_model(str(files["Q4_0"]), CPU, torch.float32,
                          compute=compute_for(CPU, torch.float32, huge_pages=huge_pages))
    weights = [p.packed for layer in model.layers for p in layer.projections()] + [model.packed_lm_head]
    assert all(isinstance(w, quant_linear.QuantWeight) for w in weights)
    storages = {w.storage.untyped_storage().data_ptr() for w in weights}  # type: ignore[union-attr]
    assert len(storages) == (1 if huge_pages else len(weights))
    if huge_pages:  # the parts tile the arena with no gap or overlap
        spans = sorted((w.storage.data_ptr(), w.storage.numel()) for w in weights)  # type: ignore[union-attr]
        assert all(start + size == after for (start, size), (after, _) in zip(spans, spans[1:], strict=False))


def test_auto_serves_an_lm_head_of_a_type_no_kernel_reads_as_q8_0(tmp_path, files):
    """llama.cpp's quantizer writes a Q4_0 file's tied token embedding (its LM head) in another type
    (Q6_K; here Q5_0, which gguf-py can write): auto serves that LM head as Q8_0 blocks rather than
    in bf16 at twice the bytes, the embedding stays the file's own, and the logits stay within the
    tolerance of the engine that dequantizes every weight."""
    checkpoint = make_base_checkpoint(tmp_path / "llama", "llama", seed=3, vocab_size=288, tie_word_embeddings=True)
    path = write_gguf(checkpoint, tmp_path / "tiny-Q4_0-mixed.gguf", "Q4_0",
                      tensor_types={"token_embd.weight": "Q5_0"})
    file = GGUFFile(path)
    assert file.dominant_type() == "Q4_0" and file.type_name("token_embd.weight") == "Q5_0"
    quantized = _core(path, "auto")
    model = quantized.runner.model
    assert isinstance(model.packed_lm_head, quant_linear.QuantWeight) and model.packed_lm_head.type_name == "Q8_0"
    assert {p.packed.type_name for layer in model.layers for p in layer.projections()} == {"Q4_0"}
    embedding = torch.from_numpy(np.array(file.dequantize("token_embd.weight")))
    assert torch.equal(model.embed_tokens.weight, embedding)
    prompts = [(rid, tokens, None) for rid, tokens, _ in PROMPTS]
    ours = greedy_logits(quantized, {}, prompts, NEW_TOKENS)
    reference = greedy_logits(_core(path, "bf16"), {}, prompts, NEW_TOKENS)
    compared = sum(_assert_close_up_to_a_near_tie(ours[rid], reference[rid], rid) for rid in reference)
    assert compared >= len(prompts) * NEW_TOKENS // 2


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
