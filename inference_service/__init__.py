"""loraplex's inference server (the engine, its front ends and the models)."""
import os
import sys

# How long an OpenMP thread spins at a barrier before it sleeps: set before torch loads libgomp
# (unless the operator chose: OMP_WAIT_POLICY or GOMP_SPINCOUNT), ~50 us of spinning, then sleep.
# A decode step is ~400 parallel regions (the decode stack calls a kernel per op and layer):
# - sleeping at once (PASSIVE) woke the other thread through the hypervisor at every region: a
#   SmolLM2 batch-32 step took 52 ms instead of 19 on an idle 2-core VM;
# - spinning long (libgomp's default, or ACTIVE) burns whole time slices when a neighbour holds a
#   core: 61 ms beside one busy process, 105-139 ms beside two (PASSIVE 39 and 87-97);
# - 1000 spins: 21 ms idle, 47 beside one, 49-51 beside two (docs/engine.md, "OpenMP threads
#   spin briefly at barriers").
SPIN_COUNT = "1000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
# libgomp reads its settings once, when torch loads it: imported after torch, the above came too late.
OPENMP_SETTINGS_APPLY = "torch" not in sys.modules


def openmp_wait_policy() -> str:
    """The OpenMP wait policy this process runs with, in words (benches print it)."""
    chosen = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    if not OPENMP_SETTINGS_APPLY:
        return "libgomp's default (torch was imported before inference_service)"
    return ", ".join(chosen) or "libgomp's default"
