"""Build and load the CPU kernels (C sources beside this file): prebuilt at install, compiled at run
time only as a fallback.

Ahead of time, `python -m inference_service.kernels.build --all` compiles every library in every
named instruction-set variant (kernels/variants.py) into `prebuilt/<variant>/<name>.so` beside this
file (or `$LORAPLEX_KERNEL_PREBUILT`), with `prebuilt/manifest.json` recording each library's source
key: a hash of its source, the headers and the variant's flags. `make install` and the image's build
stage run it; the runtime image needs no compiler.

At run time a process takes the best variant this CPU runs (logged once, with why) and loads its
library where the manifest says it was built from these very sources. Where it is missing or stale
(or will not load) the library is compiled for this CPU (`-march=native`; `-mcpu=native` off x86)
into `$LORAPLEX_KERNEL_CACHE` (default `~/.cache/loraplex/kernels`), logged as a WARNING; where that
fails too (no compiler, a read-only cache) a lower variant's fresh library is taken if there is one,
else the caller keeps its torch path, logged as a WARNING. `LORAPLEX_CPU_KERNELS=0` turns the
kernels off. Kernels run on torch's own OpenMP runtime (the same `libgomp.so.1` soname, already
loaded), so they use torch's thread setting and pool.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inference_service.kernels import variants
from inference_service.kernels.variants import Variant

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent
LIBRARIES = tuple(sorted(p.stem for p in SOURCES.glob("*.c")))
MANIFEST = "manifest.json"

# -fno-trapping-math: the kernels never read floating-point exception flags, and with GCC's default
# it will not if-convert a float compare, so any loop holding one stays scalar: vec_expf's clamp kept
# SiLU x mul and the softmax's exp loop scalar (a 32-row SiLU x mul took 300 us, ~15x its vector
# time). Results are unchanged: no reassociation, no contraction beyond -O3's own, NaN kept.
_COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-trapping-math", "-shared", "-fPIC")


def native_flags(machine: str | None = None) -> tuple[str, ...]:
    """The flags of a run-time build for this host's own CPU (the capped variant's under
    LORAPLEX_CPU_VARIANT)."""
    capped = variants.cap()
    if capped is not None:
        return capped.flags
    machine = (machine or platform.machine()).lower()
    return ("-march=native",) if machine in {"x86_64", "amd64", "i686"} else ("-mcpu=native",)


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled `<name>.c` of this package, or None (logged) where it cannot be had."""
    if os.environ.get("LORAPLEX_CPU_KERNELS", "1").strip().lower() in {"0", "false", "no", "off"}:
        log.info("CPU kernels disabled (LORAPLEX_CPU_KERNELS): %s uses its torch path", name)
        return None
    library = _load(name)
    if library is not None:
        _loaded.add(name)
    return library


_loaded: set[str] = set()


def loaded() -> list[str]:
    """The kernel libraries this process has loaded so far."""
    return sorted(_loaded)


def _load(name: str) -> ctypes.CDLL | None:
    candidates = _runnable_variants()
    manifest = read_manifest(prebuilt_dir())
    if candidates:
        best = candidates[0]
        library = _load_prebuilt(name, best, manifest)
        if library is not None:
            return library
        log.warning("CPU kernel %s: %s; compiling it for this CPU at run time (the image or `make install` "
                    "should have built it: python -m inference_service.kernels.build --all)", name,
                    _why_not_prebuilt(name, best, manifest))
    library = _load_runtime_build(name)
    if library is not None:
        return library
    for lower in candidates[1:]:
        library = _load_prebuilt(name, lower, manifest)
        if library is not None:
            log.warning("CPU kernel %s: using the prebuilt %s variant (slower than %s)", name, lower.name,
                        candidates[0].name)
            return library
    log.warning("CPU kernel %s is not available (no fresh prebuilt library, no run-time build): its torch "
                "path runs (slower)", name)
    return None


def prebuilt_dir() -> Path:
    """Where the ahead-of-time variants are (and `--all` writes them)."""
    return Path(os.environ.get("LORAPLEX_KERNEL_PREBUILT") or SOURCES / "prebuilt")


def source_key(name: str, flags: Sequence[str]) -> str:
    """What a build of `<name>.c` with `flags` depends on: its source, every header, the flags."""
    digest = hashlib.sha256((SOURCES / f"{name}.c").read_bytes())
    for header in sorted(SOURCES.glob("*.h")):  # what the sources include
        digest.update(header.name.encode() + header.read_bytes())
    digest.update(" ".join([*_COMMON_FLAGS, *flags]).encode())
    return digest.hexdigest()[:16]


def read_manifest(root: Path) -> dict[str, dict[str, str]]:
    """variant -> library -> the source key it was built from ({} where there is none)."""
    try:
        data = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("variants", {}) if isinstance(data, dict) else {}


@functools.cache
def _runnable_variants() -> list[Variant]:
    """This CPU's prebuilt-variant candidates, best first; the choice logged once per process."""
    known = variants.for_machine()
    if not known:
        log.info("CPU kernels: no prebuilt variants for %s; they compile at run time for this CPU (%s)",
                 platform.machine(), " ".join(native_flags()))
        return []
    flags = variants.cpu_flags()
    fits = variants.runnable(flags, known)
    chosen = fits[0] if fits else None
    log.info("CPU kernels: variant %s, %s", chosen.name if chosen else None, variants.explain(chosen, flags, known))
    return fits


def _why_not_prebuilt(name: str, variant: Variant, manifest: dict[str, dict[str, str]]) -> str:
    built = manifest.get(variant.name, {}).get(name)
    path = prebuilt_dir() / variant.name / f"{name}.so"
    if built is None or not path.exists():
        return f"no prebuilt {variant.name} library in {prebuilt_dir()}"
    if built != source_key(name, variant.flags):
        return f"the prebuilt {variant.name} library is stale (built from other sources)"
    return f"the prebuilt {variant.name} library would not load"


def _load_prebuilt(name: str, variant: Variant, manifest: dict[str, dict[str, str]]) -> ctypes.CDLL | None:
    path = prebuilt_dir() / variant.name / f"{name}.so"
    if manifest.get(variant.name, {}).get(name) != source_key(name, variant.flags) or not path.exists():
        return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s)", path, exc)
        return None
    log.debug("CPU kernel %s: prebuilt %s", name, path)
    return library


def _load_runtime_build(name: str) -> ctypes.CDLL | None:
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: CPU kernel %s cannot be built at run time", name)
        return None
    path = _cache_dir() / f"{name}-{_runtime_key(compiler, name)}.so"
    if not path.exists():
        try:
            compile_library(compiler, name, native_flags(), path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("could not build the CPU kernel %s (%s)", name, detail)
            return None
        log.info("built the CPU kernel %s at run time for this CPU: %s", name, path)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("could not load %s (%s)", path, exc)
        return None


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_KERNEL_CACHE") or Path.home() / ".cache" / "loraplex" / "kernels"
    return Path(root)


def _runtime_key(compiler: str, name: str) -> str:
    digest = hashlib.sha256(source_key(name, native_flags()).encode())
    digest.update(" ".join([compiler, platform.machine()]).encode())
    # -march=native: a build is only valid on CPUs with the same features
    digest.update(" ".join(sorted(variants.cpu_flags())).encode() or platform.processor().encode())
    return digest.hexdigest()[:16]


def compile_library(compiler: str, name: str, flags: Sequence[str], path: Path) -> None:
    """`<name>.c` compiled with `flags` to `path` (raises OSError or SubprocessError where it fails)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_COMMON_FLAGS, *flags, "-o", tmp, str(SOURCES / f"{name}.c"), "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        # mkstemp makes the file 0600: a library built by one user (the image's build, a shared install)
        # must load for the uid that serves.
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def build_all(root: Path, chosen: Iterable[Variant], libraries: Iterable[str] = LIBRARIES, jobs: int = 0,
              compiler: str | None = None) -> dict[str, dict[str, str]]:
    """Every library in every variant under `root`, skipping those already fresh there; the manifest
    is rewritten with what is fresh. Returns it. Raises CalledProcessError on a failed build."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler (set CC, or install cc/gcc) to build the CPU kernels with")
    manifest = read_manifest(root)
    todo = []
    for variant in chosen:
        built = manifest.setdefault(variant.name, {})
        for name in libraries:
            key = source_key(name, variant.flags)
            if built.get(name) != key or not (root / variant.name / f"{name}.so").exists():
                built.pop(name, None)
                todo.append((variant, name, key))

    def build(item: tuple[Variant, str, str]) -> tuple[Variant, str, str]:
        variant, name, _ = item
        compile_library(compiler, name, variant.flags, root / variant.name / f"{name}.so")
        return item

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        try:
            for variant, name, key in pool.map(build, todo):
                manifest[variant.name][name] = key
        finally:  # what was built stays recorded, even when a later build failed
            _write_manifest(root, manifest)
    return manifest


def _write_manifest(root: Path, manifest: dict[str, dict[str, str]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"variants": manifest}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference_service.kernels.build",
                                     description="Build the CPU kernels in every named instruction-set variant.")
    parser.add_argument("--all", action="store_true", help="every library in every variant of this architecture")
    parser.add_argument("--variant", action="append", default=[], help="only this variant (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="the prebuilt directory (default: the package's)")
    parser.add_argument("--jobs", type=int, default=0, help="parallel compiles (default: the CPU count)")
    args = parser.parse_args(argv)
    known = variants.for_machine()
    if not args.all and not args.variant:
        parser.error("say --all or --variant NAME")
    unknown = set(args.variant) - {v.name for v in known}
    if unknown:
        parser.error(f"unknown variant(s) {sorted(unknown)}; this architecture has {[v.name for v in known]}")
    chosen = [v for v in known if args.all or v.name in args.variant]
    root = args.out or prebuilt_dir()
    if not chosen:
        print(f"no prebuilt variants for {platform.machine()}: the kernels compile at run time "
              f"({' '.join(native_flags())})")
        return 0
    start = time.monotonic()
    try:
        build_all(root, chosen, jobs=args.jobs)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"kernel build failed: {getattr(exc, 'stderr', '') or exc}", file=sys.stderr)
        return 1
    print(f"built {len(LIBRARIES)} kernel libraries x {len(chosen)} variants "
          f"({', '.join(v.name for v in chosen)}) in {root} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
