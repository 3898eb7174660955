"""Every test and bench states the device it builds an engine or a slot pool on.

`EngineConfig.device` defaults to "auto", which on a CUDA host moves a test meant for the CPU (the
CPU copy engine's gating, comparisons against CPU references) to the GPU, where it hangs or
compares tensors across devices. So an `EngineConfig(...)` call must pass `device=` by name, and a
`LoRAMemoryPool(...)` its device (4th positional argument or `device=`). Servers started through
tests/infra/inference_server.py get theirs from tests/infra/devices.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Callee name -> index of its positional device argument (None: only by keyword).
DEVICE_ARG = {"EngineConfig": None, "LoRAMemoryPool": 3}


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def calls_without_device(source: str, filename: str) -> list[str]:
    """`file:line callee` of each engine/pool construction in `source` that does not state a device."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call) or _callee(node) not in DEVICE_ARG:
            continue
        position = DEVICE_ARG[_callee(node)]  # type: ignore[index]
        by_name = any(k.arg == "device" for k in node.keywords)
        by_position = position is not None and len(node.args) > position
        if not (by_name or by_position):
            found.append(f"{filename}:{node.lineno} {_callee(node)}")
    return found


def test_every_engine_and_pool_in_tests_and_benches_states_its_device():
    files = sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py")])
    missing = [hit for f in files for hit in calls_without_device(f.read_text(), str(f.relative_to(ROOT)))]
    assert not missing, "state the device (device=\"cpu\", or a DEVICES parameter):\n" + "\n".join(missing)


def test_the_check_catches_an_implicit_device():
    """The walk above can fail: an `auto` engine, a splatted config and a pool without a device are caught."""
    source = (
        "EngineConfig(model='builtin:tiny')\n"
        "EngineConfig(**config)\n"
        "LoRAMemoryPool(2, 8, shapes)\n"
        "EngineConfig(device='cpu', **config)\n"
        "LoRAMemoryPool(2, 8, shapes, torch.device('cpu'), torch.float32)\n"
    )
    assert calls_without_device(source, "t.py") == [
        "t.py:1 EngineConfig", "t.py:2 EngineConfig", "t.py:3 LoRAMemoryPool"]
