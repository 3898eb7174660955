"""Build, cache and load the CPU kernels (C sources beside this file) with the system compiler.

A library is compiled the first time a process needs it and cached under
`$LORAPLEX_KERNEL_CACHE` (default `~/.cache/loraplex/kernels`), keyed by the source, the flags
and this CPU's features, since it is built for the host's instruction set. Kernels run on
torch's own OpenMP runtime (the same `libgomp.so.1` soname, already loaded), so they use torch's
thread setting and pool. No compiler, a failed build or `LORAPLEX_CPU_KERNELS=0`: `None`, and
the caller keeps its torch path.
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

log = logging.getLogger(__name__)

# -fno-trapping-math: the kernels never read floating-point exception flags, and with GCC's default
# it will not if-convert a float compare, so any loop holding one stays scalar: vec_expf's clamp kept
# SiLU x mul and the softmax's exp loop scalar (a 32-row SiLU x mul took 300 us, ~15x its vector
# time). Results are unchanged: no reassociation, no contraction beyond -O3's own, NaN kept.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC"]


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled `<name>.c` of this package, or None (logged) where it cannot be had."""
    if os.environ.get("LORAPLEX_CPU_KERNELS", "1").strip().lower() in {"0", "false", "no", "off"}:
        log.info("CPU kernels disabled (LORAPLEX_CPU_KERNELS): %s uses its torch path", name)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s uses its torch path (slower)", name)
        return None
    source = Path(__file__).with_name(f"{name}.c")
    path = _cache_dir() / f"{name}-{_build_key(compiler, source)}.so"
    if not path.exists():
        try:
            _build(compiler, source, path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("could not build the CPU kernel %s (%s); using its torch path", name, detail)
            return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s); using its torch path", path, exc)
        return None


def address(fn: ctypes._CFuncPtr) -> int:  # type: ignore[name-defined]
    """A loaded kernel's address, for C that calls it (kernels/decode_stack.c)."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    assert value is not None
    return value


def _cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE") or Path.home() / ".cache" / "loraplex" / "kernels"
    return Path(root)


def _build_key(compiler: str, source: Path) -> str:
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the sources include
        digest.update(header.read_bytes())
    digest.update(" ".join([compiler, *_FLAGS, platform.machine()]).encode())
    try:  # -march=native: a build is only valid on CPUs with the same features
        digest.update(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).encode())
    except (OSError, StopIteration):
        digest.update(platform.processor().encode())
    return digest.hexdigest()[:16]


def _build(compiler: str, source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, "-o", tmp, str(source), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, path)
        log.info("built the CPU kernel %s: %s", source.stem, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
