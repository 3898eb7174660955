"""Benchmarks are modules of the `bench` package, run as `python -m bench.NAME` from the repository
root: none edits sys.path or imports another bench (what they share lives in harness/, which imports
no bench), and each has a main guard, so importing one runs nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # `from . import x` inside bench/ is bench importing bench
                module = "bench" + (f".{module}" if module else "")
            found.add(module)
    return found


def _uses_sys_path(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
               and node.value.id == "sys" for node in ast.walk(ast.parse(path.read_text(), str(path))))


def test_benches_are_a_package_and_none_edits_sys_path():
    assert (ROOT / "bench" / "__init__.py").is_file()
    assert len(BENCHES) > 10
    assert [p.name for p in BENCHES if _uses_sys_path(p)] == []


def test_no_bench_imports_another_and_the_harness_imports_none():
    importing = [f"{p.relative_to(ROOT)} imports {m}" for p in [*BENCHES, *sorted((ROOT / "harness").glob("*.py"))]
                 for m in sorted(_imports(p)) if m == "bench" or m.startswith("bench.")]
    assert importing == []


def test_every_bench_runs_only_as_a_script():
    missing = [p.name for p in BENCHES if 'if __name__ == "__main__":' not in p.read_text()]
    assert missing == []


def test_the_walks_see_what_they_look_for(tmp_path):
    """The checks themselves: a sys.path edit and a bench import, absolute or relative, are found."""
    script = tmp_path / "x.py"
    script.write_text("import sys\nsys.path.insert(0, '.')\nfrom bench.roofline import engine\nfrom . import prefill\n")
    assert _uses_sys_path(script)
    assert {"bench.roofline", "bench"} <= _imports(script)


def test_the_one_percentile_interpolates_between_nearest_ranks():
    import math
    import random
    import statistics

    from harness.bench import percentile

    rng = random.Random(7)
    values = [rng.uniform(0, 10) for _ in range(37)]
    for k in (1, 50, 90, 99):
        assert math.isclose(percentile(values, k / 100),
                            statistics.quantiles(values, n=100, method="inclusive")[k - 1])
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0 and percentile([3.0, 1.0, 2.0], 1.0) == 3.0
    assert percentile([5.0], 0.99) == 5.0 and math.isnan(percentile([], 0.5))
