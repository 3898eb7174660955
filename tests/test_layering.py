"""Imports run one way (docs/architecture.md): the sidecar is the lower layer, kernels are the
ground floor, models and the LoRA pool lie below the engine, the engine knows no front end, front
ends reach the engine only through its client interface and the types it names, the interface
itself (engine/client.py) names no implementation, and benches share the harness with the tests
but import no test module.

Walks every module's imports with ast (function-level and TYPE_CHECKING imports count too).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# What a front end may import of the engine: the interface and the types that cross it.
ENGINE_INTERFACE = tuple(f"inference_service.engine.{name}" for name in ("client", "types", "request", "streams"))
# What the interface itself may import of the engine: those types and the settings it is built from.
INTERFACE_TYPES = (*ENGINE_INTERFACE, "inference_service.engine.config")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, absolute (relative imports resolved against its package)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import mod`
    return found


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(directory: str, forbidden: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """`directory` may be one module's file."""
    where = ROOT / directory
    files = [where] if where.is_file() else sorted(where.rglob("*.py"))
    assert files, f"no modules under {directory}"
    return [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in files
        for module in sorted(imports_of(path))
        if _under(module, forbidden) and not any(_under(module, a) for a in allowed)
    ]


@pytest.mark.parametrize(
    ("directory", "forbidden", "allowed"),
    [
        ("adapter_cache", "inference_service", ()),
        ("inference_service/kernels", "inference_service", ("inference_service.kernels",)),
        ("bench", "tests", ()),
        ("harness", "tests", ()),
        ("inference_service/models", "inference_service.engine", ()),
        ("inference_service/lora", "inference_service.engine", ()),
        ("inference_service/engine", "inference_service.frontend", ()),
        ("inference_service/lora", "inference_service.frontend", ()),
        ("inference_service/models", "inference_service.frontend", ()),
        ("inference_service/engine", "inference_service.cli", ()),
        ("inference_service/frontend", "inference_service.engine", ENGINE_INTERFACE),
        ("inference_service/engine/client.py", "inference_service.engine", INTERFACE_TYPES),
        ("inference_service/engine/client.py", "inference_service.models", ()),
        ("inference_service/engine/client.py", "inference_service.lora", ()),
        ("inference_service/engine/client.py", "inference_service.kernels", ()),
    ],
    ids=["sidecar-below-inference", "kernels-ground-floor", "bench-no-tests", "harness-no-tests",
         "models-below-engine", "lora-below-engine", "engine-knows-no-front-end", "lora-knows-no-front-end",
         "models-know-no-front-end", "engine-not-the-wiring", "front-ends-through-the-client",
         "interface-names-no-engine-implementation", "interface-names-no-model", "interface-names-no-lora-pool",
         "interface-names-no-kernel"],
)
def test_imports_run_one_way(directory, forbidden, allowed):
    assert _violations(directory, forbidden, allowed) == []


FRONTEND = "inference_service.frontend"
GRPC_FRONT_END = (f"{FRONTEND}.grpc_server", f"{FRONTEND}.grpc_proto")
HTTP_FRONT_END = (f"{FRONTEND}.http",)
PROCESS = f"{FRONTEND}.server"  # starts both front ends: the one module above them


def _front_end_imports(path: Path) -> list[str]:
    """The modules of a front end (or of the process above them) that `path` imports."""
    return sorted(m for m in imports_of(path) if any(_under(m, f) for f in (*GRPC_FRONT_END, *HTTP_FRONT_END, PROCESS)))


def test_front_ends_stand_side_by_side():
    """HTTP imports nothing of gRPC and gRPC nothing of HTTP; what they share (config, admission,
    intake, tenants, ...) imports neither, nor the process module that starts them."""
    frontend = ROOT / "inference_service" / "frontend"
    found = []
    for path in sorted(frontend.rglob("*.py")):
        module = _module_name(path)
        if _under(module, PROCESS):
            continue
        own = GRPC_FRONT_END if any(_under(module, m) for m in GRPC_FRONT_END) else \
            HTTP_FRONT_END if any(_under(module, m) for m in HTTP_FRONT_END) else ()
        found += [f"{path.relative_to(ROOT)} imports {m}" for m in _front_end_imports(path)
                  if not any(_under(m, o) for o in own)]
    assert found == []


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The checker itself: plain, from, relative and function-level imports are all found."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    package = tmp_path / "adapter_cache"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import inference_service.engine.in_process\n")
    (package / "b.py").write_text("def f():\n    from inference_service import engine\n")
    (package / "c.py").write_text("from . import store\nfrom ..inference_service import x\n")
    found = _violations("adapter_cache", "inference_service")
    assert found == [
        "adapter_cache/a.py imports inference_service.engine.in_process",
        "adapter_cache/b.py imports inference_service",
        "adapter_cache/b.py imports inference_service.engine",
        "adapter_cache/c.py imports inference_service",
        "adapter_cache/c.py imports inference_service.x",
    ]


@pytest.mark.parametrize(
    ("directory", "forbidden"),
    [
        ("inference_service/platform", "inference_service.engine"),
        ("inference_service/platform", "inference_service.frontend"),
        ("inference_service/models", "inference_service.platform"),
        ("inference_service/lora", "inference_service.platform"),
        ("inference_service/kernels", "inference_service.platform"),
    ],
    ids=["platform-below-engine", "platform-knows-no-front-end", "models-below-platform", "lora-below-platform",
         "kernels-below-platform"],
)
def test_the_platform_sits_between_the_models_and_the_engine(directory, forbidden):
    """The platform plan chooses for the models and the LoRA op (it imports them) and the engine follows
    it: nothing below decides, nothing above is reached."""
    assert _violations(directory, forbidden) == []


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (a `from pkg import name` counts as pkg.name where
    that is a module, else as pkg)."""
    paths = {_module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found = set()
        for name in imports_of(path):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
        graph[module] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    """No import circle between modules, function-level and TYPE_CHECKING imports included (a circle
    that an import inside a function breaks at run time is still two modules that need each other).
    A package's __init__ re-exporting its own modules is not a circle of its own."""
    graph = import_graph(("adapter_cache", "inference_service", "harness", "bench"))
    for module, imported in graph.items():  # a package importing its own submodules, or they it
        graph[module] = {m for m in imported if not (m.startswith(module + ".") or module.startswith(m + "."))}
    assert circles(graph) == []


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
