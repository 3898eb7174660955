"""The chart's Gateway API Inference Extension (GIE) objects: the InferencePool on the HTTP port and
one InferenceObjective per preloaded adapter, validated against JSON schemas written from the GIE
v1.0.0 API reference (helm/schemas/gie/); the pod label the endpoint picker reads for the engine type.
Built-in kinds of the same renders go through kubernetes-validate --strict.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "helm" / "loraplex"
HELM = REPO / ".tools" / "bin" / "helm"
ALL_VALUES = REPO / "tests" / "data" / "helm-values-all.yaml"
SCHEMAS = {kind: json.loads((REPO / "helm" / "schemas" / "gie" / f"{kind.lower()}.json").read_text())
           for kind in ("InferencePool", "InferenceObjective")}
NON_CORE = {"ServiceMonitor", "PodMonitor", "PrometheusRule", *SCHEMAS}
POOL_ON = ("inferenceGateway.inferencePool.enabled=true", "inferenceGateway.inferencePool.endpointPicker.name=epp")

pytestmark = pytest.mark.needs_tool("helm", HELM)


def helm_template(*sets: str, files: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [str(HELM), "template", "rel", str(CHART_DIR), "--namespace", "ml"]
    for f in files:
        cmd += ["-f", str(f)]
    for a in sets:
        cmd += ["--set", a]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def render(*sets: str, values: Path | None = None) -> list[dict]:
    out = helm_template(*sets, files=() if values is None else (values,))
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def validate_gie(doc: dict) -> None:
    jsonschema.Draft7Validator(SCHEMAS[doc["kind"]]).validate(doc)


@pytest.fixture(scope="module")
def pool_docs() -> list[dict]:
    return render(*POOL_ON, "inferenceGateway.inferencePool.objectives.enabled=true",
                  "inferenceGateway.inferencePool.objectives.priority=5",
                  "preload.adapters[0].name=acme/Support@v3", "preload.adapters[0].uri=s3://adapters/acme/support/",
                  "preload.adapters[1].name=sql-lora", "preload.adapters[1].uri=s3://adapters/sql/")


def test_schemas_are_valid_draft7() -> None:
    for schema in SCHEMAS.values():
        jsonschema.Draft7Validator.check_schema(schema)


def test_pool_off_by_default() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] in SCHEMAS]


def test_pool_renders_and_validates(pool_docs: list[dict]) -> None:
    (pool,) = of_kind(pool_docs, "InferencePool")
    validate_gie(pool)
    (deploy,) = of_kind(pool_docs, "Deployment")
    pod = deploy["spec"]["template"]
    # The pool selects exactly this release's pods, on the HTTP port the inference container serves.
    assert pool["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    assert all(pod["metadata"]["labels"][k] == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    inf = next(c for c in pod["spec"]["containers"] if c["name"] == "loraplex-inference")
    http = next(p for p in inf["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}] == [{"number": 8000}]
    assert "--http-port=8000" in inf["args"] and "--http-addr=0.0.0.0" in inf["args"]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    # The engine-type label the endpoint picker uses to choose its metric dialect (vllm:*).
    assert pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
    (svc,) = of_kind(pool_docs, "Service")
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"} \
        in svc["spec"]["ports"]


def test_one_objective_per_preloaded_adapter(pool_docs: list[dict]) -> None:
    objectives = of_kind(pool_docs, "InferenceObjective")
    for doc in objectives:
        validate_gie(doc)
    by_adapter = {d["metadata"]["annotations"]["loraplex.io/adapter"]: d for d in objectives}
    assert set(by_adapter) == {"acme/Support@v3", "sql-lora"}
    assert by_adapter["acme/Support@v3"]["metadata"]["name"] == "rel-loraplex-acme-support-v3"
    assert by_adapter["sql-lora"]["metadata"]["name"] == "rel-loraplex-sql-lora"
    for doc in objectives:
        assert doc["spec"] == {"priority": 5, "poolRef": {"group": "inference.networking.k8s.io",
                                                          "kind": "InferencePool", "name": "rel-loraplex"}}


def test_objectives_off_unless_asked() -> None:
    docs = render(*POOL_ON, "preload.adapters[0].name=a", "preload.adapters[0].uri=s3://adapters/a/")
    assert len(of_kind(docs, "InferencePool")) == 1 and not of_kind(docs, "InferenceObjective")


@pytest.mark.parametrize("values", [None, ALL_VALUES], ids=["pool-on", "all-features"])
def test_builtin_kinds_stay_valid(values: Path | None, pool_docs: list[dict]) -> None:
    docs = pool_docs if values is None else render(values=values)
    if values is not None:  # the all-features values switch the pool, objectives and resolver on too
        assert of_kind(docs, "InferencePool") and len(of_kind(docs, "InferenceObjective")) == 2
        (deploy,) = of_kind(docs, "Deployment")
        inf = next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "loraplex-inference")
        assert "--adapter-resolver=s3://adapters/{name}" in inf["args"] and "--http-port=8080" in inf["args"]
        for doc in docs:
            if doc["kind"] in SCHEMAS:
                validate_gie(doc)
    core = [d for d in docs if d["kind"] not in NON_CORE]
    for doc in core:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize(("kind", "path", "value"), [
    ("InferencePool", ("spec", "targetPortNumber"), 8000),  # the pre-v1 (v1alpha2) field name
    ("InferencePool", ("spec", "extensionRef"), {"name": "epp"}),  # pre-v1 as well
    ("InferencePool", ("spec", "targetPorts"), [{"number": 0}]),
    ("InferencePool", ("spec", "targetPorts"), [{"number": "8000"}]),
    ("InferencePool", ("spec", "endpointPickerRef", "failureMode"), "FailSometimes"),
    ("InferencePool", ("spec", "selector", "matchExpressions"), []),
    ("InferenceObjective", ("spec", "poolRef", "namespace"), "other"),
    ("InferenceObjective", ("spec", "priority"), "high"),
    ("InferenceObjective", ("spec", "criticality"), "Critical"),  # the old InferenceModel field
])
def test_schema_rejects_a_wrong_field(pool_docs: list[dict], kind: str, path: tuple[str, ...], value: object) -> None:
    doc = copy.deepcopy(of_kind(pool_docs, kind)[0])
    validate_gie(doc)  # the untouched one passes
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_gie(doc)


@pytest.mark.parametrize("missing", [("spec", "selector"), ("spec", "targetPorts"), ("spec", "endpointPickerRef"),
                                     ("spec", "endpointPickerRef", "port")])
def test_schema_requires_pool_fields(pool_docs: list[dict], missing: tuple[str, ...]) -> None:
    doc = copy.deepcopy(of_kind(pool_docs, "InferencePool")[0])
    node = doc
    for key in missing[:-1]:
        node = node[key]
    del node[missing[-1]]
    with pytest.raises(jsonschema.ValidationError):
        validate_gie(doc)


def test_pool_without_endpoint_picker_fails_with_a_clear_message() -> None:
    out = helm_template("inferenceGateway.inferencePool.enabled=true")
    assert out.returncode != 0 and "endpointPicker.name is required" in out.stderr, out.stderr


@pytest.mark.parametrize("bad", ["inferenceGateway.inferencePool.endpointPicker.failureMode=Maybe",
                                 "inference.adapterResolver=s3://adapters/fixed"])
def test_values_schema_rejects_bad_values(bad: str) -> None:
    out = helm_template(*POOL_ON, bad)
    assert out.returncode != 0 and "schema" in out.stderr.lower(), out.stderr


def test_resolver_off_by_default() -> None:
    (deploy,) = of_kind(render(), "Deployment")
    args = [a for c in deploy["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
    assert not any(a.startswith("--adapter-resolver") for a in args)
