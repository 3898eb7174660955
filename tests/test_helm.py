"""The Helm chart: lint, render with default and all-features values, validate the manifests offline.

Core kinds are validated with kubernetes-validate --strict (unknown fields rejected) against the chart's
minimum Kubernetes version (Chart.yaml kubeVersion: native sidecars) and the newest schema bundled.
The Prometheus Operator kinds (ServiceMonitor, PodMonitor, PrometheusRule) are CRDs that
kubernetes-validate has no schema for: they get structural checks here instead, and the
PrometheusRule's groups go through `promtool check rules`. No API server runs here, so nothing is
applied; what the rendered pod does when started is tests/test_kubelet_pod.py's job.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from harness.prometheus import ALERT_RULES_FILE, CHART_DIR, DASHBOARDS_DIR

REPO = Path(__file__).resolve().parents[1]
HELM = REPO / ".tools" / "bin" / "helm"
DATA = REPO / "tests" / "data"
ALL_VALUES = DATA / "helm-values-all.yaml"
BAD_VALUES = DATA / "helm-values-bad-type.yaml"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
GIE_KINDS = {"InferencePool", "InferenceObjective"}  # validated by tests/test_helm_gateway.py

pytestmark = pytest.mark.needs_tool("helm", HELM)


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(*value_files: Path, sets: tuple[str, ...] = ()) -> list[dict]:
    args = ["template", "rel", str(CHART_DIR), "--namespace", "ml"]
    for f in value_files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def all_docs() -> list[dict]:
    return render(ALL_VALUES)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def containers(docs: list[dict]) -> dict[str, dict]:
    """Every container of the pod by name, the native sidecar (an init container) included."""
    (deploy,) = by_kind(docs, "Deployment")
    spec = deploy["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def test_chart_minimum_version_matches_the_validated_one() -> None:
    assert yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["kubeVersion"] == f">={K8S_VERSIONS[0]}-0"


@pytest.mark.parametrize("values", [None, ALL_VALUES], ids=["defaults", "all-features"])
def test_lint_strict(values: Path | None) -> None:
    out = helm("lint", "--strict", str(CHART_DIR), *(["-f", str(values)] if values else []))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("docs_fixture", ["default_docs", "all_docs"])
def test_core_kinds_validate_strict(docs_fixture: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(docs_fixture)
    core = [d for d in docs if d["kind"] not in CRD_KINDS | GIE_KINDS]
    assert {"Deployment", "Service", "ServiceAccount", "ConfigMap"} <= {d["kind"] for d in core}
    for version in K8S_VERSIONS:
        for doc in core:
            kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_validator_rejects_unknown_fields(default_docs: list[dict]) -> None:
    """Guards the check above: strict validation does catch a misspelled field."""
    (deploy,) = by_kind(default_docs, "Deployment")
    broken = json.loads(json.dumps(deploy))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_all_features_render_every_kind(all_docs: list[dict]) -> None:
    kinds = {d["kind"] for d in all_docs}
    assert kinds >= {"Deployment", "Service", "ServiceAccount", "ConfigMap", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "PodMonitor", "PrometheusRule"}


def test_crd_kinds_are_structurally_sound(all_docs: list[dict]) -> None:
    for doc in all_docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["metadata"]["name"] and doc["metadata"]["labels"]
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        (mon,) = by_kind(all_docs, kind)
        assert mon["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "rel"
        assert mon["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
        jobs = {ep["port"]: ep["relabelings"][0]["replacement"] for ep in mon["spec"][key]}
        assert jobs == {"metrics": "loraplex-inference", "cache-metrics": "loraplex-cache"}


def test_prometheus_rule_matches_rule_file_with_overrides(all_docs: list[dict], tmp_path: Path) -> None:
    (rule,) = by_kind(all_docs, "PrometheusRule")
    groups = rule["spec"]["groups"]
    rendered = {r["alert"]: r for g in groups for r in g["rules"]}
    shipped = {r["alert"]: r for g in yaml.safe_load(ALERT_RULES_FILE.read_text())["groups"] for r in g["rules"]}
    assert set(rendered) == set(shipped) - {"LoraplexColdLoadRateHigh"}  # disabled in the values file
    assert rendered["LoraplexSlotLeak"]["for"] == "30m"                     # override applied
    for name, r in rendered.items():
        assert r["expr"] == shipped[name]["expr"]
        assert r["labels"]["team"] == "ml-platform" and r["labels"]["severity"] == shipped[name]["labels"]["severity"]
    if shutil.which("promtool"):
        path = tmp_path / "rendered-rules.yaml"
        path.write_text(yaml.safe_dump({"groups": groups}))
        out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr


def test_pod_shape_defaults(default_docs: list[dict]) -> None:
    (deploy,) = by_kind(default_docs, "Deployment")
    pod = deploy["spec"]["template"]
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    cs = containers(default_docs)
    assert set(cs) == {"loraplex-inference", "loraplex-cache"}
    assert cs["loraplex-inference"]["image"] == cs["loraplex-cache"]["image"]
    # no scope flag: the service's own default (per tenant whenever tenants are configured) applies
    assert not any(a.startswith("--prefix-cache-scope") for a in cs["loraplex-inference"]["args"])
    # no tenants: no tenants' adapter registrations to keep
    assert not any(a.startswith("--state-dir") for a in cs["loraplex-inference"]["args"])
    for c in cs.values():
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    staged = volumes["staged-adapters"]["emptyDir"]
    capacity = 8589934592
    assert staged["medium"] == "Memory" and int(staged["sizeLimit"]) == capacity + capacity * 10 // 100
    # Both containers mount the staged adapters and the socket directory.
    for c in cs.values():
        assert {"staged-adapters", "cache-socket"} <= {m["name"] for m in c["volumeMounts"]}

    inf, cache = cs["loraplex-inference"], cs["loraplex-cache"]
    assert "--cache-address=unix:///var/run/loraplex/cache.sock" in inf["args"]
    assert "--listen=unix:///var/run/loraplex/cache.sock" in cache["args"]
    assert f"--capacity-bytes={capacity}" in cache["args"]
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Startup and liveness ask the watchdog-backed "liveness" service; readiness the overall one.
    assert inf["startupProbe"]["grpc"] == inf["livenessProbe"]["grpc"] == {"port": 50051, "service": "liveness"}
    assert inf["readinessProbe"]["grpc"] == {"port": 50051}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "grpc_health" in " ".join(cache[probe]["exec"]["command"])
    # The sidecar starts first and outlives the inference container (native sidecar).
    assert [c["name"] for c in spec["initContainers"]] == ["loraplex-cache"] and cache["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["loraplex-inference"]
    # Metrics on the pod address for both; dtype auto; drain budget derived from the pod's grace.
    assert "--metrics-addr=0.0.0.0" in inf["args"] and "--metrics-addr=0.0.0.0" in cache["args"]
    assert "--dtype=auto" in inf["args"] and "--weights-dtype=auto" in inf["args"]
    assert "--listen=0.0.0.0:50051" in inf["args"]
    assert "--shutdown-grace-s=50" in inf["args"] and "--drain-delay-s=2" in inf["args"]
    assert spec["terminationGracePeriodSeconds"] == 60
    assert inf["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert not any(a.startswith("--admin-token-file") or a == "--insecure-admin" for a in inf["args"])
    # Trust between the containers: staged adapters read-only for inference, no shared writable
    # scratch, the kernel cache (.so files the inference process dlopen()s) mounted by it alone.
    mounts = {name: {m["name"]: m for m in c["volumeMounts"]} for name, c in cs.items()}
    assert mounts["loraplex-inference"]["staged-adapters"]["readOnly"] is True
    assert "kernel-cache" not in mounts["loraplex-cache"]
    kernel_dir = mounts["loraplex-inference"]["kernel-cache"]["mountPath"]
    assert {"name": "LORAPLEX_KERNEL_CACHE", "value": kernel_dir} in inf["env"]
    writable = {n: {m["name"] for m in ms.values() if not m.get("readOnly")} for n, ms in mounts.items()}
    assert writable["loraplex-inference"] & writable["loraplex-cache"] == {"cache-socket"}
    # Preload changes reach running pods through the mounted ConfigMap: nothing rolls them.
    assert "checksum/preload" not in (pod["metadata"].get("annotations") or {})
    # tmpfs pages count against the sidecar: its memory covers the shm size plus the process.
    assert int(cache["resources"]["limits"]["memory"]) == int(staged["sizeLimit"]) + 536870912
    (svc,) = by_kind(default_docs, "Service")
    assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "http", "metrics", "cache-metrics"}


def test_pod_shape_all_features(all_docs: list[dict]) -> None:
    cs = containers(all_docs)
    inf, cache = cs["loraplex-inference"], cs["loraplex-cache"]
    assert "IPC_LOCK" in cache["securityContext"]["capabilities"]["add"]
    assert "add" not in inf["securityContext"]["capabilities"]
    for flag in ("--admin-token-file=/etc/loraplex/admin/token", "--tls-client-ca=/etc/loraplex/tls/ca.crt",
                 "--preload-file=/etc/loraplex/preload/preload.yaml", "--kv-cache-bytes=21474836480",
                 "--adapter-source-allow=https://models.example.com/adapters/", "--dtype=bfloat16",
                 "--weights-dtype=q8_0", "--max-model-len=4096", "--watchdog-stall-s=30", "--shutdown-grace-s=23",
                 "--drain-delay-s=1",
                 "--preload-reload-s=2", "--tenants-file=/etc/loraplex/tenants/tenants.yaml",
                 "--trusted-tenant-header=x-tenant", "--prefix-cache-scope=listener"):
        assert flag in inf["args"], flag
    assert {"name": "tenants", "mountPath": "/etc/loraplex/tenants", "readOnly": True} in inf["volumeMounts"]
    # tenants configured: their adapter registrations kept (writable) across container restarts
    assert "--state-dir=/var/lib/loraplex/state" in inf["args"]
    assert {"name": "state", "mountPath": "/var/lib/loraplex/state"} in inf["volumeMounts"]
    (deploy,) = by_kind(all_docs, "Deployment")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["state"]
    assert inf["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "3"]
    assert {"name": "LORAPLEX_MAX_QUEUE", "value": "512"} in inf["env"]
    assert inf["envFrom"] == [{"configMapRef": {"name": "loraplex-extra-env"}}]
    assert cache["envFrom"] == [{"secretRef": {"name": "loraplex-cache-extra"}}]
    assert {"name": "LORAPLEX_CACHE_LOG_LEVEL", "value": "DEBUG"} in cache["env"]
    for c in (inf, cache):
        assert {"name": "scratch", "mountPath": "/scratch"} in c["volumeMounts"]
    assert cache["startupProbe"]["periodSeconds"] == 1 and cache["startupProbe"]["failureThreshold"] == 60
    assert "--allow-prefix=file:///adapters/" in cache["args"]
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == 2
    # kubelet gRPC probes are plaintext only: with TLS they ask the plaintext health-only port
    assert inf["startupProbe"]["grpc"] == {"port": 50052, "service": "liveness"}
    assert inf["readinessProbe"]["grpc"] == {"port": 50052} and "--health-listen=0.0.0.0:50052" in inf["args"]
    env = {e["name"]: e for e in cache["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "loraplex-s3"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://rgw.storage.svc:8080"
    (cm,) = [d for d in by_kind(all_docs, "ConfigMap") if d["metadata"]["name"].endswith("-preload")]
    preload = yaml.safe_load(cm["data"]["preload.yaml"])
    assert preload[0] == {"name": "acme/support@v3", "uri": "s3://adapters/acme/support/v3/", "pinned": True,
                          "required": True, "sha256": "0d3c6f04e83f5bd0b6bd3bd1b6c1c2f9b8c5a3a1"
                                                      "bd7d7f8e9a0b1c2d3e4f5a6b"}
    assert preload[1]["pinned"] is False and preload[1]["required"] is False
    (sa,) = by_kind(all_docs, "ServiceAccount")
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]
    (deploy,) = by_kind(all_docs, "Deployment")
    assert "replicas" not in deploy["spec"]  # the HPA owns it
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    spec = deploy["spec"]["template"]["spec"]
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}} in spec["volumes"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu" and "podAntiAffinity" in spec["affinity"]


def test_dashboard_configmaps(default_docs: list[dict]) -> None:
    maps = [d for d in by_kind(default_docs, "ConfigMap") if "-dashboard-" in d["metadata"]["name"]]
    files = {p.name: p for p in DASHBOARDS_DIR.glob("*.json")}
    assert files and len(maps) == len(files)
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        assert json.loads(text) == json.loads(files[name].read_text())


def test_values_validate_against_schema() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    for path in (CHART_DIR / "values.yaml", ALL_VALUES):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    bad = yaml.safe_load(BAD_VALUES.read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_tenants_state_on_a_claim_outlives_the_pod() -> None:
    docs = render(sets=("inference.state.existingClaim=loraplex-state",))
    (deploy,) = by_kind(docs, "Deployment")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"] == {"claimName": "loraplex-state"}
    assert "--state-dir=/var/lib/loraplex/state" in containers(docs)["loraplex-inference"]["args"]


@pytest.mark.parametrize("bad", ["model.dtype=fp8", "model.weightsDtype=q5_k", "inference.drain.preStopSeconds=-1",
                                 "preload.reloadSeconds=x",
                                 "strategy.type=Sometimes", "tolerations[0].operator=Maybe",
                                 "inference.prefixCacheScope=everyone"])
def test_helm_rejects_bad_new_values(bad: str) -> None:
    out = helm("template", "rel", str(CHART_DIR), "--set", bad)
    assert out.returncode != 0 and "schema" in out.stderr.lower(), out.stderr


@pytest.mark.parametrize("how", ["file", "set"])
def test_helm_rejects_wrong_types(how: str) -> None:
    args = ["template", "rel", str(CHART_DIR)]
    args += ["-f", str(BAD_VALUES)] if how == "file" else ["--set", "inference.maxLoras=many"]
    out = helm(*args)
    assert out.returncode != 0
    assert "schema" in out.stderr.lower() and "maxloras" in out.stderr.lower()


# --- The container image ---------------------------------------------------------------------------
# No Docker engine here: the Dockerfile is checked statically (stages, non-root user, build args,
# and that the commands the chart runs are console scripts the image installs).


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in (REPO / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip() if current else line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(current)
            current = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_dockerfile_is_multistage_and_non_root() -> None:
    instructions = dockerfile_instructions()
    stages = [args for op, args in instructions if op == "FROM"]
    assert len(stages) >= 2 and all(" AS " in s.upper() for s in stages)
    final = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM"):]
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    assert users[-1].split(":")[0] == str(yaml.safe_load((CHART_DIR / "values.yaml").read_text())
                                          ["podSecurityContext"]["runAsUser"])
    assert any(op == "COPY" and args.startswith("--from=build") for op, args in final)
    declared = {args.split("=")[0] for op, args in instructions if op == "ARG"}
    assert {"TORCH_INDEX_URL", "TORCH_VERSION"} <= declared
    assert not any(op == "ADD" for op, _ in instructions)


def test_chart_commands_are_image_entry_points(default_docs: list[dict]) -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for container in containers(default_docs).values():
        assert container["command"][0] in scripts
