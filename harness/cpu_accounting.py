"""Who used the machine's CPUs: this test's own process tree, or someone else.

A timing assertion on a 2-core machine (the isolation victim's runs) is only a measurement of our
code while nothing else competes for the CPUs. `snapshot()` reads /proc: the machine's busy time
(steal included: a VM's host taking the CPU counts as someone else), the CPU time of this process
and every live descendant (the servers, the victim, attack clients), children they already reaped
included, and how long their threads waited on a run queue (schedstat). Between two snapshots,
`foreign_cores` is the CPU the rest of the machine used and `our_waiting` the time our threads were
ready to run but not running, both in cores (1.0: one CPU's worth of the wall time).

Others taking more CPU is not enough to excuse a slow victim: they also fill CPU our processes
leave idle (a stalled server). It is when our threads also waited longer to run that the machine,
not the code under test, was what was slow.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSnapshot:
    at: float  # time.monotonic()
    machine_busy: int  # ticks, all CPUs: user nice system irq softirq steal
    ours: int  # ticks: this process tree's user + system time, reaped children included
    our_wait_ns: int  # this process tree's live threads' time waiting on a run queue


def _machine_busy() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq + steal


def _run_queue_wait_ns(pid: int) -> int:
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, its own and its reaped children's CPU ticks)."""
    found: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        # After the command: state ppid ... utime(11) stime(12) cutime(13) cstime(14)
        found[int(entry.name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]))
    return found


def snapshot(root: int | None = None) -> CpuSnapshot:
    """The machine's and `root`'s process tree's CPU ticks so far (root: this process)."""
    root = os.getpid() if root is None else root
    processes = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    ours, waited, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        ours += processes.get(pid, (0, 0))[1]
        waited += _run_queue_wait_ns(pid)
        todo.extend(children.get(pid, ()))
    return CpuSnapshot(time.monotonic(), _machine_busy(), ours, waited)


def foreign_cores(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """The CPU the rest of the machine used from `before` to `after`, in cores on average. Process
    times are sampled a little after the machine's, so a short window can read slightly negative."""
    seconds = after.at - before.at
    if seconds <= 0:
        return 0.0
    foreign = (after.machine_busy - before.machine_busy) - (after.ours - before.ours)
    return foreign / TICKS_PER_S / seconds


def our_waiting(before: CpuSnapshot, after: CpuSnapshot) -> float:
    """How long our threads were ready to run but not running from `before` to `after`, in cores
    (threads that exited meanwhile drop out, so a short window can read low)."""
    seconds = after.at - before.at
    return 0.0 if seconds <= 0 else (after.our_wait_ns - before.our_wait_ns) / 1e9 / seconds


@contextmanager
def foreign_load(processes: int) -> Iterator[list[int]]:
    """`processes` CPU-bound processes outside this process's tree (started by a shell that exits at
    once, so they are reparented away from us): the machine's other tenants, made for real. Yields
    their pids; they are killed on exit."""
    spin = f"{shlex.quote(sys.executable)} -c 'while True: pass'"
    launcher = " ".join(f"{spin} > /dev/null 2>&1 & echo $!;" for _ in range(processes))
    out = subprocess.run(["sh", "-c", launcher], capture_output=True, text=True, check=True, timeout=30).stdout
    pids = [int(line) for line in out.split()]
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
