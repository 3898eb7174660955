"""The pod the Helm chart renders, started as a kubelet would start it (harness/pod.py).

No API server runs here: the chart is rendered by the real helm binary and (host mode) each
container's process is its rendered command/args/env mapped onto this Python environment's
console scripts (`loraplex-inference`, `loraplex-cache`, `python` for exec probes), in a network
namespace of its own with a link-local pod IP. Everything is checked from outside that namespace,
the way the kubelet, a Service and Prometheus reach a pod:

- default values (what `helm install` does with none): both containers start in order (the native
  sidecar's startup probe first) and pass their rendered probes; /metrics of both answers on the
  pod IP at the ports NOTES.txt names, scraped by the real Prometheus; Generate works through the
  Service port; admin RPCs are PERMISSION_DENIED with how to enable them; SIGTERM (after the
  preStop hook) with a stream in flight: health NOT_SERVING first, the stream completes within the
  rendered grace, new RPCs refused only after;
- every option (tests/data/helm-values-all.yaml, plus an overlay for what cannot exist here: a
  builtin model instead of an 8B checkpoint, local adapters instead of S3): TLS + mTLS, the admin
  token from its Secret, the ServiceMonitor/PodMonitor ports scraped by Prometheus and every
  dashboard query returning data, a required preload gating readiness, a missing preload FAILED and
  retried while the pod serves, a preload ConfigMap edit reaching the running server;
- the scheduler thread killed through the test-only fault hook (LORAPLEX_TEST_FAULT_SCHEDULER):
  readiness and liveness NOT_SERVING, the rendered liveness probe failing failureThreshold times in a row.

Image mode (harness/pod.py): the default and every-option tests run twice, once as host processes and
once with each container in the image scripts/build_image.sh builds from the Dockerfile (built once per
session, cached layers), under podman with the rendered securityContext (uid/gid 10001, fsGroup,
read-only root filesystem, capabilities dropped) and volumes, in the pod's network namespace. There,
each container's processes must all run as 10001 (never root), nothing may be written outside the
volumes (`podman diff` empty, no "Read-only file system" in the logs), the default pod must be Ready
within 60 s of its start, and an HTTP chat completion must answer through the Service's http port.

What needs no pod (SIGTERM drain, the grace cut, a stuck step) is checked on a plain server, with no
root, in tests/test_server_drain.py.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx2 as httpx  # the HTTP client the openai SDK is built on
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from harness.pod import (
    HELM,
    NO_PROXY_GRPC,
    Pod,
    image_under_test,
    netns_supported,
    render_chart,
    render_notes,
    running_pod,
)
from harness.prometheus import dashboard_queries, prometheus_available, running_prometheus
from harness.tools import in_ci
from harness.waiting import HANG_S, wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

REPO = Path(__file__).resolve().parents[1]
ALL_VALUES = REPO / "tests" / "data" / "helm-values-all.yaml"
INFERENCE, CACHE = "loraplex-inference", "loraplex-cache"
SERVER_NAME = "rel-loraplex.ml.svc"  # the TLS server certificate's name


def _missing() -> str | None:
    if not HELM.exists():
        return "helm not installed (scripts/install_test_tools.sh)"
    if not prometheus_available():
        return "prometheus not installed (scripts/install_test_tools.sh)"
    if not netns_supported():
        return "needs root and iproute2 for a pod network namespace"
    return None


if _missing() and in_ci():
    raise RuntimeError(f"test_kubelet_pod cannot run under CI: {_missing()}")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.skipif(bool(_missing()), reason=str(_missing()))]
MODES = ["host", pytest.param("image", marks=pytest.mark.timeout(1800))]  # image: the first one builds it
READY_WITHIN_S = 60.0  # the image's pod with the default values: started to Ready
# ChatML, for builtin:tiny (its byte tokenizer has no template): a ConfigMap mounted into the pod.
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHAT_SETS = ["inference.extraArgs[0]=--chat-template=/etc/loraplex-chat/template.jinja",
             "extraVolumes[0].name=chat", "extraVolumes[0].configMap.name=chat-template",
             "inference.extraVolumeMounts[0].name=chat",
             "inference.extraVolumeMounts[0].mountPath=/etc/loraplex-chat",
             "inference.extraVolumeMounts[0].readOnly=true"]


@pytest.fixture(scope="session")
def image() -> str:
    """The image the chart runs, built from the Dockerfile by scripts/build_image.sh (once a session;
    LORAPLEX_TEST_IMAGE=TAG: that image, already built, instead)."""
    return image_under_test("the image-mode kubelet tests")


def _pod_kw(mode: str, request: pytest.FixtureRequest) -> dict:
    return {"image": request.getfixturevalue("image")} if mode == "image" else {}


def _check_image_containers(pod: Pod) -> None:
    """Image mode: every process of every container runs as 10001:10001 (never root, no root group),
    and nothing was written outside the volumes (the root filesystem is read-only: an attempt shows as
    EROFS in the logs; `podman diff` would show one if the chart stopped asking for read-only)."""
    if pod.image is None:
        return
    for name, c in pod.containers.items():
        ids = pod.process_ids(name)
        assert ids, name
        for pid, who in ids.items():
            assert set(who["Uid"]) == {10001} and set(who["Gid"]) == {10001}, (name, pid, who)
            assert 0 not in who["Groups"], (name, pid, who)
        assert pod.root_writes(name) == [], (name, pod.root_writes(name))
        assert "Read-only file system" not in c.log(), c.log()[-3000:]


def _arg(container: dict, flag: str) -> str:
    return next(a.split("=", 1)[1] for a in container["args"] if a.startswith(flag + "="))


def _health(address: str, service: str = "", timeout: float = 1.0) -> str:
    with grpc.insecure_channel(address, options=NO_PROXY_GRPC) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _scrape_targets_from_service(pod: Pod) -> dict[str, list[str]]:
    """Default install: NOTES.txt names job loraplex-inference on the metrics port and loraplex-cache
    on cache-metrics (the Service's ports, mapped to the containers' through targetPort)."""
    return {"loraplex-inference": [pod.service_target("metrics")],
            "loraplex-cache": [pod.service_target("cache-metrics")]}


def _scrape_targets_from_monitors(pod: Pod, docs: list[dict]) -> dict[str, list[str]]:
    """What the rendered ServiceMonitor scrapes (Service port name → targetPort → container port),
    checked against the PodMonitor (container port names); both pin the job label and /metrics."""
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (pm,) = [d for d in docs if d["kind"] == "PodMonitor"]
    targets = {}
    for ep in sm["spec"]["endpoints"]:
        assert ep["path"] == "/metrics"
        targets[ep["relabelings"][0]["replacement"]] = [pod.service_target(ep["port"])]
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["path"] == "/metrics"
        assert targets[ep["relabelings"][0]["replacement"]] == [f"{pod.net.pod_ip}:{pod.pod_port(ep['port'])}"]
    return targets


def _wait_up(prom, jobs: list[str], timeout: float = 30.0) -> None:
    prom.wait_for(f'count(up{{job=~"{"|".join(jobs)}"}} == 1) == {len(jobs)}', timeout=timeout)


# ---- default values ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_default_install_starts_is_scraped_serves_and_drains(mode: str, request: pytest.FixtureRequest) -> None:
    """Default values, plus one test-only env var that slows every scheduler step by 15 ms: a toy
    model's 600-token stream then lasts past the preStop sleep and the drain delay, as a big model's
    would, and a chat template for the toy model from a ConfigMap (the default values' own env and
    args are unchanged otherwise)."""
    sets = ["inference.extraEnv[0].name=LORAPLEX_TEST_FAULT_STEP_DELAY_S", "inference.extraEnv[0].value=0.015",
            *CHAT_SETS]
    docs = render_chart(sets=sets)
    kw = _pod_kw(mode, request)
    notes = " ".join(render_notes(sets=sets).split())  # the claims this test checks, as NOTES.txt makes them
    for claim in ("gRPC (loraplex.v1, grpc.health.v1, reflection) on the Service port 50051",
                  "inference on :9400/metrics (job loraplex-inference)",
                  "adapter cache on :9401/metrics (job loraplex-cache)",
                  "a pod is Ready once the model is loaded;",
                  "On shutdown the pod reports NOT_SERVING first; in-flight streams then get 50s to finish",
                  "Generate works, admin RPCs (LoadAdapter/UnloadAdapter) answer PERMISSION_DENIED"):
        assert claim in notes, claim
    with running_pod(docs, {"ConfigMap": {"chat-template": {"template.jinja": CHATML}}}, **kw) as pod:
        inf = pod.containers[INFERENCE]
        print(f"{mode}: pod Ready {pod.ready_s:.1f} s after its start")
        if mode == "image":
            assert pod.ready_s <= READY_WITHIN_S, pod.ready_s
        # Start order: the sidecar is a native sidecar (init container, restartPolicy: Always).
        assert pod.containers[CACHE].sidecar
        assert inf.spec["livenessProbe"]["grpc"]["service"] == "liveness"
        for kind in ("livenessProbe", "readinessProbe"):
            assert pod.probe(INFERENCE, kind)[0] and pod.probe(CACHE, kind)[0]

        # Metrics of both containers on the pod address, scraped from outside the pod's netns.
        targets = _scrape_targets_from_service(pod)
        assert [t.split(":")[1] for t in (*targets["loraplex-inference"], *targets["loraplex-cache"])] == \
            ["9400", "9401"]
        with running_prometheus(targets, scrape_interval="1s") as prom:
            _wait_up(prom, list(targets))
            for series in ("vllm:num_requests_running", "vllm:lora_requests_info", "loraplex_cache_bytes",
                           'loraplex_health_serving{probe="readiness"}'):
                assert prom.query(series), series

        # Generate through the Service port; admin RPCs refused, saying how to enable them.
        address = pod.service_target("grpc")
        assert address.endswith(":50051")
        with grpc.insecure_channel(address, options=NO_PROXY_GRPC) as ch:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"loraplex.v1.Inference", "grpc.health.v1.Health"} <= services
        with InferenceClient(address) as client:
            out = list(client.generate("hello pod", max_new_tokens=4, ignore_eos=True, timeout=30))
            assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and out[-1].usage.generated_tokens == 4
            with pytest.raises(grpc.RpcError) as info:
                client.load_adapter("a", "s3://adapters/a/", timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "inference.adminToken.existingSecret" in info.value.details()
        # An OpenAI chat completion through the Service's http port.
        r = httpx.post(f"http://{pod.service_target('http')}/v1/chat/completions", timeout=60,
                       json={"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["message"]["role"] == "assistant"
        _check_image_containers(pod)

        _drain_with_stream_in_flight(pod, address)
        if pod.image is not None:
            assert all(pod.root_writes(name) == [] for name in pod.containers)


def _drain_with_stream_in_flight(pod: Pod, address: str) -> None:
    """Kubelet termination while a stream runs: preStop, SIGTERM; readiness must turn NOT_SERVING
    before the stream ends and before new RPCs are refused; the stream ends OK within the grace."""
    inf = pod.containers[INFERENCE].spec
    grace = float(_arg(inf, "--shutdown-grace-s"))
    pre_stop = float(inf["lifecycle"]["preStop"]["exec"]["command"][1])
    assert grace + pre_stop < pod.grace_s
    events: dict[str, float] = {}
    health_log: list[tuple[float, str]] = []
    codes: dict[str, int] = {}
    kubelet = threading.Thread(target=lambda: codes.update(pod.terminate()))
    with InferenceClient(address) as client:
        stream = client.generate("a long answer", max_new_tokens=600, ignore_eos=True, timeout=120)
        first = next(stream)
        events["first_token"] = time.monotonic()
        kubelet.start()
        stop_polling = threading.Event()

        def poll() -> None:
            while not stop_polling.is_set():
                status = _health(address, timeout=1.0)
                health_log.append((time.monotonic(), status))  # when the answer came: a check sent before
                time.sleep(0.05)  # SIGTERM may still answer NOT_SERVING after it

        poller = threading.Thread(target=poll)
        poller.start()
        rest = list(stream)
        events["stream_end"] = time.monotonic()
        stop_polling.set()
        poller.join()
    kubelet.join(timeout=pod.grace_s + 30)
    sigterm = pod.sigterm_at[INFERENCE]
    assert first.token_ids and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in [first, *rest]) == 600
    # Not cut at --shutdown-grace-s: all 600 tokens, ended by length, no "cancelled" in the log (below).
    assert events["first_token"] < sigterm < events["stream_end"], "the stream was not in flight at SIGTERM"
    assert events["stream_end"] - sigterm > float(_arg(inf, "--drain-delay-s")), "ended before new RPCs were refused"
    not_serving = [t for t, s in health_log if s == "NOT_SERVING"]
    refused = [t for t, s in health_log if s == "UNAVAILABLE"]  # a slow answer (DEADLINE_EXCEEDED) is no refusal
    assert not_serving, health_log
    assert sigterm <= not_serving[0] < events["stream_end"]
    assert all(t > not_serving[0] for t in refused)
    # Both exited 0 of themselves: the kubelet's SIGKILL at the pod's grace would give -9.
    assert codes == {INFERENCE: 0, CACHE: 0}, pod.logs()
    assert pod.containers[CACHE].proc.returncode == 0
    assert "cancelled" not in pod.containers[INFERENCE].log().split("draining:")[-1]


# ---- every option ---------------------------------------------------------------------------------
def _pki(d: Path) -> dict[str, str]:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-subj", "/CN=loraplex-test-ca", "-days", "1")
    (d / "san.ext").write_text(f"subjectAltName=DNS:{SERVER_NAME}\n")
    for who in ("tls", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out", f"{who}.csr",
                "-subj", f"/CN={who}")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{who}.crt", "-days", "1", "-extfile", "san.ext")
    return {name: (d / name).read_text() for name in ("tls.crt", "tls.key", "ca.crt", "client.crt", "client.key")}


ADAPTERS = ["req", "a1", "a2", "a3", "late"]


def _overlay(root: Path, adapters: Path, adapter_bytes: int) -> Path:
    """What cannot exist here, replaced: a builtin model (the PVC still mounts; so weights served as the
    model's own dtype, a quantized weights dtype needing a GGUF file), local adapters on a
    hostPath volume mounted at the same path in both containers (so URIs need no remapping), and two
    slots (so the dashboards see slot evictions)."""
    base = yaml.safe_load(ALL_VALUES.read_text())
    allow = f"file://{adapters}/"
    mounts = [*base["inference"]["extraVolumeMounts"], {"name": "adapters", "mountPath": str(adapters),
                                                        "readOnly": True}]
    overlay = {
        "model": {"path": "builtin:tiny", "weightsDtype": "auto"},
        "inference": {"maxLoras": 2, "loraMemoryBytes": None, "maxLoraRank": 16, "kvCacheBytes": 64 << 20,
                      "adapterSourceAllow": [*base["inference"]["adapterSourceAllow"], allow],
                      "extraVolumeMounts": mounts},
        "cache": {"extraVolumeMounts": mounts, "capacityBytes": max(1 << 20, 8 * adapter_bytes),
                  "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}},
        "extraVolumes": [*base["extraVolumes"], {"name": "adapters", "hostPath": {"path": str(adapters),
                                                                                   "type": "Directory"}}],
        "preload": {"adapters": [{"name": "req", "uri": f"{allow}req/", "required": True, "pinned": True},
                                 {"name": "ghost", "uri": f"{allow}ghost/"}]},
    }
    path = root / "overlay.yaml"
    path.write_text(yaml.safe_dump(overlay))
    return path


def _client(pod: Pod, secrets: dict[str, str], token: str | None = None) -> InferenceClient:
    return InferenceClient(pod.service_target("grpc"), token=token, root_certificates=secrets["ca.crt"].encode(),
                           client_cert=secrets["client.crt"].encode(), client_key=secrets["client.key"].encode(),
                           server_name=SERVER_NAME)


def _states(client: InferenceClient) -> dict[str, str]:
    return {a.name: pb.AdapterState.Name(a.state) for a in client.list_adapters(timeout=10)}


@pytest.mark.parametrize("mode", MODES)
def test_every_option_install(mode: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="lpxk-"))
    adapters = root / "adapters"
    for i, name in enumerate(ADAPTERS):
        write_peft_adapter(adapters / name, rank=8, seed=700 + i)
    # The object store's files, readable by the pod's user (10001 in image mode; the safetensors file is
    # written 0600 by root, which only the host-process mode could read).
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    adapter_bytes = max(sum(f.stat().st_size for f in (adapters / n).iterdir()) for n in ADAPTERS)
    pki = _pki(tmp_path)
    token = "kubelet-test-admin-token"
    cluster = {
        "Secret": {"loraplex-admin": {"token": token},
                   "loraplex-tls": {k: pki[k] for k in ("tls.crt", "tls.key", "ca.crt")},
                   "loraplex-s3": {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"},
                   "loraplex-cache-extra": {"LORAPLEX_CACHE_FETCH_ATTEMPTS": "2"},
                   # inference.tenants.existingSecret: one tenant, named by its token's digest or the trusted header.
                   "loraplex-tenants": {"tenants.yaml": yaml.safe_dump({"tenants": [{
                       "name": "team-a", "token_sha256": hashlib.sha256(b"kubelet-tenant-token").hexdigest(),
                       "via_trusted_header": True}]})}},  # the chart's trustedHeader needs a tenant that accepts it
        "ConfigMap": {"loraplex-extra-env": {"LORAPLEX_ADAPTER_METRICS_TOP_K": "10"}},
    }
    docs = render_chart(ALL_VALUES, _overlay(root, adapters, adapter_bytes))
    try:
        with running_pod(docs, cluster, **_pod_kw(mode, request)) as pod:
            _every_option_checks(pod, docs, pki, token, adapters)
            _check_image_containers(pod)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def _every_option_checks(pod: Pod, docs: list[dict], pki: dict[str, str], token: str, adapters: Path) -> None:
    inf = pod.containers[INFERENCE]
    pid = inf.proc.pid
    # Ready means the required preload is in (the readiness probe asks grpc.health.v1 on the plaintext
    # health port: with TLS it was a TCP connect, Ready while req still loaded); the missing one is FAILED
    # and does not stop the pod.
    with _client(pod, pki) as client:
        assert _states(client)["req"] == "ADAPTER_STATE_LOADED"
        # Between attempts (a retry in flight shows the engine's own state, e.g. STAGING).
        wait_until(lambda: _states(client)["ghost"] == "ADAPTER_STATE_FAILED", "ghost FAILED", poll_s=0.2)
    targets = _scrape_targets_from_monitors(pod, docs)
    with running_prometheus(targets, scrape_interval="1s") as prom:
        _wait_up(prom, list(targets))
        # ...and it is retried in the background.
        prom.wait_for("loraplex_preload_failures_total >= 2", timeout=30)
        assert prom.query('loraplex_preload_adapters{state="failed"} == 1')

        # Admin RPCs with the token from the Secret, through the Service port, over mTLS.
        with _client(pod, pki, token=token) as admin:
            for name in ("a1", "a2", "a3"):
                admin.load_adapter(name, f"file://{adapters}/{name}/", timeout=60)
            with pytest.raises(grpc.RpcError) as info:
                admin.load_adapter("nothing", f"file://{adapters}/nothing/", timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
        with _client(pod, pki) as anonymous, pytest.raises(grpc.RpcError) as info:
            anonymous.load_adapter("a9", f"file://{adapters}/a1/", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        _drive_traffic(pod, pki)
        # The preload list edited in its ConfigMap: the running server follows, without a restart.
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-preload")]
        entries = yaml.safe_load(cm["data"]["preload.yaml"])
        entries = [e for e in entries if e["name"] != "ghost"] + [{"name": "late", "uri": f"file://{adapters}/late/"}]
        pod.update_config_map(cm["metadata"]["name"], {"preload.yaml": yaml.safe_dump(entries)})
        with _client(pod, pki) as client:
            wait_until(lambda: _states(client).get("late") == "ADAPTER_STATE_LOADED" and "ghost" not in _states(client),
                       "the preload change reached the server", poll_s=0.2)
        # ...and a removed entry is unloaded.
        pod.update_config_map(cm["metadata"]["name"],
                              {"preload.yaml": yaml.safe_dump([e for e in entries if e["name"] != "late"])})
        with _client(pod, pki) as client:
            wait_until(lambda: "late" not in _states(client), "the removed preload entry unloaded", poll_s=0.2)
        assert inf.proc.poll() is None and inf.proc.pid == pid

        after = time.time()
        prom.wait_for(f"min(timestamp(up)) > {after + 1}", timeout=15)
        queries = dashboard_queries("1m")
        assert len(queries) > 20
        empty = [f"{q.dashboard} / {q.panel} / {q.ref_id}: {q.expr}" for q in queries if not prom.query(q.expr)]
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    # TLS: the kubelet's gRPC probe is plaintext only, so the probes ask the plaintext health-only port.
    assert inf.spec["livenessProbe"]["grpc"] == {"port": pod.container_port(INFERENCE, "health"), "service": "liveness"}
    assert pod.probe(INFERENCE, "livenessProbe")[0]


def _drive_traffic(pod: Pod, pki: dict[str, str]) -> None:
    """Enough for every dashboard panel: requests over more adapters than slots and than the sidecar
    holds (slot and cache evictions), a cancelled stream, and bad requests on both APIs."""
    with _client(pod, pki) as client:
        for round_ in range(3):
            for name in ("a1", "a2", "a3", "req", None):
                out = list(client.generate(f"round {round_}", adapter=name, max_new_tokens=4, ignore_eos=True,
                                           timeout=60))
                assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        stream = client.generate("cancel me", max_new_tokens=200, ignore_eos=True, timeout=60)
        next(stream)
        stream.cancel()
        # "no-such" goes to the adapter resolver (these values turn it on): its object store is not
        # reachable from this machine, so the first use fails as retryable, not as an unknown name.
        for call, code in ((lambda: list(client.generate("x", adapter="no-such", timeout=30)), "UNAVAILABLE"),
                           (lambda: list(client.generate("x", max_new_tokens=10**7, timeout=10)), "INVALID_ARGUMENT")):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code().name == code
    # The HTTP API's errors panel: a request without a credential where tenants are configured.
    r = httpx.get(f"http://{pod.service_target('http')}/v1/models", timeout=30)
    assert r.status_code == 401, r.text


# ---- faults ----------------------------------------------------------------------------------------
def test_dead_scheduler_thread_fails_the_rendered_liveness_probe(tmp_path: Path) -> None:
    fault_values = tmp_path / "fault.yaml"
    fault_values.write_text(yaml.safe_dump({"inference": {
        "extraEnv": [{"name": "LORAPLEX_TEST_FAULT_SCHEDULER", "value": "die"}],
        "probes": {"startup": {"periodSeconds": 1, "failureThreshold": 120},
                   "liveness": {"periodSeconds": 2, "failureThreshold": 3},
                   "readiness": {"periodSeconds": 1, "failureThreshold": 1}}}}))
    docs = render_chart(fault_values)
    with running_pod(docs, {}) as pod:
        address = pod.service_target("grpc")
        probe = pod.containers[INFERENCE].spec["livenessProbe"]
        budget = probe["periodSeconds"] * probe["failureThreshold"]
        pod.containers[INFERENCE].proc.send_signal(signal.SIGUSR1)
        # failureThreshold failures in a row: the kubelet would restart the container. How soon
        # depends on the host; the timeout stops a hang (a probe that never fails).
        pod.wait_probe(INFERENCE, "livenessProbe", want=False, timeout=budget + HANG_S)
        assert _health(address, "") == "NOT_SERVING"
        assert "the scheduler thread has died" in pod.containers[INFERENCE].log()


# ---- the image-mode checks themselves ---------------------------------------------------------------
def test_image_checks_catch_root_and_writes_outside_volumes(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The checks the image-mode tests rely on are not vacuous: the same pod with its securityContext
    loosened (root, writable root filesystem) fails them, for each reason."""
    image = request.getfixturevalue("image")
    values = tmp_path / "root.yaml"
    values.write_text(yaml.safe_dump({
        "podSecurityContext": {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0, "fsGroup": 10001},
        "securityContext": {"runAsNonRoot": False, "readOnlyRootFilesystem": False}}))
    with running_pod(render_chart(values), {}, image=image) as pod:
        with pytest.raises(AssertionError, match="'Uid': \\[0, 0, 0, 0\\]"):
            _check_image_containers(pod)
        ok, detail = pod.exec(CACHE, ["sh", "-c", "echo x >/etc/written-outside"], timeout=30)
        assert ok, detail
        assert pod.root_writes(CACHE) == ["A /etc/written-outside"]
