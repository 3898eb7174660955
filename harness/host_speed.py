"""How steady this machine's CPUs are: the same unit of work timed again and again on each CPU.

`python -m harness.host_speed [--seconds 30]` starts one process per CPU, pinned to it, that runs
~15 ms of tiny torch ops (what a decode step on builtin:tiny is made of: op dispatch, not arithmetic)
every 50 ms and measures the CPU time each unit took (its thread's, so waiting for the CPU does not
count). It prints each CPU's fastest unit, its median and 95th percentile against the fastest, and
the share of units 1.3x the fastest or slower.

Why: on the 2-core VMs these tests run on, the same unit took 12 to 25 ms of CPU time, in bursts
of a few seconds, on each vCPU independently, with the guest idle: another tenant of the host on
the sibling hyperthread or the memory bus, which the guest sees neither as steal (its vCPU was
running) nor in any counter (no PMU under this hypervisor). This is why no test asserts a speed
ratio (harness/isolation.py asserts a stall bound) and bench/isolation.py alternates its rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

UNIT_OPS = 1000
PAUSE_S = 0.05
SLOW = 1.3


def _time_units(cpu: int, seconds: float) -> list[float]:
    import torch

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    x0, linear = torch.randn(1, 64), torch.nn.Linear(64, 64)
    times: list[float] = []
    end = time.monotonic() + seconds
    with torch.inference_mode():
        while time.monotonic() < end:
            start = time.thread_time()
            x = x0
            for _ in range(UNIT_OPS):
                x = torch.nn.functional.silu(linear(x)) * 0.5 + x
            times.append(time.thread_time() - start)
            time.sleep(PAUSE_S)
    return times[1:]  # the first pays for warming up


def summary(cpu: int, times: list[float]) -> str:
    best = min(times)
    cuts = statistics.quantiles(times, n=20)
    slow = sum(t >= SLOW * best for t in times) / len(times)
    return (f"cpu {cpu}: {len(times)} units, fastest {best * 1e3:.1f} ms, "
            f"median {statistics.median(times) / best:.2f}x, p95 {cuts[18] / best:.2f}x, "
            f"slowest {max(times) / best:.2f}x; {slow:.0%} of units {SLOW}x the fastest or slower")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)  # a child: time on this CPU
    args = parser.parse_args()
    if args.cpu is not None:
        print(summary(args.cpu, _time_units(args.cpu, args.seconds)), flush=True)
        return
    children = [subprocess.Popen([sys.executable, "-m", "harness.host_speed", "--seconds", str(args.seconds),
                                  "--cpu", str(cpu)]) for cpu in sorted(os.sched_getaffinity(0))]
    sys.exit(max(child.wait() for child in children))


if __name__ == "__main__":
    main()
