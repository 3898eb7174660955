"""The suite's per-file time budgets (harness/file_durations.py, tests/budget.toml): every budgeted
file exists, and a file over its budget is named while one within it is not."""

from __future__ import annotations

from harness.file_durations import BUDGETS, budgets, over_budget
from harness.inference_server import ROOT


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
