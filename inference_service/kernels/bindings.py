"""Every exported C function of the kernel libraries as ctypes calls it: one table, library -> function
-> (restype, argtypes), from which each kernel module gets its functions (`function`).

The C side of each signature is kernels.h; tests/test_kernel_build.py checks this table against it
(every prototype here and nothing else, argument for argument). Pointers are `c_void_p`: callers pass
tensors' `data_ptr()` integers (or ctypes objects by reference), never Python buffers.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from inference_service.kernels.build import load_library

CFunction = ctypes._CFuncPtr  # a loaded, typed C function
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@dataclass(frozen=True)
class Signature:
    """A C function's return type (None: void) and argument types, as ctypes takes them."""

    restype: type | None
    argtypes: tuple[type, ...]


# A family's signature is written once, as kernels.h writes its argument list once (its macros).
_FLAG = Signature(_INT, ())  # int f(void): what a library was built with, what this CPU permits
_LINEAR = Signature(_INT, (_P, _P, _P, _P, _I64, _I64, _I64, _INT))
_ADD_RMS_NORM = Signature(None, (_P, _P, _P, _P, _I64, _I64, _F32))
_ROPE_AND_CACHE = Signature(None, (_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P))
_SILU_MUL = Signature(None, (_P, _P, _I64, _I64))
_DECODE_ATTENTION = Signature(_INT, (_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32))
_PREFILL_ATTENTION = Signature(_INT, (_P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32))
_LORA = Signature(_INT, (_P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _I64, _P, _P))
_TRANSPOSE_SCALE = Signature(None, (_P, _I64, _P, _I64, _I64, _I64, _F32))

LIBRARIES: dict[str, dict[str, Signature]] = {
    "amx_linear": {
        "amx_linear_init": _FLAG,
        "amx_linear_bf16": _LINEAR,
        "amx_argmax_bf16": Signature(_INT, (_P, _P, _P, _I64, _I64, _I64, _P, _P)),
    },
    "avx2_linear": {
        "avx2_linear_init": _FLAG,
        "avx2_linear_preferred": _FLAG,
        "avx2_linear_f32": _LINEAR,
        "avx2_linear_bf16": _LINEAR,
    },
    "bf16_linear": {
        "bf16_linear_init": _FLAG,
        "bf16_linear_bf16": _LINEAR,
    },
    "quant_linear": {
        "quant_linear_vectorised": _FLAG,
        "quant_linear_allow_amx": Signature(_INT, (_INT,)),
        "quant_linear_amx_faults": _FLAG,
        "quant_linear_q8_0_f32": _LINEAR,
        "quant_linear_q8_0_bf16": _LINEAR,
        "quant_linear_q4_0_f32": _LINEAR,
        "quant_linear_q4_0_bf16": _LINEAR,
    },
    "fused": {
        "add_rms_norm_f32": _ADD_RMS_NORM,
        "add_rms_norm_bf16": _ADD_RMS_NORM,
        "rope_and_cache_f32": _ROPE_AND_CACHE,
        "rope_and_cache_bf16": _ROPE_AND_CACHE,
        "silu_mul_f32": _SILU_MUL,
        "silu_mul_bf16": _SILU_MUL,
    },
    "greedy": {"argmax_rows_f32": Signature(None, (_P, _I64, _I64, _P, _P))},
    "paged_decode_attention": {
        "paged_decode_attention_f32": _DECODE_ATTENTION,
        "paged_decode_attention_bf16": _DECODE_ATTENTION,
        "paged_decode_attention_bf16_amx": _DECODE_ATTENTION,
        "paged_decode_attention_bf16_amx_fits": Signature(_INT, (_I64, _I64, _I64, _I64)),
    },
    "paged_prefill_attention": {
        "paged_prefill_attention_f32": _PREFILL_ATTENTION,
        "paged_prefill_attention_bf16": _PREFILL_ATTENTION,
        "paged_prefill_attention_preferred": _FLAG,
    },
    "lora": {
        "lora_apply_f32": _LORA,
        "lora_apply_bf16": _LORA,
        "transpose_scale_f32": _TRANSPOSE_SCALE,
        "transpose_scale_bf16": _TRANSPOSE_SCALE,
    },
    "copy": {
        "run_copy_program": Signature(None, (_P, _I64)),
        "run_copy_program_gated": Signature(None, (_P, _I64, _P, _I64)),
        "pass_gate_open": Signature(None, (_P,)),
    },
    "decode_stack": {"decode_stack": Signature(_INT, (_P, _P, _I64, _P, _P, _P))},
}


@functools.cache
def function(library: str, symbol: str) -> CFunction | None:
    """`symbol` of the kernel library `library`, typed from the table; None (logged by the loader)
    where the library cannot be had, and the caller keeps its torch path."""
    signature = LIBRARIES[library][symbol]
    loaded = load_library(library)
    if loaded is None:
        return None
    fn = getattr(loaded, symbol)
    fn.restype, fn.argtypes = signature.restype, list(signature.argtypes)
    return fn


def address(fn: CFunction) -> int:
    """A loaded kernel's address, for C that calls it (kernels/decode_stack.c)."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return value
