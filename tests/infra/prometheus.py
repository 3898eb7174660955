"""A real Prometheus server for tests, plus the queries our dashboards and alerts run.

The Debian `prometheus` binary (installed by scripts/install_test_tools.sh) on 127.0.0.1 with a free
port, a temp TSDB, static scrape targets at a short interval and optional rule files:

    with running_prometheus({"loraplex-inference": ["127.0.0.1:9400"],
                             "loraplex-cache": ["127.0.0.1:9401"]},
                            rule_files=[ALERT_RULES_FILE]) as prom:
        prom.wait_for("up == 1")                     # first scrape lands a few seconds after start
        for q in dashboard_queries():                # every Grafana panel query, variables substituted
            assert prom.query(q.expr), q
        for rule in prom.wait_for_rule_evaluation(): # every alert rule evaluated without error
            assert rule["health"] == "ok", rule

Job names matter: the alert rules and dashboards select `job="loraplex-inference"` /
`job="loraplex-cache"` (what the chart's ServiceMonitor sets). Pytest fixture `prometheus_factory`
(function-scoped) returns `running_prometheus`-like starts that are stopped at teardown.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.infra.ports import free_port
from tests.infra.tools import require_tool

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "loraplex"
DASHBOARDS_DIR = CHART_DIR / "dashboards"
ALERT_RULES_FILE = CHART_DIR / "rules" / "loraplex-alerts.yaml"
_PROCESS_MAX_S = 3 * 3600  # hard upper bound on the server's life, in case the parent dies


class PrometheusError(RuntimeError):
    """The HTTP API answered with an error (bad query, server not ready...)."""


def prometheus_available() -> bool:
    return shutil.which("prometheus") is not None


@dataclass
class Prometheus:
    """A running server: `url`, HTTP API helpers, `stop()`."""

    url: str
    process: subprocess.Popen
    workdir: Path

    def api(self, path: str, params: Mapping[str, str] | None = None, timeout: float = 10.0) -> Any:
        """GET /api/v1/<path>; returns `data` or raises PrometheusError with the server's message."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # 400/422 carry a JSON error body
            try:
                body = json.load(e)
            except ValueError:
                raise PrometheusError(f"{path}: HTTP {e.code}") from e
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {dict(params or {})}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query; returns the result list (vector/matrix), or [value] wrapped for scalars."""
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        data = self.api("query", params)
        result = data["result"]
        return result if data["resultType"] in ("vector", "matrix") else [{"value": result}]

    def wait_for(self, expr: str, timeout: float = 30.0,
                 predicate: Callable[[list[dict]], bool] = bool, interval: float = 0.25) -> list[dict]:
        """Polls `expr` until `predicate(result)` holds (default: non-empty); returns that result."""
        deadline = time.monotonic() + timeout
        last: list[dict] | Exception = []
        while True:
            try:
                last = self.query(expr)
                if predicate(last):
                    return last
            except PrometheusError as e:
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} not satisfied after {timeout}s; last: {last}")
            time.sleep(interval)

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def rules(self) -> list[dict]:
        """Every loaded rule (alerting and recording), each with its group name under "group"."""
        return [dict(rule, group=group["name"]) for group in self.api("rules")["groups"]
                for rule in group["rules"]]

    def wait_for_rule_evaluation(self, timeout: float = 30.0) -> list[dict]:
        """Waits until every loaded rule has been evaluated at least once; returns them
        (check `health == "ok"` / `lastError` on each)."""
        deadline = time.monotonic() + timeout
        while True:
            rules = self.rules()
            # Never-evaluated rules report Go's zero time, 0001-01-01T00:00:00Z.
            if rules and all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules):
                return rules
            if time.monotonic() > deadline:
                raise TimeoutError(f"rules not all evaluated after {timeout}s: {rules}")
            time.sleep(0.25)

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _config(targets: Mapping[str, Sequence[str]], rule_files: Sequence[Path],
            scrape_interval: str, evaluation_interval: str) -> dict:
    return {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                   "evaluation_interval": evaluation_interval},
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addrs)}]}
                           for job, addrs in targets.items()],
    }


def start_prometheus(targets: Mapping[str, Sequence[str]] | Sequence[str] = (), *,
                     rule_files: Sequence[Path | str] = (), scrape_interval: str = "1s",
                     evaluation_interval: str = "1s", ready_timeout: float = 30.0) -> Prometheus:
    """Starts Prometheus and waits for /-/ready. `targets`: {job: ["host:port", ...]} or a plain list
    of "host:port" (job "test"). Call `.stop()` (or use `running_prometheus`)."""
    if not prometheus_available():
        raise RuntimeError("prometheus binary not found; run scripts/install_test_tools.sh")
    if not isinstance(targets, Mapping):
        targets = {"test": list(targets)} if targets else {}
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-prom-"))
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(targets, [Path(f) for f in rule_files],
                                             scrape_interval, evaluation_interval)))
    for _attempt in range(3):  # the free port can be taken between probe and bind
        port = free_port()
        log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115  (closed with the process)
        proc = subprocess.Popen(
            ["timeout", "--signal=KILL", str(_PROCESS_MAX_S), "prometheus",
             f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        prom = Prometheus(url=f"http://127.0.0.1:{port}", process=proc, workdir=workdir)
        deadline = time.monotonic() + ready_timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return prom
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        output = (workdir / "prometheus.log").read_text(errors="replace")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "address already in use" not in output:
            shutil.rmtree(workdir, ignore_errors=True)
            raise RuntimeError(f"prometheus did not become ready:\n{output[-4000:]}")
    shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError("prometheus: no free port after 3 attempts")


@contextmanager
def running_prometheus(targets: Mapping[str, Sequence[str]] | Sequence[str] = (), **kwargs: Any
                       ) -> Iterator[Prometheus]:
    """`start_prometheus` as a context manager that always stops the server."""
    prom = start_prometheus(targets, **kwargs)
    try:
        yield prom
    finally:
        prom.stop()


@pytest.fixture
def prometheus_factory() -> Iterator[Callable[..., Prometheus]]:
    """Returns `start_prometheus`; every server started through it is stopped at teardown."""
    require_tool("prometheus")
    started: list[Prometheus] = []

    def start(*args: Any, **kwargs: Any) -> Prometheus:
        started.append(start_prometheus(*args, **kwargs))
        return started[-1]

    yield start
    for prom in started:
        prom.stop()


# --- The queries our dashboards and alerts run -------------------------------------------------------

# Grafana's built-in interval variables, and what to put in their place outside Grafana.
_BUILTINS = ("__rate_interval", "__interval", "__range")
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def substitute_grafana_vars(expr: str, rate_interval: str = "1m", range_: str = "1h",
                            variables: Mapping[str, str] | None = None) -> str:
    """Plain PromQL from a panel query: `$__rate_interval`/`$__interval` become `rate_interval`,
    `$__range` becomes `range_`, and dashboard variables become `variables[name]` (default ".*", the
    dashboards' "All" value, so `pod=~"$pod"` matches every series, with or without the label)."""
    values = {"__rate_interval": rate_interval, "__interval": rate_interval, "__range": range_}
    values.update(variables or {})

    def repl(m: re.Match) -> str:
        return values.get(m.group(1) or m.group(2) or m.group(3), ".*")

    return _VAR.sub(repl, expr)


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str   # dashboard file name
    panel: str       # panel title
    ref_id: str
    raw_expr: str    # as stored in the dashboard
    expr: str        # Grafana variables substituted: plain PromQL
    instant: bool


@dataclass(frozen=True)
class AlertRule:
    group: str
    alert: str
    expr: str
    for_: str


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])  # collapsed rows nest their panels


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS_DIR.glob("*.json"))


def dashboard_queries(rate_interval: str = "1m", variables: Mapping[str, str] | None = None
                      ) -> list[PanelQuery]:
    """Every Prometheus query of every panel of every shipped dashboard."""
    queries = []
    for path in dashboard_files():
        board = json.loads(path.read_text())
        for panel in _panels(board.get("panels", [])):
            for target in panel.get("targets") or []:
                if target.get("expr"):
                    queries.append(PanelQuery(
                        dashboard=path.name, panel=panel.get("title", ""), ref_id=target.get("refId", ""),
                        raw_expr=target["expr"],
                        expr=substitute_grafana_vars(target["expr"], rate_interval, variables=variables),
                        instant=bool(target.get("instant"))))
    return queries


def alert_rules(path: Path = ALERT_RULES_FILE) -> list[AlertRule]:
    """Every alerting rule of the shipped rule file (the same file the chart's PrometheusRule renders)."""
    doc = yaml.safe_load(path.read_text())
    return [AlertRule(group=g["name"], alert=r["alert"], expr=r["expr"].strip(), for_=str(r.get("for", "0s")))
            for g in doc["groups"] for r in g["rules"] if "alert" in r]


def alert_expressions(path: Path = ALERT_RULES_FILE) -> list[tuple[str, str]]:
    """(alert name, PromQL expression) for every alert."""
    return [(r.alert, r.expr) for r in alert_rules(path)]
