"""Paged decode attention on CPU, in C (`paged_decode_attention.c`), read in place from the blocks.

The library is compiled with the system C compiler the first time a process needs it and cached
under `$LORAPLEX_KERNEL_CACHE` (default `~/.cache/loraplex/kernels`), keyed by the source, the
flags and this CPU's features, since it is built for the host's instruction set. It runs on
torch's own OpenMP runtime (the same `libgomp.so.1` soname, already loaded), so it uses torch's
thread setting and pool. No compiler, a failed build or `LORAPLEX_CPU_KERNELS=0`: `None`, and
the model keeps its torch path (gather the blocks, then SDPA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_SYMBOLS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}


def prepare(device: torch.device, dtype: torch.dtype) -> bool:
    """Build (or load) the kernel now, at start-up, rather than in the first request's decode step.
    True if decode attention on this device and dtype will use it."""
    return device.type == "cpu" and dtype in _SYMBOLS and _kernel(dtype) is not None


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor | None:
    """softmax(q Kᵀ/√d) V per sequence over its first `context_lens[b]` cached tokens.

    q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] and
    context_lens [B] int64. None where the kernel cannot run (caller falls back)."""
    if not _supported(q, k_cache, v_cache, block_tables, context_lens):
        return None
    kernel = _kernel(q.dtype)
    if kernel is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    status = kernel(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), batch, q_heads, kv_heads, head_dim, block_size, block_tables.shape[1], head_dim**-0.5,
    )
    if status != 0:
        raise MemoryError("paged decode attention kernel: out of memory for its scratch buffers")
    return out


def _supported(q, k_cache, v_cache, block_tables, context_lens) -> bool:  # type: ignore[no-untyped-def]
    q_heads, kv_heads = q.shape[1], k_cache.shape[2]
    return (
        q.device.type == "cpu"
        and q.dtype in _SYMBOLS
        and k_cache.dtype == v_cache.dtype == q.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and block_tables.dtype == context_lens.dtype == torch.int64
        and block_tables.is_contiguous()
        and context_lens.is_contiguous()
        and q_heads % kv_heads == 0
    )


@functools.cache
def _kernel(dtype: torch.dtype) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    library = _library()
    if library is None:
        return None
    fn = getattr(library, _SYMBOLS[dtype])
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    return fn


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("LORAPLEX_CPU_KERNELS", "1").strip().lower() in {"0", "false", "no", "off"}:
        log.info("CPU kernels disabled (LORAPLEX_CPU_KERNELS): decode attention gathers blocks, then SDPA")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention on CPU gathers blocks, then SDPA (slower)")
        return None
    path = _cache_dir() / f"paged_decode_attention-{_build_key(compiler)}.so"
    if not path.exists():
        try:
            _build(compiler, path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("could not build the CPU decode attention kernel (%s); using gather + SDPA", detail)
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s); using gather + SDPA", path, exc)
        return None


def _cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE") or Path.home() / ".cache" / "loraplex" / "kernels"
    return Path(root)


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256(_SOURCE.read_bytes())
    digest.update(" ".join([compiler, *_FLAGS, platform.machine()]).encode())
    try:  # -march=native: a build is only valid on CPUs with the same features
        digest.update(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).encode())
    except (OSError, StopIteration):
        digest.update(platform.processor().encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, path)
        log.info("built the CPU decode attention kernel: %s", path)
    finally:
        Path(tmp).unlink(missing_ok=True)
