"""How `make test` spreads the suite over pytest-xdist's workers (`-n 2 --dist loadgroup`).

Most of the suite waits on the servers it starts (a file of server tests keeps about a third of a
2-core machine busy), so two workers finish it in less time than one. Each test file is one unit of
work, so that a file's module-scoped servers start once, on one worker; the files that run the CPU
image (built once per worker, then run as pods) are one unit together, so the image is built once.
Units are handed out longest first, by their budgets in tests/budget.toml (a file without a budget
counts as short), so that no long file starts last and runs alone at the end.

Only the workers' collections are changed: a run without xdist keeps pytest's own order.
"""

from __future__ import annotations

import pytest

from harness.file_durations import budgets

# Files that build and run the image (harness/pod.py's image_under_test): one worker runs them all.
IMAGE_FILES = frozenset({"tests/test_image.py", "tests/test_kubelet_pod.py"})
IMAGE_GROUP = "podman-image"


def group_of(path: str) -> str:
    """The unit of work a test file belongs to."""
    return IMAGE_GROUP if path in IMAGE_FILES else path


def longest_first(paths: list[str], allowed: dict[str, float]) -> list[str]:
    """The groups of `paths`, the longest (their files' budgets summed) first, else in first-seen order."""
    weight: dict[str, float] = {}
    for path in dict.fromkeys(paths):
        weight[group_of(path)] = weight.get(group_of(path), 0.0) + allowed.get(path, 0.0)
    return sorted(weight, key=lambda group: -weight[group])


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup`: xdist's scheduler by scope, a scope being `group_of` the test's file.
    (xdist's own loadgroup scheduler reads `xdist_group` marks from node ids that its worker hook
    rewrites through `item._nodeid`, which pytest 9.2 no longer reads: every test was a unit of its
    own, so a file's servers started on both workers and both built the image at once.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    return FileGroupScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each worker's collection, longest group first (the scheduler hands out scopes in this order
    with `--no-loadscope-reorder`)."""
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    files = [item.nodeid.split("::")[0] for item in items]
    rank = {group: i for i, group in enumerate(longest_first(files, budgets()))}
    order = {id(item): (rank[group_of(path)], i) for i, (item, path) in enumerate(zip(items, files, strict=True))}
    items.sort(key=lambda item: order[id(item)])
