"""What a serving process sets up for steady steps (docs/engine.md, "Pauses the serving adds").

- The engine core process freezes its start-up objects (torch, the model) out of the garbage
  collector's reach, and so does the server's main process once the engine and front ends are built:
  a full collection over them took 100-180 ms under load (bench/serving_overhead.py).
- With async scheduling the process's GIL switch interval is short, so the device worker starts the
  next step at once instead of waiting up to 5 ms for the scheduler thread's Python.
- The core process starts and serves from a process that has already run torch's thread pool (as
  this test process has); the server's main forks it, which only its fresh process can afford.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_service.device import GIL_SWITCH_INTERVAL_S
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.process import ProcessEngine
from inference_service.engine.request import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def _process_state(core: EngineCore) -> tuple[int, float]:
    return gc.get_freeze_count(), sys.getswitchinterval()


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_the_core_process_freezes_its_start_up_objects(async_scheduling: str) -> None:
    engine = ProcessEngine(EngineConfig(model="builtin:tiny", device="cpu", async_scheduling=async_scheduling))
    engine.start()
    try:
        frozen, switch_interval = engine.call(_process_state).result(timeout=60)
    finally:
        engine.shutdown()
    assert frozen > 10_000, frozen  # torch's modules, the model and the tokenizer at least
    if async_scheduling == "on":
        assert switch_interval <= GIL_SWITCH_INTERVAL_S


@pytest.mark.timeout(120)  # fails, not hangs, if the core is ever forked from here again
def test_a_core_process_started_after_a_parallel_torch_op_serves() -> None:
    # A forked child of this process would hang in its first torch op: the parallel matmul below
    # starts the OpenMP pool, which a fork does not carry over.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool even on one core; restored for the tests after this one
    try:
        torch.randn(512, 512) @ torch.randn(512, 512)
    finally:
        torch.set_num_threads(threads)
    engine = ProcessEngine(EngineConfig(model="builtin:tiny", device="cpu"))
    assert engine.start_method == "spawn"
    engine.start()
    try:
        stream = engine.add_request([256, 72, 105], SamplingParams(max_new_tokens=4, ignore_eos=True))
        outputs = list(stream)
    finally:
        engine.shutdown()
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 4


def test_async_scheduling_in_this_process_shortens_the_switch_interval() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default (a loader thread of an earlier test may have shortened it)
    try:
        core = EngineCore(EngineConfig(model="builtin:tiny", device="cpu", async_scheduling="on"))
        core.shutdown()
        assert sys.getswitchinterval() <= GIL_SWITCH_INTERVAL_S
    finally:
        sys.setswitchinterval(before)


PROBE = """
import gc, json, sys
from inference_service import cli

async def probe(*args, **kwargs):  # instead of serving: report what main set up before it
    print("PROBE " + json.dumps({"frozen": gc.get_freeze_count(),
                                 "start_method": getattr(args[0], "start_method", None)}), flush=True)

cli._serve_until_signal = probe
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_the_server_main_freezes_once_the_engine_is_built(engine_core: str) -> None:
    # The one stand-in here: serving itself, replaced by a probe, so the real main's set-up is what is checked.
    done = subprocess.run([sys.executable, "-c", PROBE, "--model", "builtin:tiny", "--device", "cpu",
                           "--engine-core", engine_core, "--listen", "127.0.0.1:0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("PROBE "))
    probe = json.loads(line.removeprefix("PROBE "))
    assert probe["frozen"] > 10_000
    if engine_core == "process":
        assert probe["start_method"] == "fork"  # fast: the core inherits the imports
