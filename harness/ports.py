"""Loopback ports for the servers the tests and benches start, and waiting for one to be healthy."""

from __future__ import annotations

import random
import socket
import subprocess
import time
import urllib.request


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server started next to bind.

    Drawn below the kernel's ephemeral range: a port the kernel hands out (bind to port 0) is one it
    hands the next outgoing connection too, and one of those (a test's client, another server's)
    took a released port before its server bound it ("Address already in use", once in four runs
    of a test with three CPU burners beside it)."""
    high = _ephemeral_low()
    low = max(1024, high - 20_000)
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 in {low}-{high - 1}")


def wait_http_healthy(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    """Polls `url`/health until it answers 200; fails at once if `server` exits meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")
