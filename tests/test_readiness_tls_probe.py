"""Readiness as the kubelet sees it with TLS on: NOT_SERVING until the required preloads are LOADED.

The kubelet's gRPC probe has no TLS. The chart used to fall back to a TCP connect of the TLS port
there, which passes as soon as the port listens: the pod was Ready while its required preload still
loaded (tests/test_kubelet_pod.py saw it LOADING after Ready). Now the server also serves
grpc.health.v1 alone in plaintext (--health-listen) and the rendered probes ask it there.

No root or network namespace needed: the chart is rendered with helm, and a real server (TLS on the
serving port, with and without the adapter-cache sidecar) is probed on its health port the way the
rendered probe says, while every scheduler step is made slower (the test-only hook) so the required
preload takes a few steps to load."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.inference_server import InferenceServer, start_inference_server
from harness.pki import issue, make_ca
from harness.pod import HELM, render_chart
from harness.ports import free_port
from harness.sidecar import Sidecar
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

ALL_VALUES = Path(__file__).parent / "data" / "helm-values-all.yaml"
INFERENCE = "loraplex-inference"
STEP_DELAY_S = "0.3"  # every scheduler step this much slower: the preload takes >= 2 steps


@pytest.mark.needs_tool("helm", HELM)
def test_rendered_probes_ask_grpc_health_on_a_plaintext_port_with_tls() -> None:
    (deployment,) = [d for d in render_chart(ALL_VALUES) if d["kind"] == "Deployment"]
    (inf,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == INFERENCE]
    assert any(a.startswith("--tls-cert=") for a in inf["args"])  # the values turn TLS on
    (health,) = [a.split("=", 1)[1] for a in inf["args"] if a.startswith("--health-listen=")]
    port = int(health.rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in inf["ports"]}
    assert ports["health"] == port != ports["grpc"]
    # Readiness asks service "" (required preloads in), startup and liveness the watchdog's service.
    assert inf["readinessProbe"]["grpc"] == {"port": port}
    assert inf["startupProbe"]["grpc"] == inf["livenessProbe"]["grpc"] == {"port": port, "service": "liveness"}


def _health(port: int, service: str) -> str:
    """What the kubelet's gRPC probe gets: a plaintext Check on the pod's port."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=2).status
        except grpc.RpcError as e:
            return e.code().name  # not listening yet: UNAVAILABLE
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


@pytest.mark.needs_tool("openssl")
@pytest.mark.parametrize("source", ["local", "sidecar"])
def test_readiness_stays_not_serving_until_required_preloads_are_loaded(tmp_path: Path, source: str) -> None:
    write_peft_adapter(tmp_path / "adapters" / "req", rank=4, seed=5)
    allow = (tmp_path / "adapters").as_uri() + "/"
    (tmp_path / "preload.json").write_text(json.dumps(
        [{"name": "req", "uri": allow + "req", "pinned": True, "required": True}]))
    ca = make_ca(tmp_path / "pki", "ca")
    cert = issue(tmp_path / "pki", ca, "server")
    creds = grpc.ssl_channel_credentials(root_certificates=ca.cert.read_bytes())
    health_port = free_port()
    args = ["--model", "builtin:tiny", "--max-loras", "2", "--adapter-source-allow", allow,
            "--preload-file", str(tmp_path / "preload.json"), "--tls-cert", str(cert.cert), "--tls-key", str(cert.key),
            "--health-listen", f"127.0.0.1:{health_port}"]
    sidecar = Sidecar(tmp_path, allow=[allow]) if source == "sidecar" else None
    if sidecar is not None:
        args += ["--cache-address", sidecar.target]
    listen = f"127.0.0.1:{free_port()}"
    seen: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Returns once readiness is SERVING on the TLS port (what the harness waits for).
        started = pool.submit(start_inference_server, args, env={"LORAPLEX_TEST_FAULT_STEP_DELAY_S": STEP_DELAY_S},
                              log_dir=tmp_path, listen=listen, credentials=creds)
        try:
            deadline = time.monotonic() + 120
            while (state := _health(health_port, "")) != "SERVING":
                seen.append(state)
                assert time.monotonic() < deadline, f"never SERVING: {seen[-3:]}"
                if started.done():
                    started.result()  # the server failed to start: its error
                time.sleep(0.02)
            # Ready as the probe sees it: the required preload is in, at once.
            with grpc.secure_channel(listen, creds) as ch:
                listed = pb_grpc.InferenceStub(ch).ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters
            assert {a.name: pb.AdapterState.Name(a.state) for a in listed} == {"req": "ADAPTER_STATE_LOADED"}
            assert _health(health_port, "liveness") == "SERVING"
            with InferenceClient(f"127.0.0.1:{health_port}") as probe_only, pytest.raises(grpc.RpcError) as info:
                probe_only.list_adapters(timeout=10)  # the health port serves health, nothing else
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            try:
                server: InferenceServer | None = started.result(timeout=180)
            except Exception:  # noqa: BLE001 - it never started: nothing to stop (the harness stopped it)
                server = None
            if server is not None:
                server.stop()
            if sidecar is not None:
                sidecar.stop()
    # The health port answered while the preload loaded (not merely "not listening yet").
    assert "NOT_SERVING" in seen, seen
