"""`https://` adapter origins: a real TLS server on loopback (ranged GETs) with a throwaway CA, read
by a real `loraplex-cache` subprocess that trusts that CA through `SSL_CERT_FILE`, and by a real
`loraplex-inference` subprocess through it.

- the sidecar stages an adapter over TLS in ranged parts, byte for byte;
- it refuses an origin whose certificate it cannot verify: signed by a CA it does not trust, or
  valid for another host name; nothing is staged;
- end to end: `LoadAdapter` with an https:// URI serves the same tokens as the same files from
  file://.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from adapter_cache.errors import UnavailableError
from harness.http_origin import send_file
from harness.inference_server import start_inference_server
from harness.pki import Issued, issue, make_ca
from harness.sidecar import Sidecar, make_adapter
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.needs_tool("openssl")]


class HttpsOrigin:
    """A ThreadingHTTPServer behind TLS on 127.0.0.1 serving `files` with Range support."""

    def __init__(self, cert: Issued) -> None:
        self.files: dict[str, bytes] = {}
        self.ranges: list[str] = []
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                send_file(self, origin.files.get(self.path), origin.ranges)

            def log_message(self, *args: object) -> None:
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert.cert, cert.key)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # Handshakes in the handler threads, so a client that fails one cannot stall accept().
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def put(self, prefix: str, directory: Path) -> str:
        for f in directory.iterdir():
            self.files[f"/{prefix}/{f.name}"] = f.read_bytes()
        return f"{self.url}/{prefix}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Issued]:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(d / "ca", "ca"), make_ca(d / "other", "ca", subject="/CN=some-other-ca")
    return {"ca": ca, "other_ca": other_ca,
            "origin": issue(d / "ca", ca, "origin"),  # valid for 127.0.0.1 and localhost
            "wrong_name": issue(d / "ca", ca, "wrong-name", sans=("DNS:adapters.example.com",))}


@pytest.fixture
def origins(pki) -> Iterator[tuple[HttpsOrigin, HttpsOrigin]]:
    good, wrong_name = HttpsOrigin(pki["origin"]), HttpsOrigin(pki["wrong_name"])
    yield good, wrong_name
    good.close()
    wrong_name.close()


def _adapter_dir(root: Path, rank: int, seed: int) -> Path:
    config, weights = make_adapter(rank=rank, hidden=64, layers=3, seed=seed)
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_bytes(config)
    (root / "adapter_model.safetensors").write_bytes(weights)
    return root


def test_sidecar_stages_from_https_and_refuses_what_it_cannot_verify(tmp_path, pki, origins):
    good, wrong_name = origins
    adapter = _adapter_dir(tmp_path / "a", rank=8, seed=1)
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    assert len(weights) > 4 * 4096  # several ranged parts
    uri, mismatched = good.put("adapters/a", adapter), wrong_name.put("adapters/a", adapter)
    sidecar = Sidecar(tmp_path, allow=[f"{good.url}/adapters/", f"{wrong_name.url}/adapters/"],
                      env={"SSL_CERT_FILE": str(pki["ca"].cert)}, extra=["--part-bytes", "4096"])
    try:
        with pytest.raises(UnavailableError, match="(?i)certificate|hostname|match"):
            sidecar.client.stage(mismatched)  # signed by the trusted CA, but for another host
        assert sidecar.client.list() == []
        staged = sidecar.client.stage(uri)
        assert Path(staged.path).read_bytes() == weights and not staged.cache_hit
        assert len([r for r in good.ranges if not r.startswith("bytes=0-")]) >= 4, good.ranges
        sidecar.client.release(staged.lease_id)
    finally:
        sidecar.stop()

    (tmp_path / "untrusting").mkdir()
    untrusting = Sidecar(tmp_path / "untrusting", allow=[f"{good.url}/adapters/"],
                         env={"SSL_CERT_FILE": str(pki["other_ca"].cert)})
    try:
        gets = len(good.ranges)
        with pytest.raises(UnavailableError, match="(?i)certificate verify failed"):
            untrusting.client.stage(uri)
        assert untrusting.client.list() == [] and len(good.ranges) == gets  # no byte was requested
    finally:
        untrusting.stop()


def test_load_adapter_from_https_through_the_sidecar_serves_like_file(tmp_path, pki, origins):
    good, _ = origins
    local = write_peft_adapter(tmp_path / "adapters" / "a", seed=5)
    uri = good.put("adapters/a", local)
    file_prefix = (tmp_path / "adapters").as_uri() + "/"
    sidecar = Sidecar(tmp_path, allow=[f"{good.url}/adapters/", file_prefix],
                      env={"SSL_CERT_FILE": str(pki["ca"].cert)})
    server = None
    try:
        server = start_inference_server(["--model", "builtin:tiny", "--cache-address", sidecar.target,
                                         "--adapter-source-allow", f"{good.url}/adapters/",
                                         "--adapter-source-allow", file_prefix], log_dir=tmp_path)
        with InferenceClient(server.address) as client:
            assert client.load_adapter("over-https", uri, timeout=60).name == "over-https"
            assert client.load_adapter("from-file", local.as_uri(), timeout=60).name == "from-file"
            out = {name: client.generate_text("hello there", adapter=name, max_new_tokens=8, ignore_eos=True,
                                              timeout=60)
                   for name in ("over-https", "from-file", None)}
        assert out["over-https"] == out["from-file"] != out[None], out
        assert any(e.uri == uri for e in sidecar.client.list())  # it came through the sidecar, over TLS
    finally:
        if server is not None:
            server.stop()
        sidecar.stop()
