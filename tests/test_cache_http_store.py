"""The sidecar's http(s):// store and the RAM locking of what it stages, end to end: a real
`loraplex-cache` subprocess fetching from a real HTTP server on loopback (ranged reads), refusing
redirects (which could leave the allow-list), and mlocking the staged file."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from adapter_cache.errors import PermissionDeniedError
from harness.http_origin import send_file
from harness.sidecar import Sidecar, make_adapter

FILES: dict[str, bytes] = {}
RANGES: list[str] = []  # Range headers of the GETs served, in order


class _Handler(BaseHTTPRequestHandler):
    """Serves FILES with Range support; /moved/... redirects to the same path under /adapters."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.startswith("/moved/"):
            self.send_response(302)
            self.send_header("Location", self.path.replace("/moved/", "/adapters/", 1))
            self.end_headers()
            return
        send_file(self, FILES.get(self.path), RANGES)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_base() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    FILES.clear()
    RANGES.clear()


@pytest.fixture
def sidecar(tmp_path, http_base) -> Iterator[Sidecar]:
    sc = Sidecar(tmp_path, allow=[f"{http_base}/adapters/", f"{http_base}/moved/"],
                 extra=["--part-bytes", "4096"])
    yield sc
    sc.stop()


def _locked_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/PID/status")


def test_http_store_stages_in_ranged_parts_and_locks_the_file_in_ram(sidecar, http_base):
    config, weights = make_adapter(rank=8, hidden=64, layers=3)
    assert len(weights) > 4 * 4096  # several ranged parts
    FILES["/adapters/a/adapter_config.json"] = config
    FILES["/adapters/a/adapter_model.safetensors"] = weights
    locked_before = _locked_kib(sidecar.proc.pid)
    staged = sidecar.client.stage(f"{http_base}/adapters/a")
    assert Path(staged.path).read_bytes() == weights and not staged.cache_hit
    assert len([r for r in RANGES if not r.startswith("bytes=0-")]) >= 4, RANGES  # fetched in 4 KiB parts
    # The staged file's pages are locked in the sidecar (we run as root here, so mlock is permitted).
    assert _locked_kib(sidecar.proc.pid) - locked_before >= len(weights) // 1024
    sidecar.client.release(staged.lease_id)


def test_http_redirect_is_refused_even_to_an_allowed_prefix(sidecar, http_base):
    config, weights = make_adapter(rank=4, hidden=64)
    FILES["/adapters/b/adapter_config.json"] = config
    FILES["/adapters/b/adapter_model.safetensors"] = weights
    with pytest.raises(PermissionDeniedError, match="redirect"):  # the client's PERMISSION_DENIED
        sidecar.client.stage(f"{http_base}/moved/b")
    assert sidecar.client.list() == []
    staged = sidecar.client.stage(f"{http_base}/adapters/b")  # still healthy, and the direct URI works
    assert Path(staged.path).read_bytes() == weights
    sidecar.client.release(staged.lease_id)
