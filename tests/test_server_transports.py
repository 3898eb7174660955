"""The inference server's listeners, on a real `loraplex-inference` subprocess:
- mTLS (`--tls-client-ca`): a client certificate from another CA is refused, also when that CA
  carries the trusted CA's very name; one from the trusted CA is served;
- `--listen unix:///path`: Generate, health and admin RPCs over the socket, and a restart after a
  crash on the socket file the dead server left behind.
"""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.inference_server import start_inference_server
from harness.pki import issue, make_ca
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.mark.needs_tool("openssl")
def test_mtls_refuses_a_client_certificate_from_another_ca(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "trusted", "ca")
    impostor_ca = make_ca(tmp_path / "other", "ca")  # same subject, another key
    server_cert = issue(tmp_path / "trusted", ca, "server")
    trusted = issue(tmp_path / "trusted", ca, "client")
    foreign = issue(tmp_path / "other", impostor_ca, "client")  # same CN and SANs as the trusted one
    root = ca.cert.read_bytes()
    creds = grpc.ssl_channel_credentials(root, *reversed(trusted.pem()))
    server = start_inference_server(["--tls-cert", str(server_cert.cert), "--tls-key", str(server_cert.key),
                                     "--tls-client-ca", str(ca.cert)], log_dir=tmp_path, credentials=creds)
    try:
        address = server.address
        cert, key = foreign.pem()
        with InferenceClient(address, root_certificates=root, client_cert=cert, client_key=key) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.generate_text("hi", max_new_tokens=2, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        cert, key = trusted.pem()
        with InferenceClient(address, root_certificates=root, client_cert=cert, client_key=key) as client:
            out = list(client.generate("hi", max_new_tokens=2, ignore_eos=True, timeout=30))
            assert out[-1].usage.generated_tokens == 2
        assert server.proc.poll() is None
    finally:
        server.stop(timeout=10)


@pytest.mark.needs_tool("openssl")
def test_prefix_cache_identity_scope_keeps_mtls_clients_apart(tmp_path: Path) -> None:
    """`--prefix-cache-scope identity`: two clients with certificates of different subjects never
    hit each other's cached prompt (a timing side channel between tenants otherwise); each hits
    its own. A key that dropped the identity would let the second client hit the first's."""
    ca = make_ca(tmp_path / "trusted", "ca")
    server_cert = issue(tmp_path / "trusted", ca, "server")
    tenants = [issue(tmp_path / "trusted", ca, name, cn=f"tenant-{name}") for name in ("a", "b")]
    root = ca.cert.read_bytes()
    creds = grpc.ssl_channel_credentials(root, *reversed(tenants[0].pem()))
    server = start_inference_server(["--tls-cert", str(server_cert.cert), "--tls-key", str(server_cert.key),
                                     "--tls-client-ca", str(ca.cert), "--prefix-cache-scope", "identity"],
                                    log_dir=tmp_path, credentials=creds)
    prompt = "The same system prompt, sent by two tenants of one service."
    full = (len(prompt.encode()) - 1) // 16 * 16

    def cached(tenant) -> int:
        cert, key = tenant.pem()
        with InferenceClient(server.address, root_certificates=root, client_cert=cert, client_key=key) as client:
            out = list(client.generate(prompt, max_new_tokens=2, ignore_eos=True, timeout=30))
        return out[-1].usage.cached_tokens

    try:
        assert full >= 32
        assert cached(tenants[0]) == 0
        assert cached(tenants[1]) == 0  # tenant a's blocks are cached, under another identity
        assert cached(tenants[0]) == full and cached(tenants[1]) == full
    finally:
        server.stop(timeout=10)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_unix_socket_listener_serves_and_restarts_over_a_stale_socket(tmp_path: Path) -> None:
    """Admin RPCs need no token on a unix socket (the loopback rule: only local processes that may
    open the file connect). A crashed server leaves its socket file; the next one must bind it."""
    adapter = write_peft_adapter(tmp_path / "adapters" / "a", seed=3)
    short = Path(tempfile.mkdtemp(prefix="lpx-", dir="/tmp"))  # a socket path must stay under 108 bytes
    address = f"unix://{short}/inference.sock"
    args = ["--adapter-source-allow", (tmp_path / "adapters").as_uri() + "/"]
    server = start_inference_server(args, listen=address, log_dir=tmp_path)
    try:
        assert (short / "inference.sock").is_socket()
        assert f"LISTENING {address}" in server.log()
        with InferenceClient(address) as client:
            assert client.load_adapter("a", adapter.as_uri(), timeout=60).name == "a"
            base = client.generate_text("hello", max_new_tokens=4, ignore_eos=True, timeout=30)
            adapted = client.generate_text("hello", adapter="a", max_new_tokens=4, ignore_eos=True, timeout=30)
            assert len(base) and base != adapted
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        assert (short / "inference.sock").exists()  # what a crash leaves behind
        server = start_inference_server(args, listen=address, log_dir=tmp_path)
        assert _health(address) == health_pb2.HealthCheckResponse.SERVING
        with InferenceClient(address) as client:
            assert client.generate_text("hello", max_new_tokens=4, ignore_eos=True, timeout=30) == base
    finally:
        server.stop(timeout=10)
        for f in short.iterdir():
            f.unlink()
        short.rmdir()
