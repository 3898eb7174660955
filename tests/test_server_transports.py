"""The inference server's listeners, on a real `loraplex-inference` subprocess:
- mTLS (`--tls-client-ca`): a client certificate from another CA is refused, also when that CA
  carries the trusted CA's very name; one from the trusted CA is served; the HTTP port, which takes
  no certificates, refuses a request without a credential (401);
- `--listen unix:///path`: Generate, health and admin RPCs over the socket, and a restart after a
  crash on the socket file the dead server left behind.
"""

from __future__ import annotations

import random
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.inference_server import InferenceServer, start_inference_server
from harness.pki import Issued, issue, make_ca
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
                                     "--tls-client-ca", str(ca.cert)], log_dir=tmp_path, credentials=creds,
                                    http=True)
    try:
        # The HTTP port takes no client certificates: with mTLS required, it is no way around it
        # (no credential: 401), while its probe stays open.
        r = httpx.post(server.http_url + "/v1/completions", json={"model": "builtin:tiny", "prompt": "hi"}, timeout=30)
        assert r.status_code == 401, r.text
        assert httpx.get(server.http_url + "/health", timeout=30).status_code == 200
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
    server, root, tenants = _mtls_tenants(tmp_path, "--prefix-cache-scope", "identity")
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


def _mtls_tenants(tmp_path: Path, *args: str) -> tuple[InferenceServer, bytes, list[Issued]]:
    """A server requiring client certificates from one CA, and two tenants' certificates (CNs
    tenant-a, tenant-b)."""
    ca = make_ca(tmp_path / "trusted", "ca")
    server_cert = issue(tmp_path / "trusted", ca, "server")
    tenants = [issue(tmp_path / "trusted", ca, name, cn=f"tenant-{name}") for name in ("a", "b")]
    root = ca.cert.read_bytes()
    creds = grpc.ssl_channel_credentials(root, *reversed(tenants[0].pem()))
    server = start_inference_server(["--tls-cert", str(server_cert.cert), "--tls-key", str(server_cert.key),
                                     "--tls-client-ca", str(ca.cert), *args], log_dir=tmp_path, credentials=creds)
    return server, root, tenants


@dataclass
class Probe:
    ttft_s: float  # as the client sees it: from the call to the first streamed token
    server_ttft_s: float  # the server's own arrival-to-first-token figure
    cached_tokens: int


def _probe(client: InferenceClient, prompt: str) -> Probe:
    started = time.perf_counter()
    first = None
    outputs = []
    for out in client.generate(prompt, max_new_tokens=2, ignore_eos=True, timeout=60):
        if first is None:
            first = time.perf_counter() - started
        outputs.append(out)
    assert first is not None
    return Probe(first, outputs[-1].timings.time_to_first_token_seconds, outputs[-1].usage.cached_tokens)


# Prefix-cache probes between tenants. Prompt length: the builtin tiny model's context is 1024
# positions; 900 byte tokens are two prefill steps of the 512-token budget on a miss, one step
# of 4 tokens on a hit (56 full blocks cached).
PROBE_CHARS = 900
PROBE_ROUNDS = 9


@pytest.mark.needs_tool("openssl")
def test_prefix_cache_timing_side_channel_between_tenants(tmp_path: Path) -> None:
    """A tenant probing another tenant's prompt reuses none of its blocks: the server's own
    prefix-cache hit counter does not move for b's probes of a's prompts (nor does b's
    cached_tokens), while the same probe inside one tenant hits every full block, by both. The
    counter is the scheduler's, not the response's, so a server that under-reported cached_tokens
    while reusing a's blocks still fails. (The TTFT medians are printed, not judged: how much faster a
    hit is depends on the host.) Every probe of the "a sent it" arm is a fresh prompt that a sent
    once and b never sent: b's own first probe of a prompt would cache it under b's identity. Fails
    if the identity were dropped from the cache salt (b's probes of a's prompts would then hit)."""
    server, root, tenants = _mtls_tenants(tmp_path, "--prefix-cache-scope", "identity")
    rng = random.Random(33)

    def fresh() -> str:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(PROBE_CHARS))

    clients = []
    try:
        for tenant in tenants:
            cert, key = tenant.pem()
            clients.append(InferenceClient(server.address, root_certificates=root, client_cert=cert,
                                           client_key=key))
        a, b = clients
        for client in clients:  # warm: the channels' handshakes, the first steps' allocations
            for _ in range(3):
                _probe(client, fresh())
        arms: dict[str, list[Probe]] = {"b: a sent it": [], "b: nobody sent it": [], "a: hit": [], "a: miss": []}
        counted = dict.fromkeys(arms, 0.0)  # the server's prefix-cache hits (tokens) during each arm's probes
        for i in range(PROBE_ROUNDS):
            sent_by_a = fresh()
            assert _probe(a, sent_by_a).cached_tokens == 0
            order = [("b: a sent it", b, sent_by_a), ("b: nobody sent it", b, fresh()),
                     ("a: hit", a, sent_by_a), ("a: miss", a, fresh())]
            if i % 2:  # alternate which arm goes first, so drift in the machine's load hits both
                order[0], order[1] = order[1], order[0]
                order[2], order[3] = order[3], order[2]
            for arm, client, prompt in order:
                hits = server.value("loraplex_prefix_cache_hits_total")
                arms[arm].append(_probe(client, prompt))
                counted[arm] += server.value("loraplex_prefix_cache_hits_total") - hits

        summary = {arm: (round(1000 * statistics.median(p.ttft_s for p in probes), 1),
                         round(1000 * statistics.median(p.server_ttft_s for p in probes), 1),
                         sorted({p.cached_tokens for p in probes})) for arm, probes in arms.items()}
        print(f"TTFT medians ms (client, server), cached tokens: {summary}; counted hits: {counted}")
        full = (PROBE_CHARS - 1) // 16 * 16
        assert counted == {"b: a sent it": 0, "b: nobody sent it": 0, "a: hit": full * PROBE_ROUNDS, "a: miss": 0}, \
            (counted, summary)
        assert all(p.cached_tokens == 0 for arm in ("b: a sent it", "b: nobody sent it", "a: miss")
                   for p in arms[arm]), summary
        assert all(p.cached_tokens == full for p in arms["a: hit"]), summary
    finally:
        for client in clients:
            client.close()
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
