"""The CPU kernels' build: one header every source is compiled against, the ctypes table that matches
it, the named instruction-set variants built ahead of time and the one a CPU takes, and the run-time
build as a logged fallback (stale or missing prebuilt libraries, no compiler, a read-only cache)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_service.kernels import bindings, build, fused, greedy, variants
from inference_service.kernels.variants import X86_64

needs_compiler = pytest.mark.skipif(build.find_compiler() is None, reason="needs a C compiler")
needs_x86 = pytest.mark.skipif(not variants.for_machine(), reason="prebuilt variants exist on x86-64 only")

# What Linux lists for a few CPUs (the ISA flags only; the choice ignores the rest).
_V3_CPU = {"sse2", "ssse3", "sse4_1", "sse4_2", "pni", "popcnt", "cx16", "lahf_lm", "avx", "avx2", "fma", "f16c",
           "bmi1", "bmi2", "abm", "movbe", "xsave"}  # AMD Zen 2, Intel Haswell
_SKYLAKE_SP = _V3_CPU | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_ZEN4 = _SKYLAKE_SP | {"avx512_vnni", "avx512_bf16", "avx512ifma", "avx512vbmi", "avx512_vbmi2"}
_SAPPHIRE_RAPIDS = _ZEN4 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}


@pytest.mark.parametrize(("cpu", "expected"), [
    (_SAPPHIRE_RAPIDS, "sapphirerapids"),
    (_ZEN4, "avx512-bf16"),
    (_SKYLAKE_SP, "x86-64-v4"),
    (_V3_CPU, "x86-64-v3"),
    (_SKYLAKE_SP - {"avx512bw"}, "x86-64-v3"),  # AVX-512F without the rest of x86-64-v4 (Xeon Phi)
    (_V3_CPU - {"f16c"}, "x86-64"),
    (set(), "x86-64"),
])
def test_a_cpu_takes_the_best_variant_its_flags_allow(cpu, expected):
    chosen = variants.choose(cpu, X86_64)
    assert chosen is not None and chosen.name == expected
    assert [v.name for v in variants.runnable(cpu, X86_64)][0] == expected
    assert all(v.requires <= cpu for v in variants.runnable(cpu, X86_64))


def test_the_choice_is_explained_by_the_flags_the_better_variants_lack():
    why = variants.explain(variants.choose(_ZEN4, X86_64), _ZEN4, X86_64)
    assert "score 50" in why and "sapphirerapids needs amx_bf16, amx_int8, amx_tile" in why
    assert variants.explain(variants.choose(_SAPPHIRE_RAPIDS, X86_64), _SAPPHIRE_RAPIDS, X86_64).endswith("(score 60)")


def test_other_architectures_have_no_prebuilt_variants_and_compile_for_the_host(monkeypatch):
    monkeypatch.delenv("LORAPLEX_CPU_VARIANT", raising=False)
    assert variants.for_machine("aarch64") == ()
    assert variants.for_machine("x86_64") == X86_64
    assert build.native_flags("aarch64") == ("-mcpu=native",)
    assert build.native_flags("x86_64") == ("-march=native",)


def test_a_capped_process_sees_only_the_flags_its_variant_needs(monkeypatch):
    """LORAPLEX_CPU_VARIANT: a Sapphire Rapids CPU taken as x86-64-v3 lists no AVX-512 or AMX flag (not
    even those no variant requires), chooses that variant and builds at run time with its flags; a
    name that is no variant is refused, naming the variants."""
    monkeypatch.delenv("LORAPLEX_CPU_VARIANT", raising=False)
    monkeypatch.setattr(variants, "_linux_flags", lambda: frozenset(_SAPPHIRE_RAPIDS))
    monkeypatch.setattr(variants, "for_machine", lambda machine=None: X86_64)
    assert variants.cpu_flags() == _SAPPHIRE_RAPIDS
    monkeypatch.setenv("LORAPLEX_CPU_VARIANT", "x86-64-v3")
    assert variants.cpu_flags() == _V3_CPU
    assert variants.choose(variants.cpu_flags(), X86_64).name == "x86-64-v3"
    assert build.native_flags() == ("-march=x86-64-v3",)
    monkeypatch.setenv("LORAPLEX_CPU_VARIANT", "avx512-bf16")
    assert variants.cpu_flags() == _ZEN4 - {"avx512ifma", "avx512vbmi", "avx512_vbmi2"}
    monkeypatch.setenv("LORAPLEX_CPU_VARIANT", "zen9")
    with pytest.raises(ValueError, match="'zen9' is not a kernel variant here .*x86-64-v3"):
        variants.cpu_flags()


@needs_x86
def test_a_process_capped_at_x86_64_v3_plans_the_avx2_paths():
    """The whole platform plan of a process run with LORAPLEX_CPU_VARIANT=x86-64-v3 on this CPU: the
    AVX2 variant's kernels and no AVX-512 flag in the plan, as on an AVX2-only host."""
    if not _V3_CPU - {"abm", "lahf_lm", "pni", "xsave", "movbe"} <= variants.cpu_flags():
        pytest.skip("this CPU cannot run the x86-64-v3 variant")
    script = ("import json, torch; from harness.platform import plan_for; "
              "print(json.dumps(dict(plan_for('cpu', torch.bfloat16).rows())))")
    env = {**os.environ, "LORAPLEX_CPU_VARIANT": "x86-64-v3"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert rows["cpu flags"] == "avx2 fma", rows
    assert rows["linear packing"].startswith("avx2 > "), rows
    assert rows["quantized weights"] == "Q8_0/Q4_0 kernel: AVX2 (vpmaddubsw)", rows


# The compiler's ISA macros and the CPU flag each needs (Linux's names).
_MACRO_FLAGS = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2", "__POPCNT__": "popcnt",
    "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI__": "bmi1",
    "__BMI2__": "bmi2", "__LZCNT__": "abm", "__MOVBE__": "movbe", "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw", "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq", "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16", "__AVX512FP16__": "avx512_fp16",
    "__AVX512VBMI__": "avx512vbmi", "__AVX512IFMA__": "avx512ifma", "__AVXVNNI__": "avx_vnni", "__GFNI__": "gfni",
    "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq", "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}


def _macros(flags: tuple[str, ...]) -> set[str]:
    compiler = build.find_compiler()
    assert compiler is not None
    out = subprocess.run([compiler, *flags, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


@needs_compiler
@pytest.mark.parametrize("variant", X86_64, ids=lambda v: v.name)
def test_each_variant_requires_every_instruction_set_its_flags_enable(variant):
    """A CPU that takes a variant can run every instruction its compiler flags allow; the kernels'
    ISA paths land in the variants named for them (AMX tiles only in sapphirerapids, AVX-512 BF16
    from avx512-bf16 up, AVX-512 from x86-64-v4 up, AVX2/FMA/F16C from x86-64-v3 up)."""
    macros = _macros(variant.flags)
    needed = {flag for macro, flag in _MACRO_FLAGS.items() if macro in macros}
    assert needed <= variant.requires, f"{variant.name} lacks {sorted(needed - variant.requires)}"
    assert ({"__AMX_TILE__", "__AMX_BF16__", "__AVX512BF16__"} <= macros) == (variant.name == "sapphirerapids")
    assert ("__AVX512BF16__" in macros) == (variant.score >= 50)
    assert ("__AVX512F__" in macros) == (variant.score >= 40)
    assert ({"__AVX2__", "__FMA__", "__F16C__"} <= macros) == (variant.score >= 30)


@needs_compiler
@needs_x86
def test_the_variants_build_their_kernels_paths(tmp_path):
    """amx_linear, bf16_linear, avx2_linear and quant_linear in every variant: AMX tile products (bf16 and
    int8) only in sapphirerapids, `vdpbf16ps` projections from avx512-bf16 up; each variant this CPU runs
    reports the paths its name says (AVX2 kernel from x86-64-v3 up, preferred only below AVX-512)."""
    libraries = ["amx_linear", "avx2_linear", "bf16_linear", "quant_linear"]
    manifest = build.build_all(tmp_path, X86_64, libraries=libraries)
    assert set(manifest) == {v.name for v in X86_64}
    for variant in X86_64:
        assert manifest[variant.name] == {name: build.source_key(name, variant.flags) for name in libraries}
        if shutil.which("objdump"):
            def code(library: str) -> str:
                return subprocess.run(["objdump", "-d", str(tmp_path / variant.name / f"{library}.so")],  # noqa: B023
                                      capture_output=True, text=True, check=True).stdout
            assert ("tdpbf16ps" in code("amx_linear")) == (variant.name == "sapphirerapids")
            assert ("tdpbsud" in code("quant_linear")) == (variant.name == "sapphirerapids")
            assert ("vdpbf16ps" in code("bf16_linear")) == (variant.score >= 50)
    for variant in variants.runnable(variants.cpu_flags(), X86_64):
        avx2 = ctypes.CDLL(str(tmp_path / variant.name / "avx2_linear.so"))
        assert avx2.avx2_linear_init() == (variant.score >= 30)
        assert avx2.avx2_linear_preferred() == (30 <= variant.score < 40)
        assert ctypes.CDLL(str(tmp_path / variant.name / "bf16_linear.so")).bf16_linear_init() == (variant.score >= 50)
    assert build.build_all(tmp_path, X86_64, libraries=libraries) == manifest  # up to date


_KERNELS_H = Path(build.SOURCES) / "kernels.h"


@needs_compiler
@pytest.mark.parametrize("flags", [v.flags for v in variants.for_machine()] or [build.native_flags()],
                         ids=lambda f: " ".join(f))
def test_every_source_compiles_against_the_header_without_a_warning(flags):
    """Every definition matches its prototype in kernels.h and every exported function has one
    (-Wmissing-prototypes), in each variant's #ifdef branches."""
    compiler = build.find_compiler()
    assert compiler is not None
    sources = [build.SOURCES / f"{name}.c" for name in build.LIBRARIES]
    for source in sources:
        assert '#include "kernels.h"' in source.read_text(), f"{source.name} does not include kernels.h"
    result = subprocess.run([compiler, *flags, "-fopenmp", "-fsyntax-only", "-Wall", "-Wextra", "-Wmissing-prototypes",
                             "-Wno-psabi", "-Werror", *map(str, sources)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


_CTYPE = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "void": None}


def _prototypes() -> dict[str, bindings.Signature]:
    """kernels.h's function prototypes (macros expanded), in ctypes' terms."""
    compiler = build.find_compiler()
    assert compiler is not None
    text = subprocess.run([compiler, "-E", "-P", str(_KERNELS_H)], capture_output=True, text=True,
                          check=True).stdout
    text = text[text.index("linear_fn"):]  # past <stdint.h>'s own declarations
    found = {}
    for ret, name, args in re.findall(r"^(int|void) (\w+) ?\(([^()]*)\);", text, re.MULTILINE):
        params = [] if args.strip() == "void" else [a.strip() for a in args.split(",")]
        found[name] = bindings.Signature(_CTYPE[ret], tuple(
            ctypes.c_void_p if "*" in p else _CTYPE[p.rsplit(" ", 1)[0].replace("const ", "")] for p in params))
    return found


@needs_compiler
def test_the_binding_table_is_the_header():
    """Each function in the ctypes table has kernels.h's signature, and every prototype is in it."""
    table = {symbol: signature for functions in bindings.LIBRARIES.values() for symbol, signature in functions.items()}
    assert _prototypes() == table
    assert set(bindings.LIBRARIES) == set(build.LIBRARIES)


@pytest.fixture
def isolated_kernels(monkeypatch, tmp_path):
    """A prebuilt directory and a run-time cache of the test's own, the process's loaded kernels
    forgotten before and after."""
    prebuilt, cache = tmp_path / "prebuilt", tmp_path / "cache"
    monkeypatch.setenv("LORAPLEX_KERNEL_PREBUILT", str(prebuilt))
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(cache))
    monkeypatch.delenv("LORAPLEX_CPU_KERNELS", raising=False)
    forget()
    yield prebuilt, cache
    forget()


def forget() -> None:
    for cached in (build.load_library, bindings.function, greedy._function, fused._function):
        cached.cache_clear()


def _this_cpus_variant() -> variants.Variant:
    chosen = variants.choose(variants.cpu_flags(), variants.for_machine())
    assert chosen is not None
    return chosen


@needs_compiler
@needs_x86
def test_a_fresh_prebuilt_library_loads_without_compiling(isolated_kernels, caplog):
    prebuilt, cache = isolated_kernels
    build.build_all(prebuilt, [_this_cpus_variant()], libraries=["greedy"])
    with caplog.at_level(logging.INFO, logger="inference_service.kernels.build"):
        assert build.load_library("greedy") is not None
    assert not cache.exists(), "nothing was compiled at run time"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@needs_compiler
@needs_x86
@pytest.mark.parametrize("damage", ["stale", "missing"])
def test_a_stale_or_missing_prebuilt_library_is_built_at_run_time_with_a_warning(isolated_kernels, caplog, damage):
    prebuilt, cache = isolated_kernels
    variant = _this_cpus_variant()
    manifest = build.build_all(prebuilt, [variant], libraries=["greedy"])
    if damage == "stale":  # built from other sources than these
        manifest[variant.name]["greedy"] = "0" * 16
        build._write_manifest(prebuilt, manifest)
    else:
        (prebuilt / variant.name / "greedy.so").unlink()
    assert build.load_library("greedy") is not None
    assert bindings.function("greedy", "argmax_rows_f32") is not None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("greedy" in w and ("stale" if damage == "stale" else "no prebuilt") in w and "at run time" in w
               for w in warnings), warnings
    assert [p.name.rsplit("-", 1)[0] for p in cache.iterdir() if p.suffix == ".so"] == ["greedy"]


@pytest.mark.parametrize("compiler", ["none", "cc"])
def test_no_prebuilt_and_no_run_time_build_says_the_torch_path_runs(isolated_kernels, caplog, monkeypatch,
                                                                     tmp_path_factory, compiler):
    """A read-only root filesystem with no prebuilt kernels: without a compiler, or with one and a
    cache it cannot write, each kernel's torch path runs, and the log says so at WARNING."""
    _, cache = isolated_kernels
    blocker = tmp_path_factory.mktemp("ro") / "file"
    blocker.write_text("")  # a cache under a regular file cannot be created, even by root
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(blocker / "kernels"))
    if compiler == "none":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-bin")))
    elif build.find_compiler() is None:
        pytest.skip("needs a C compiler")
    assert greedy.argmax_rows(torch.zeros(2, 4)) is None
    assert not fused.available(torch.device("cpu"), torch.float32)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("greedy" in w and "torch path runs" in w for w in warnings), warnings
    assert any(("no C compiler" if compiler == "none" else "could not build") in w for w in warnings), warnings


@needs_compiler
def test_the_python_mirrors_of_the_header_structs_have_its_layout(tmp_path):
    """models/decode_stack.py's and kernels/copy.py's ctypes structs: each field at kernels.h's offset."""
    from inference_service.kernels import copy as copy_kernels
    from inference_service.models import decode_stack

    mirrors = {"DecodeKernels": decode_stack._Kernels, "DecodeProjection": decode_stack._Projection,
               "DecodeLayer": decode_stack._Layer, "DecodeStep": decode_stack._Step,
               "PassGate": copy_kernels._GateWord}
    lines = [f'printf("{struct} sizeof %zu\\n", sizeof({struct}));' for struct in mirrors]
    lines += [f'printf("{struct} {field} %zu\\n", offsetof({struct}, {field}));'
              for struct, mirror in mirrors.items() for field, _ in mirror._fields_]
    lines += ['printf("CopyOp sizeof %zu\\n", sizeof(CopyOp));']
    program = tmp_path / "layout.c"
    program.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "kernels.h"\nint main(void) {\n'
                       + "\n".join(lines) + "\nreturn 0;\n}\n")
    compiler = build.find_compiler()
    assert compiler is not None
    subprocess.run([compiler, f"-I{build.SOURCES}", "-o", str(tmp_path / "layout"), str(program)], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout
    c_layout = {(struct, field): int(value) for struct, field, value in (line.split() for line in out.splitlines())}
    py_layout = {(struct, "sizeof"): ctypes.sizeof(mirror) for struct, mirror in mirrors.items()}
    py_layout |= {(struct, field): getattr(mirror, field).offset for struct, mirror in mirrors.items()
                  for field, _ in mirror._fields_}
    py_layout[("CopyOp", "sizeof")] = copy_kernels._OP.size
    assert py_layout == c_layout
