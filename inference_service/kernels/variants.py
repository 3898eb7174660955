"""The named instruction-set variants the CPU kernels are built in ahead of time, and the choice of one
for a CPU by its feature flags (as llama.cpp scores its CPU backends).

Each variant is compiled with `flags` and runs on any CPU whose /proc/cpuinfo flags include
`requires`: every instruction set those compiler flags let the compiler emit. A CPU takes the
highest-scoring variant it can run. The kernels' own `#ifdef`s pick their code paths from the
compiler's ISA macros, so a variant holds exactly the paths its name says: AMX tiles only in
`sapphirerapids`, the AVX-512 BF16 conversions from `avx512-bf16` up, the AVX-512 paths from
`x86-64-v4` up, the AVX2/FMA/F16C kernels from `x86-64-v3` up, portable C in `x86-64`.
Other architectures (aarch64) have no prebuilt variants: their kernels compile at run time for the
host (`-mcpu=native`).

`LORAPLEX_CPU_VARIANT=<name>` makes the process treat the CPU as that variant's: the flags only a
higher variant needs are dropped from `cpu_flags`, which every choice reads (the kernels' variant, a
run-time build's flags, the platform plan). It runs and measures the AVX2 paths on an AVX-512 host
(torch's own kernels follow `ONEDNN_MAX_CPU_ISA` and `ATEN_CPU_CAPABILITY`).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # compiler flags that select the instruction set
    requires: frozenset[str]  # CPU flags (Linux's names) every instruction those flags allow needs
    score: int  # higher: faster where it runs


# The x86-64 micro-architecture levels (as GCC and glibc define them), by Linux's flag names.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # abm: LZCNT
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = ("-mavx512vnni", "-mavx512bf16")
_AMX = ("-mamx-tile", "-mamx-bf16", "-mamx-int8")

X86_64: tuple[Variant, ...] = (
    Variant("x86-64", ("-march=x86-64", "-mtune=generic"), frozenset(), 0),
    Variant("x86-64-v3", ("-march=x86-64-v3",), _V3, 30),  # Haswell, Zen 1-3
    Variant("x86-64-v4", ("-march=x86-64-v4",), _V4, 40),  # Skylake-SP, Ice Lake
    # Zen 4-5, Cooper Lake
    Variant("avx512-bf16", ("-march=x86-64-v4", *_BF16), _V4 | {"avx512_vnni", "avx512_bf16"}, 50),
    Variant("sapphirerapids", ("-march=x86-64-v4", *_BF16, *_AMX, "-mtune=sapphirerapids"),
            _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, 60),  # and later Xeons
)


def for_machine(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built ahead of time for an architecture (`platform.machine()` by default)."""
    machine = (machine or platform.machine()).lower()
    return X86_64 if machine in {"x86_64", "amd64"} else ()


def runnable(cpu_flags: Iterable[str], variants: Iterable[Variant]) -> list[Variant]:
    """The variants a CPU with these flags can run, best first."""
    flags = set(cpu_flags)
    return sorted((v for v in variants if v.requires <= flags), key=lambda v: -v.score)


def choose(cpu_flags: Iterable[str], variants: Iterable[Variant]) -> Variant | None:
    """The highest-scoring variant a CPU with these flags can run, or None."""
    fits = runnable(cpu_flags, variants)
    return fits[0] if fits else None


def explain(chosen: Variant | None, cpu_flags: Iterable[str], variants: Iterable[Variant]) -> str:
    """Why `chosen` (one line for the log): the better variants and the CPU flags each lacks."""
    flags = set(cpu_flags)
    better = [v for v in variants if chosen is None or v.score > chosen.score]
    missing = "; ".join(f"{v.name} needs {', '.join(sorted(v.requires - flags))}" for v in
                        sorted(better, key=lambda v: -v.score))
    head = "no variant fits this CPU" if chosen is None else f"the best this CPU runs (score {chosen.score})"
    return f"{head}{'; ' + missing if missing else ''}"


CAP_VARIABLE = "LORAPLEX_CPU_VARIANT"


def cap() -> Variant | None:
    """The variant `LORAPLEX_CPU_VARIANT` names, or None where it is unset (ValueError if it names none)."""
    name = os.environ.get(CAP_VARIABLE, "").strip()
    if not name:
        return None
    known = for_machine()
    for variant in known:
        if variant.name == name:
            return variant
    names = ", ".join(v.name for v in known) or f"none on {platform.machine()}"
    raise ValueError(f"{CAP_VARIABLE}={name!r} is not a kernel variant here (variants: {names})")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none), less those only
    variants above `LORAPLEX_CPU_VARIANT` need where it is set."""
    flags = _linux_flags()
    capped = cap()
    if capped is None:
        return flags
    above = frozenset().union(*(v.requires for v in for_machine())) - capped.requires
    wider = {f for f in flags if f.startswith(("avx512", "amx")) and f not in capped.requires}  # e.g. avx512vbmi
    return flags - above - wider


def _linux_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
