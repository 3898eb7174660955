"""The engine's memory budget (adapter pool + KV cache), from the memory the machine has left.

As vLLM sizes its KV space: measured once the weights are loaded, a fraction of what is available
then: on CUDA of the device's free memory, on CPU of the host's available memory (`MemAvailable`),
bounded by the container's cgroup limit where one is set (a container sees the host's meminfo).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CUDA_FRACTION = 0.9  # vLLM's --gpu-memory-utilization default, of what the weights left free
# On CPU the budget shares the host with the process's own heap, the tokenizer, the grammar compiler
# and whatever else runs there; the KV cache and the pool are mapped lazily (touched as they fill).
CPU_FRACTION = 0.25
_CGROUP = Path("/sys/fs/cgroup")


def available_bytes(device: torch.device) -> tuple[int, str]:
    """Memory available to this process now, and where that figure comes from (for the log)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    host = _meminfo_available()
    limit = _cgroup_room()
    if limit is not None and limit < host:
        return limit, "cgroup memory limit less usage"
    return host, "MemAvailable"


def default_budget(device: torch.device) -> tuple[int, str]:
    """The budget without --memory-budget-bytes, and how it was derived."""
    available, source = available_bytes(device)
    fraction = CUDA_FRACTION if device.type == "cuda" else CPU_FRACTION
    return int(available * fraction), f"{fraction:g} of {available / 2**20:.0f} MiB ({source})"


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc: free pages


def _cgroup_room() -> int | None:
    """cgroup v2 memory.max less memory.current (or v1's limit less usage); None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (_CGROUP / limit_file).read_text().strip()
            usage = int((_CGROUP / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1's "no limit" is a huge number
            return None
        return max(int(limit) - usage, 0)
    return None
