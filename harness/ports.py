"""Loopback ports for the servers the tests and benches start, and waiting for one to be healthy."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
