"""Lowest CPU priority for a helper process whose work may wait (a hostile grammar compile).

SCHED_IDLE rather than nice 19: a nice-19 task still holds a core until the scheduler's next tick
when an engine thread wakes, and the engine's OpenMP threads wake at every barrier of every step,
so a busy nice-19 neighbour cost a victim stream up to 1.3x on a 2-core machine (CI). A SCHED_IDLE
task is preempted at once by any normal task that wakes. No torch import: child processes use it."""
import os

FALLBACK_NICE = 19


def run_only_on_idle_cpu(pid: int = 0) -> str:
    """Put a process (0: the caller; its threads created later too) at the lowest priority; says which."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):  # not Linux, or refused: nice is the next best
        try:
            os.setpriority(os.PRIO_PROCESS, pid, FALLBACK_NICE)
        except OSError:
            return "normal"
        return f"nice {FALLBACK_NICE}"
