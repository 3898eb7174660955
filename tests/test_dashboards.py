"""Grafana dashboards: generated, lossless through grafana-foundation-sdk, valid PromQL, known metrics.

No Grafana server installs here. Each panel query has its Grafana variables substituted
(harness/prometheus.py) and goes through `promtool check rules` as a recording rule, which parses
it with Prometheus' own PromQL parser. tests/test_alert_rules.py runs queries against a real server.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from harness.prometheus import alert_rules, dashboard_files, dashboard_queries, substitute_grafana_vars

REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "helm" / "tools" / "gen_dashboards.py"

# The metric contract of the two services (plus `up`); dashboards and alerts may use nothing else.
INFERENCE_METRICS = {
    "loraplex_lora_slots_total", "loraplex_lora_slots_occupied", "loraplex_lora_slots_referenced",
    "loraplex_lora_slots_pinned", "loraplex_lora_pending_load_events", "loraplex_lora_loads_total",
    "loraplex_lora_evictions_total", "loraplex_lora_load_seconds", "loraplex_requests_running",
    "loraplex_requests_waiting", "loraplex_time_to_first_token_seconds", "loraplex_inter_token_latency_seconds",
    "loraplex_prompt_tokens_total", "loraplex_generation_tokens_total", "loraplex_kv_cache_usage_ratio",
    "loraplex_requests_finished_total", "loraplex_grpc_requests_total", "loraplex_http_requests_total",
    "loraplex_adapter_requests_total",
    "vllm:lora_requests_info", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc", "loraplex_health_serving", "loraplex_drain_cancelled_requests_total",
    "loraplex_preload_adapters", "loraplex_preload_failures_total", "loraplex_preload_reloads_total",
    "loraplex_lora_adapters_resident", "loraplex_lora_adapter_resident",
    "loraplex_kv_cache_blocks", "loraplex_prefix_cache_queries_total", "loraplex_prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "loraplex_tenant_requests_running", "loraplex_tenant_requests_waiting", "loraplex_tenant_generated_tokens_total",
    "loraplex_tenant_quota_refusals_total", "loraplex_preemptions_total",
}
CACHE_METRICS = {
    "loraplex_cache_bytes", "loraplex_cache_capacity_bytes", "loraplex_cache_entries", "loraplex_cache_leases",
    "loraplex_cache_hits_total", "loraplex_cache_misses_total", "loraplex_cache_stage_seconds",
    "loraplex_cache_fetched_bytes_total", "loraplex_cache_fetch_requests_total",
    "loraplex_cache_inflight_fetches", "loraplex_cache_evictions_total", "loraplex_cache_errors_total",
}
KNOWN = INFERENCE_METRICS | CACHE_METRICS | {"up"}
# Router-compatible series are for gateways; everything else must be on a dashboard.
MUST_SHOW = KNOWN - {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}
_METRIC = re.compile(r"\b(loraplex_[a-z0-9_]+|vllm:[a-z0-9_:]+|up(?=\{))")
_HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression, histogram series folded into their histogram's name."""
    names = set()
    for name in _METRIC.findall(expr):
        base = _HISTOGRAM_SERIES.sub("", name)
        names.add(base if base in KNOWN else name)
    return names


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_dashboards", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboards_exist() -> None:
    assert {p.name for p in dashboard_files()} == {"loraplex-serving.json", "loraplex-adapter-cache.json"}


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_committed_json_is_fresh(path: Path) -> None:
    """The JSON is generated: edit helm/tools/gen_dashboards.py and rerun it."""
    assert path.read_text() == load_generator().render(path.name)


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_round_trips_through_foundation_sdk(path: Path) -> None:
    plugins.register_default_plugins()
    original = json.loads(path.read_text())
    again = json.loads(json.dumps(Dashboard.from_json(original), cls=JSONEncoder))
    assert again == original


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_datasource_variable_and_panel_wiring(path: Path) -> None:
    board = json.loads(path.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_queries_use_only_known_metrics_and_cover_them() -> None:
    queries = dashboard_queries()
    used: set[str] = set()
    for q in queries:
        names = metric_names(q.raw_expr)
        assert names, q
        assert names <= KNOWN, (q.panel, names - KNOWN)
        used |= names
    assert MUST_SHOW <= used, f"not on any dashboard: {MUST_SHOW - used}"
    for rule in alert_rules():
        assert metric_names(rule.expr) <= KNOWN, rule


def test_variable_substitution() -> None:
    expr = 'rate(x{pod=~"$pod", ns=~"${namespace}", a="[[adapter]]"}[$__rate_interval]) offset $__range'
    assert substitute_grafana_vars(expr, rate_interval="2m", variables={"pod": "p-1"}) == \
        'rate(x{pod=~"p-1", ns=~".*", a=".*"}[2m]) offset 1h'


@pytest.mark.needs_tool("promtool")
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    queries = dashboard_queries()
    assert len(queries) > 30
    rules = [{"record": f"dashboard:query_{i}", "expr": q.expr} for i, q in enumerate(queries)]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout
