"""The suite's per-file time budgets (harness/file_durations.py, tests/budget.toml): every budgeted
file exists, and a file over its budget is named while one within it is not; how the files are spread
over `make test`'s workers (harness/xdist_groups.py)."""

from __future__ import annotations

from harness.file_durations import BUDGETS, budgets, over_budget
from harness.inference_server import ROOT
from harness.xdist_groups import IMAGE_FILES, IMAGE_GROUP, longest_first


def test_every_budgeted_file_exists_and_has_a_positive_budget():
    allowed = budgets()
    assert allowed, f"{BUDGETS} lists no file"
    for name, seconds in allowed.items():
        assert (ROOT / name).is_file(), f"{BUDGETS} budgets {name}, which does not exist"
        assert seconds > 0, name


def test_a_file_over_its_budget_is_named_and_one_within_it_is_not():
    allowed = {"tests/test_a.py": 100.0, "tests/test_b.py": 50.0}
    assert over_budget({"tests/test_a.py": 100.0, "tests/test_b.py": 20.0, "tests/test_c.py": 900.0}, allowed) == []
    assert over_budget({"tests/test_a.py": 100.5, "tests/test_b.py": 51.0}, allowed) == [
        "tests/test_a.py: 100.5 s, budget 100 s", "tests/test_b.py: 51.0 s, budget 50 s"]


def test_the_image_files_are_one_unit_of_work_and_the_longest_units_go_first():
    """Under `make test`'s workers: each file is a unit, the files that build and run the image are one
    (so the image is built once), and units start longest first by their summed budgets."""
    files = ["tests/test_a.py", "tests/test_image.py", "tests/test_b.py", "tests/test_kubelet_pod.py",
             "tests/test_c.py"]
    allowed = {"tests/test_a.py": 100.0, "tests/test_image.py": 60.0, "tests/test_kubelet_pod.py": 60.0,
               "tests/test_c.py": 110.0}
    assert longest_first(files, allowed) == [IMAGE_GROUP, "tests/test_c.py", "tests/test_a.py", "tests/test_b.py"]


def test_every_file_that_builds_the_image_is_in_the_image_unit():
    users = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if "image_under_test(\"" in p.read_text()}
    assert users == set(IMAGE_FILES)


def test_under_two_workers_each_file_runs_on_one_worker():
    """The real scheduler (`-n 2 --dist loadgroup`, as `make test` runs it) keeps every test of a file
    on one worker (the image files together): xdist's own loadgroup scheduler, under pytest 9.2, made
    every test a unit of its own."""
    import re
    import subprocess
    import sys

    files = ["tests/test_bench_layout.py", "tests/test_demo_scoring.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "--no-loadscope-reorder", "-v", *files], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, path in re.findall(r"\[(gw\d+)\].*?PASSED (\S+?)::", run.stdout):
        workers.setdefault(path, set()).add(worker)
    assert sorted(workers) == files and all(len(w) == 1 for w in workers.values()), workers
