"""Projections on GGUF block-quantized weights (`quant_linear.c`): no dequantized copy of the model.

Q8_0 rows are blocks of 34 bytes (an fp16 scale, then 32 int8 weights along the input); Q4_0 rows
blocks of 18 (an fp16 scale, then 32 4-bit q in 16 bytes: weight i in byte i's low nibble, weight
i + 16 in its high one; value (q - 8) x scale). `pack` repacks a weight's blocks once, at load,
into the kernel's 16-column panels (still int8 or 4-bit + fp16 scales: 1.0625 or 0.5625 bytes a
weight against bf16's 2). Activations are the model's dtype (fp32 or bf16), as for the dense kernels;
the kernel quantizes each row per 32-value block to int8 and sums the blocks' products in int32 (AMX-INT8
tiles from 16 rows where the CPU has them, AVX-512 VNNI, else AVX2, else portable C: equal results), as
llama.cpp does. Error against x times the dequantized weight: at most, per output, the sum over blocks of
(the block's max |x| / 254) x (the block's sum of |w|), plus fp32 rounding (`activation_error_bound`; a
block of values under ~3.7e-37, whose scale has no fp32 inverse, is taken as zeros).

On a CPU with AMX the tiles are checked once at start-up (`settle_amx`) before any weight meets them: their
outputs must equal the VNNI tiles' bits on probe calls, and a 32-row call must not be slower; otherwise
the process keeps the VNNI tiles and logs why.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inference_service.kernels.bindings import CFunction, address, function
from inference_service.kernels.hugepages import Arena
from inference_service.kernels.projection_rows import PanelWeight

log = logging.getLogger(__name__)

PANEL = 16  # output columns a panel holds
BLOCK = 32  # weights per block (along the input)
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}  # GGUF's block: fp16 scale + the weights
TYPES = tuple(BLOCK_BYTES)
DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes
PATHS = ("portable C", "AVX2 (vpmaddubsw)", "AVX-512 VNNI (vpdpbusd)",  # by quant_linear_vectorised()
         "AMX-INT8 tiles (tdpbsud) from 16 rows, AVX-512 VNNI below")
AMX_PATH, VNNI_PATH = 3, 2


def activation_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per output [rows, N], the most the kernel's int8 activations can move x @ weight^T (weight [N, K]
    dequantized): each value is off by at most half its block's scale (max |x| / 127), or by the
    block's max |x| where that scale is too small to invert in fp32 (the block is taken as zeros)."""
    rows, k = x.shape
    amax = x.float().abs().reshape(rows, k // BLOCK, BLOCK).amax(-1)  # [rows, blocks]
    scale = amax / 127
    half_step = torch.where((scale != 0) & ~torch.isfinite(1 / scale), amax, amax / 254)
    block_weight = weight.float().abs().reshape(weight.shape[0], k // BLOCK, BLOCK).sum(-1)  # [N, blocks]
    return half_step @ block_weight.T


def panels(type_name: str, blocks: np.ndarray, out_features: int, in_features: int) -> np.ndarray:
    """GGUF rows (uint8 [N, K/32 * block bytes]) as the kernel's panels, flat uint8: [N/16][K/32][16
    fp16 scales, then the weights in groups of 4 k, each group 16 columns x 4 bytes (column c's 4 k
    consecutive)]: Q8_0 8 groups, each byte the int8 weight + 128; Q4_0 4 groups of bytes whose low
    nibbles are k 0-15's q and high nibbles k 16-31's."""
    n, kb = out_features, in_features // BLOCK
    rows = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n // PANEL, PANEL, kb, BLOCK_BYTES[type_name])
    scales = rows[..., :2].transpose(0, 2, 1, 3).reshape(n // PANEL, kb, 2 * PANEL)
    if type_name == "Q8_0":
        q = rows[..., 2:] ^ 0x80  # int8 w as w + 128
    else:
        packed = rows[..., 2:]
        q = np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # GGUF: weight i low nibble, i + 16 high
    groups = q.reshape(n // PANEL, PANEL, kb, BLOCK // 4, 4).transpose(0, 2, 3, 1, 4)  # [panel, block, g, col, 4]
    if type_name == "Q4_0":
        groups = groups[:, :, :4] | (groups[:, :, 4:] << 4)
    return np.concatenate([scales, groups.reshape(n // PANEL, kb, -1)], axis=-1).reshape(-1)


class QuantWeight(PanelWeight):
    """A Q8_0 or Q4_0 weight [N, K] in panels: out = x @ W^T (+ bias) for any number of rows, in
    `dtype` (x and bias in it too). The panels are copied into `storage` (uint8, `panel_bytes` long:
    a part of the model's huge-page arena) when given."""

    def __init__(self, type_name: str, blocks: np.ndarray, out_features: int, in_features: int,
                 dtype: torch.dtype, storage: torch.Tensor | None = None) -> None:
        self.type_name, self.out_features, self.in_features, self.dtype = type_name, out_features, in_features, dtype
        functions = _functions()
        assert functions is not None, "a QuantWeight exists only where the kernel runs"
        self._kernel = functions[(type_name, dtype)]
        self._name = type_name
        packed = torch.from_numpy(panels(type_name, blocks, out_features, in_features))
        self.panels = packed if storage is None else storage.copy_(packed)

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def takes(type_name: str, out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """The kernel runs here and takes such a weight: Q8_0 or Q4_0, N a multiple of 16, K of 32, fp32 or
    bf16 activations."""
    return (type_name in TYPES and not out_features % PANEL and not in_features % BLOCK and dtype in DTYPES
            and available())


def panel_bytes(type_name: str, out_features: int, in_features: int) -> int:
    """The bytes of a weight's panels: as many as its GGUF blocks (the same scales and weights, moved)."""
    return out_features * in_features // BLOCK * BLOCK_BYTES[type_name]


def pack(type_name: str, blocks: np.ndarray, out_features: int, in_features: int,
         dtype: torch.dtype, arena: Arena | None = None) -> QuantWeight | None:
    """The panels of a Q8_0 or Q4_0 weight (cut from `arena` when given), or None where the kernel
    cannot take it (`takes`; or disabled)."""
    if not takes(type_name, out_features, in_features, dtype):
        return None
    storage = None if arena is None else arena.take(panel_bytes(type_name, out_features, in_features))
    return QuantWeight(type_name, blocks, out_features, in_features, dtype, storage)


def available() -> bool:
    return _functions() is not None


def path() -> str:
    """What computes the quantized projections here (PATHS), once `check_amx` has had its say."""
    functions = _functions()
    return "none" if functions is None else PATHS[_symbol("quant_linear_vectorised")()]


@dataclass(frozen=True)
class AMXCheck:
    equal: bool  # the tiles gave the VNNI tiles' bits on every probe call
    tiles_us: float  # a 32-row call (SmolLM2's gate and up projections' shape), best of a few
    vnni_us: float
    timed_shape: tuple[int, int]  # (out, in) of the timed calls

    @property
    def keep(self) -> bool:
        return self.equal and self.tiles_us <= self.vnni_us

    def describe(self) -> str:
        n, k = self.timed_shape
        timing = f"32 rows x {n} x {k}: {self.tiles_us:.0f} us on tiles, {self.vnni_us:.0f} us on VNNI"
        if not self.equal:
            return f"AMX-INT8 tiles gave other bits than the VNNI tiles on a probe call: not used ({timing})"
        return f"AMX-INT8 tiles {'in use' if self.keep else 'slower here: not used'} ({timing})"


TIMED_SHAPE = (1536, 576)  # (out, in) of the timed call
PROBE_SHAPES = ((48, 96), (16, 32))  # odd panel counts, one block
PROBE_ROWS = (16, 17, 33)  # one tile, two, and a second row block


def check_amx(symbol: Callable[[str], CFunction], timed_shape: tuple[int, int] = TIMED_SHAPE,
              repeats: int = 5) -> AMXCheck:
    """The AMX tiles of the library whose typed functions `symbol` gives, against its VNNI tiles: the same
    calls both ways on random panels (a row of zeros, one of subnormals among them), then a 32-row Q4_0 and
    Q8_0 call timed alternately. Leaves the tiles allowed."""
    allow = symbol("quant_linear_allow_amx")
    rng = np.random.default_rng(0)

    def run(fn: CFunction, weight: np.ndarray, x: torch.Tensor, bias: torch.Tensor | None, n: int, tiles: bool,
            float_output: int = 0) -> torch.Tensor:
        allow(int(tiles))
        out = torch.empty(x.shape[0], n, dtype=torch.float32 if float_output else x.dtype)
        if fn(x.data_ptr(), weight.ctypes.data, None if bias is None else bias.data_ptr(), out.data_ptr(),
              x.shape[0], n, x.shape[1], float_output):
            raise MemoryError("quantized projection: a scratch buffer could not be allocated")
        return out

    equal = True
    for type_name in TYPES:
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = symbol(f"quant_linear_{type_name.lower()}_{suffix}")
            for n, k in PROBE_SHAPES:
                weight = panels(type_name, _random_blocks(type_name, n, k, rng), n, k)
                for rows in PROBE_ROWS:
                    x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32)).to(dtype)
                    x[1], x[2] = 0.0, x[2] * 1e-39
                    bias = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)).to(dtype)
                    for outputs in ((0, 1) if dtype == torch.bfloat16 else (0,)):
                        equal &= torch.equal(run(fn, weight, x, bias, n, True, outputs),
                                             run(fn, weight, x, bias, n, False, outputs))
    n, k = timed_shape
    timed = {True: 0.0, False: 0.0}
    for type_name in TYPES:
        fn = symbol(f"quant_linear_{type_name.lower()}_bf16")
        weight = panels(type_name, _random_blocks(type_name, n, k, rng), n, k)
        x = torch.from_numpy(rng.standard_normal((32, k), dtype=np.float32)).to(torch.bfloat16)
        best = {True: math.inf, False: math.inf}
        for _ in range(repeats):
            for tiles in (True, False):
                start = time.perf_counter()
                run(fn, weight, x, None, n, tiles)
                best[tiles] = min(best[tiles], time.perf_counter() - start)
        for tiles in timed:
            timed[tiles] += best[tiles] * 1e6
    allow(1)
    return AMXCheck(equal, timed[True], timed[False], timed_shape)


def settle_amx(symbol: Callable[[str], CFunction]) -> AMXCheck:
    """`check_amx`, then the tiles turned off unless it keeps them; logged either way."""
    check = check_amx(symbol)
    if not check.keep:
        symbol("quant_linear_allow_amx")(0)
    (log.info if check.keep else log.warning)("Q8_0/Q4_0 projections: %s", check.describe())
    return check


def _random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks of a random weight [n, k]: fp16 scales around 0.01, every weight byte random."""
    blocks = rng.integers(0, 256, size=(n, k // BLOCK, BLOCK_BYTES[type_name]), dtype=np.uint8)
    scales = (rng.uniform(0.005, 0.02, size=(n, k // BLOCK)) * rng.choice([-1, 1], size=(n, k // BLOCK)))
    blocks[..., :2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def kernel_address(type_name: str, dtype: torch.dtype) -> int | None:
    """The C function's address for `type_name` weights and activations of `dtype`, or None."""
    functions = _functions()
    if functions is None or (type_name, dtype) not in functions:
        return None
    return address(functions[(type_name, dtype)])


@functools.cache
def _functions() -> dict[tuple[str, torch.dtype], CFunction] | None:
    """quant_linear_{q8_0,q4_0}_{f32,bf16} by (type, activation dtype), or None where the kernel
    cannot be had."""
    vectorised = function("quant_linear", "quant_linear_vectorised")
    if vectorised is None:
        return None
    if vectorised() == AMX_PATH:
        settle_amx(_symbol)
    log.info("Q8_0/Q4_0 projections: %s", PATHS[vectorised()])
    functions = {}
    for type_name in TYPES:
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            functions[(type_name, dtype)] = _symbol(f"quant_linear_{type_name.lower()}_{suffix}")
    return functions


def _symbol(name: str) -> CFunction:
    fn = function("quant_linear", name)
    assert fn is not None, name
    return fn
