"""The Helm chart: lint, render with default and all-features values, validate the manifests offline.

Core kinds are validated with kubernetes-validate --strict (unknown fields rejected) against the chart's
minimum Kubernetes version and the newest schema bundled. The Prometheus Operator kinds (ServiceMonitor,
PodMonitor, PrometheusRule) are CRDs that kubernetes-validate has no schema for: they get structural
checks here instead, and the PrometheusRule's groups go through `promtool check rules`.
No API server runs here, so nothing is applied.
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
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}

pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm not installed (scripts/install_test_tools.sh)")


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
    (deploy,) = by_kind(docs, "Deployment")
    return {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("values", [None, ALL_VALUES], ids=["defaults", "all-features"])
def test_lint_strict(values: Path | None) -> None:
    out = helm("lint", "--strict", str(CHART_DIR), *(["-f", str(values)] if values else []))
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("docs_fixture", ["default_docs", "all_docs"])
def test_core_kinds_validate_strict(docs_fixture: str, request: pytest.FixtureRequest) -> None:
    docs = request.getfixturevalue(docs_fixture)
    core = [d for d in docs if d["kind"] not in CRD_KINDS]
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
    assert pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    cs = containers(default_docs)
    assert set(cs) == {"loraplex-inference", "loraplex-cache"}
    assert cs["loraplex-inference"]["image"] == cs["loraplex-cache"]["image"]
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
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert inf[probe]["grpc"] == {"port": 50051}
        assert "grpc_health" in " ".join(cache[probe]["exec"]["command"])
    # tmpfs pages count against the sidecar: its memory covers the shm size plus the process.
    assert int(cache["resources"]["limits"]["memory"]) == int(staged["sizeLimit"]) + 536870912
    (svc,) = by_kind(default_docs, "Service")
    assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics", "cache-metrics"}


def test_pod_shape_all_features(all_docs: list[dict]) -> None:
    cs = containers(all_docs)
    inf, cache = cs["loraplex-inference"], cs["loraplex-cache"]
    assert "IPC_LOCK" in cache["securityContext"]["capabilities"]["add"]
    assert "add" not in inf["securityContext"]["capabilities"]
    for flag in ("--admin-token-file=/etc/loraplex/admin/token", "--tls-client-ca=/etc/loraplex/tls/ca.crt",
                 "--preload-file=/etc/loraplex/preload/preload.yaml", "--kv-cache-bytes=21474836480",
                 "--adapter-source-allow=https://models.example.com/adapters/"):
        assert flag in inf["args"]
    assert "--allow-prefix=file:///adapters/" in cache["args"]
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert inf["startupProbe"]["tcpSocket"] == {"port": "grpc"}  # kubelet gRPC probes are plaintext only
    env = {e["name"]: e for e in cache["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "loraplex-s3"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://rgw.storage.svc:8080"
    (cm,) = [d for d in by_kind(all_docs, "ConfigMap") if d["metadata"]["name"].endswith("-preload")]
    preload = yaml.safe_load(cm["data"]["preload.yaml"])
    assert preload[0] == {"name": "acme/support@v3", "uri": "s3://adapters/acme/support/v3/", "pinned": True}
    assert preload[1]["pinned"] is False
    (sa,) = by_kind(all_docs, "ServiceAccount")
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]
    (deploy,) = by_kind(all_docs, "Deployment")
    assert "replicas" not in deploy["spec"]  # the HPA owns it


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
