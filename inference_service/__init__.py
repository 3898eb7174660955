"""loraplex's inference server (the engine, its front ends and the models)."""
import os

# OpenMP threads that wait at a barrier sleep at once instead of spinning (unless the operator chose
# otherwise; it must be set before torch loads libgomp). The engine's two or more torch threads meet
# at a barrier in every op of every step, and this process's own threads (front ends, adapter loads,
# grammar compiles) and any neighbour share the cores: with spinning waiters, a thread preempted at a
# barrier made the others burn their slices, and a decode step on the 2-core machine slowed ~10x at
# load 3 (64 requests: 400-1200 tok/s spinning, 2700-4000 sleeping; the prefix-cache hit step's worst
# 854 ms vs 93 ms). Dedicated cores may prefer OMP_WAIT_POLICY=ACTIVE (docs/architecture.md).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
