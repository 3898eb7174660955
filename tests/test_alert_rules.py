"""Alert rules: promtool checks and unit tests, and a real Prometheus loading and evaluating them.

The unit tests (helm/loraplex/rules/tests/) show each alert firing on a synthetic faulty series and
silent on a healthy one; this module also checks that every alert has both kinds of case. The last
test is the self-test of harness/prometheus.py: a real server scraping an in-process exporter.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from harness.prometheus import (
    ALERT_RULES_FILE,
    alert_rules,
    dashboard_queries,
    running_prometheus,
)

RULE_TESTS = sorted((ALERT_RULES_FILE.parent / "tests").glob("*.yaml"))
needs_promtool = pytest.mark.needs_tool("promtool")


def promtool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *map(str, args)], capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_check_rules() -> None:
    out = promtool("check", "rules", ALERT_RULES_FILE)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    assert RULE_TESTS
    out = promtool("test", "rules", *RULE_TESTS)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {r.alert for r in alert_rules()}
    assert names == fired, f"alerts without a firing test: {names - fired}"
    assert names == silent, f"alerts without a non-firing test: {names - silent}"


def test_alerts_carry_severity_and_summary() -> None:
    doc = yaml.safe_load(ALERT_RULES_FILE.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


@pytest.mark.needs_tool("prometheus")
def test_real_prometheus_scrapes_and_evaluates() -> None:
    """Fixture self-test: scrape a tiny exporter, query it, run a dashboard query, evaluate the rules."""
    reg = CollectorRegistry()
    Gauge("loraplex_lora_slots_total", "slots", registry=reg).set(8)
    Gauge("loraplex_lora_slots_occupied", "slots with an adapter", registry=reg).set(3)
    Gauge("loraplex_lora_slots_referenced", "referenced slots", registry=reg).set(1)
    Gauge("loraplex_lora_slots_pinned", "pinned slots", registry=reg).set(1)
    Gauge("loraplex_requests_running", "running", registry=reg).set(2)
    loads = Counter("loraplex_lora_loads", "loads", ["tier"], registry=reg)
    loads.labels("store").inc(3)
    Histogram("loraplex_lora_load_seconds", "load latency", ["tier"], registry=reg).labels("cache").observe(0.02)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        target = f"127.0.0.1:{server.server_port}"
        with running_prometheus({"loraplex-inference": [target]}, rule_files=[ALERT_RULES_FILE]) as prom:
            result = prom.wait_for('loraplex_lora_slots_total{job="loraplex-inference"}', timeout=30)
            assert result[0]["value"][1] == "8" and result[0]["metric"]["instance"] == target

            (slots,) = [q for q in dashboard_queries() if q.panel == "Slots" and q.ref_id == "C"]
            assert "$" not in slots.expr
            assert prom.query(slots.expr)[0]["value"][1] == "1"  # referenced slots

            rules = prom.wait_for_rule_evaluation(timeout=15)
            assert {r["name"] for r in rules} == {r.alert for r in alert_rules()}
            assert all(r["health"] == "ok" for r in rules), [r.get("lastError") for r in rules]
            assert prom.query("up")[0]["value"][1] == "1"
    finally:
        server.shutdown()
        thread.join(timeout=5)
