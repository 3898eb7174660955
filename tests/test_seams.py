"""The engine's seam: front ends reach an engine only through engine.client.EngineClient.

Walks every module with ast: outside the engine's own modules nothing reads or replaces an engine's
or a core's private attribute (`engine._thread`, `core._in_flight`) or patches a core's method
(`core.step = ...`: test faults go through EngineClient.install_fault); no front-end module holds an
engine as `Any` or reaches into its core (`core.lora`: it asks the engine). Both engines implement
the interface and share its code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from inference_service.engine.client import EngineClient, EngineClientBase
from inference_service.engine.in_process import Engine
from inference_service.engine.process import ProcessEngine

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("inference_service", "harness", "bench")
# The engine and what lies below it: they may touch each other's insides.
ENGINE_PACKAGES = ("inference_service/engine/", "inference_service/lora/", "inference_service/models/",
                   "inference_service/kernels/", "inference_service/device.py")
# The front ends and the wiring that builds them.
FRONT_END_PACKAGES = ("inference_service/frontend/", "inference_service/cli.py")
ENGINE_NAME = re.compile(r"_?(\w+_)?(engine|core)$", re.IGNORECASE)


def _holder(node: ast.expr) -> str | None:
    """The name an attribute is read from: `engine` in `engine._x` and in `self.engine._x`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_engine(node: ast.expr) -> bool:
    name = _holder(node)
    return name is not None and ENGINE_NAME.fullmatch(name) is not None


def _is_any(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    return any(isinstance(n, ast.Name) and n.id == "Any" or isinstance(n, ast.Attribute) and n.attr == "Any"
               for n in ast.walk(annotation))


def private_reads(source: str, where: str) -> list[str]:
    """`x._name` where x is an engine or a core, and `x.name = ...` (a patch) on one."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            patched = isinstance(node.ctx, ast.Store | ast.Del)
            if private or patched:
                found.append((node.lineno, f"{where}:{node.lineno} {'patches' if patched else 'reads'} "
                                           f"{_holder(node.value)}.{node.attr}"))
    return [hit for _, hit in sorted(found)]


def engines_as_any(source: str, where: str) -> list[str]:
    """Parameters, fields and variables named like an engine and annotated `Any` (or `Any | ...`)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.arg) and ENGINE_NAME.fullmatch(node.arg) and _is_any(node.annotation):
            found.append((node.lineno, f"{where}:{node.lineno} {node.arg}: Any"))
        elif isinstance(node, ast.AnnAssign) and _is_engine(node.target) and _is_any(node.annotation):
            found.append((node.lineno, f"{where}:{node.lineno} {_holder(node.target)}: Any"))
    return [hit for _, hit in sorted(found)]


def _modules(*roots: str) -> list[tuple[str, str]]:
    files = sorted(path for root in roots for path in (ROOT / root).rglob("*.py"))
    assert files
    return [(str(path.relative_to(ROOT)), path.read_text()) for path in files]


def _outside_engine(where: str) -> bool:
    return not where.startswith(ENGINE_PACKAGES)


def test_no_module_outside_the_engine_reads_its_private_attributes():
    found = [hit for where, source in _modules(*SCANNED) if _outside_engine(where)
             for hit in private_reads(source, where)]
    assert found == []


def test_no_front_end_holds_an_engine_as_any():
    front_ends = [(where, source) for where, source in _modules("inference_service")
                  if where.startswith(FRONT_END_PACKAGES)]
    assert len(front_ends) >= 10
    found = [hit for where, source in front_ends for hit in engines_as_any(source, where)]
    assert found == []


def core_reads(source: str, where: str) -> list[str]:
    """Any use of an engine's core (`engine.core`, `core.lora`): a front end asks the engine instead."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and (node.attr in ("core", "_core") and _is_engine(node.value)
                                                or _holder(node.value) in ("core", "_core")):
            found.append((node.lineno, f"{where}:{node.lineno} {_holder(node.value)}.{node.attr}"))
    return [hit for _, hit in sorted(found)]


def test_no_front_end_reaches_into_the_core():
    found = [hit for where, source in _modules("inference_service")
             if where.startswith(FRONT_END_PACKAGES) for hit in core_reads(source, where)]
    assert found == []


def test_the_walks_see_what_they_look_for():
    """The checkers themselves, on code that breaks each rule and code that does not."""
    bad = """
def f(engine: Any, core) -> None:
    engine._thread.stop()
    self.engine._conn.send(1)
    core.step = slow
    x: Any | None = engine.stats()
class G:
    engine: Any
    def __init__(self, proc_engine: "Any") -> None:
        self._engine = proc_engine
        self._engine._dead = True
"""
    assert private_reads(bad, "m.py") == [
        "m.py:3 reads engine._thread", "m.py:4 reads engine._conn", "m.py:5 patches core.step",
        "m.py:11 patches _engine._dead"]
    assert engines_as_any(bad, "m.py") == ["m.py:2 engine: Any", "m.py:8 engine: Any", "m.py:9 proc_engine: Any"]
    assert core_reads("for x in core.lora.residency(): engine.core.step()", "m.py") == [
        "m.py:1 core.lora", "m.py:1 core.step", "m.py:1 engine.core"]
    good = """
def f(engine: EngineClient, other: Any) -> None:
    engine.heartbeat()
    engine.__class__
    self._engine = engine
    other._private = 1
"""
    assert private_reads(good, "m.py") == [] and engines_as_any(good, "m.py") == [] and core_reads(good, "m.py") == []


@pytest.mark.parametrize("engine", [Engine, ProcessEngine])
def test_both_engines_implement_the_one_interface(engine):
    assert issubclass(engine, EngineClientBase)
    interface = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert {"add_request", "abort", "heartbeat", "alive", "stats"} <= set(interface)
    assert [name for name in interface if not hasattr(engine, name)] == []
    annotated = set(EngineClient.__annotations__)  # config, model_info, tokenizer: set per instance
    assert annotated <= set(EngineClientBase.__annotations__)
    for name in ("add_request", "load_adapter", "unload_adapter", "list_adapters", "heartbeat",
                 "adapter_residency", "install_fault", "call"):
        assert getattr(engine, name) is getattr(EngineClientBase, name), f"{engine.__name__}.{name} is its own copy"
