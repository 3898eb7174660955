"""A real Prometheus scraping a running inference service and its sidecar.

A real `loraplex-cache` sidecar (unix socket, /metrics, file:// allow-prefix over a temp dir of
adapters) and a real `loraplex-inference` server with `--cache-address` to it and `--max-loras 2`;
seven adapters registered by LoadAdapter with file:// URIs, so every slot load is staged through
the sidecar. The Debian `prometheus` binary scrapes both every second with the shipped alert rules
loaded, under the job names the chart's ServiceMonitor sets. A ~15 s load of concurrent Generates
cycling over five adapters and the base model churns the two slots (evictions, reloads, sidecar
misses then hits), with cancelled streams; then the two other adapters, one at a time, overflow the
sidecar's byte budget (sidecar evictions); bad requests before and after give both services error
codes, on both APIs of the inference service (gRPC and HTTP). Then every dashboard panel query
returns data (NO_DATA_EXPECTED lists exceptions, with reasons; none today), the panels that should
show this run's activity do, and every alert expression evaluates, with every rule healthy and none
firing.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest

from harness.inference_server import start_inference_server
from harness.prometheus import (
    ALERT_RULES_FILE,
    alert_expressions,
    dashboard_queries,
    running_prometheus,
)
from harness.sidecar import Sidecar
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.needs_tool("prometheus"),
]

ADAPTERS = [f"obs{i}" for i in range(5)]  # the concurrent load cycles over these
COLD = ["cold0", "cold1"]  # used one at a time after the load: the sidecar's cache overflows
MAX_LORAS = 2
# The sidecar's byte budget, in adapters. Every adapter that requests wait for holds a sidecar lease
# from staging until its slot copy (and an exhausted budget fails the adapter), so the budget covers
# the five churned at once; the two cold ones on top make it evict.
CACHED_ADAPTERS = len(ADAPTERS) + 1
LOAD_SECONDS = 15.0
WORKERS = 6
MAX_NEW = 8

# Panel queries (dashboard file, panel title, refId) that legitimately return no series after this
# run, and why. They must still evaluate without error. None today: every panel has data.
NO_DATA_EXPECTED: dict[tuple[str, str, str], str] = {}


def _by(result: list[dict], label: str) -> dict[str, float]:
    return {r["metric"].get(label, ""): float(r["value"][1]) for r in result}


def _total(result: list[dict]) -> float:
    return sum(float(r["value"][1]) for r in result)


# Beyond "has data": what this run must show on the panels that prove the churn and the errors.
# (panel title, refId) -> check of the instant result.
SHOWS_ACTIVITY = {
    ("Hits, misses, evictions / s", "A"): lambda r: _total(r) > 0,
    ("Hits, misses, evictions / s", "B"): lambda r: _total(r) > 0,
    ("Hits, misses, evictions / s", "C"): lambda r: _total(r) > 0,
    ("Errors / s by reason", "A"): lambda r: _by(r, "reason").get("not_found", 0) > 0,
    ("Loads and evictions / s", "A"): lambda r: _by(r, "tier").get("store", 0) > 0
    and _by(r, "tier").get("cache", 0) > 0,
    ("Loads and evictions / s", "B"): lambda r: _total(r) > 0,
    ("Finished requests / s", "A"): lambda r: _by(r, "finish_reason").get("cancelled", 0) > 0,
    ("Errors / s (gRPC and HTTP)", "A"): lambda r: {(x["metric"]["method"], x["metric"]["code"]) for x in r
                                                    if float(x["value"][1]) > 0}
    >= {("Generate", "CANCELLED"), ("Generate", "NOT_FOUND"), ("Generate", "INVALID_ARGUMENT")},
    ("Errors / s (gRPC and HTTP)", "B"): lambda r: {(x["metric"]["route"], x["metric"]["code"]) for x in r
                                                    if float(x["value"][1]) > 0}
    >= {("unmatched", "404"), ("/v1/completions", "404"), ("/v1/completions", "400")},
    ("Requests / s by API", "B"): lambda r: _by(r, "route").get("/v1/completions", 0) > 0,
    ("Requests / s per adapter (top 10)", "A"): lambda r: set(_by(r, "adapter")) == {*ADAPTERS, *COLD, "base"},
    ("Router view (vllm:lora_requests_info)", "A"): lambda r: _by(r, "max_lora").keys() == {str(MAX_LORAS)},
}


def _finish(stream) -> None:
    for _ in stream:
        pass


def _expect_error(call, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()


def _drive_load(address: str, stop: threading.Event) -> dict[str, int]:
    """Concurrent Generates cycling over every adapter (and the base model) until `stop`; every
    seventh one is cancelled after its first response."""
    turns = itertools.count()
    done = {"finished": 0, "cancelled": 0}
    lock = threading.Lock()

    def worker(w: int) -> None:
        with InferenceClient(address) as client:
            while not stop.is_set():
                n = next(turns)
                adapter = ([*ADAPTERS, None])[(n + w) % (len(ADAPTERS) + 1)]
                stream = client.generate(f"Request {n} says hello", adapter=adapter, max_new_tokens=MAX_NEW,
                                         ignore_eos=True, timeout=60)
                if n % 7 == 3:
                    next(stream)
                    stream.cancel()
                    kind = "cancelled"
                else:
                    _finish(stream)
                    kind = "finished"
                with lock:
                    done[kind] += 1

    with ThreadPoolExecutor(WORKERS) as pool:
        for f in [pool.submit(worker, w) for w in range(WORKERS)]:
            f.result()
    return done


def _wait_no_leases(sidecar: Sidecar, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while held := {e.uri: e.leases for e in sidecar.client.list() if e.leases}:
        assert time.monotonic() < deadline, f"sidecar leases still held after the load: {held}"
        time.sleep(0.05)


def _http_requests(http_url: str) -> None:
    """HTTP answers for the errors panel's HTTP line: 404s (no such path, no such model), a 400, a 200."""
    assert httpx.get(http_url + "/no/such/path", timeout=10).status_code == 404
    post = lambda body: httpx.post(http_url + "/v1/completions", json=body, timeout=60).status_code  # noqa: E731
    assert post({"model": "no-such-adapter", "prompt": "hi"}) == 404
    assert post({"model": "builtin:tiny", "prompt": "hi", "bogus": 1}) == 400
    assert post({"model": "builtin:tiny", "prompt": "hi", "max_tokens": 2}) == 200


def _bad_requests(address: str, adapters: Path) -> None:
    """Error codes on both services: the server's gRPC errors panel, the sidecar's errors panel."""
    with InferenceClient(address) as client:
        _expect_error(lambda: _finish(client.generate("hi", adapter="no-such-adapter", timeout=10)),
                      grpc.StatusCode.NOT_FOUND)
        _expect_error(lambda: _finish(client.generate("hi", max_new_tokens=10**7, timeout=10)),
                      grpc.StatusCode.INVALID_ARGUMENT)
        # Allowed prefix, no such directory: the sidecar's Stage fails (its errors_total{reason}).
        with pytest.raises(grpc.RpcError):
            client.load_adapter("missing", (adapters / "missing").as_uri(), timeout=30)


def test_dashboards_and_alerts_against_real_prometheus() -> None:
    # A short root: unix socket paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="lpx-obs-"))
    adapters = root / "adapters"
    for i, name in enumerate([*ADAPTERS, *COLD]):
        write_peft_adapter(adapters / name, rank=8, seed=900 + i)
    adapter_bytes = max(sum(f.stat().st_size for f in (adapters / n).iterdir()) for n in [*ADAPTERS, *COLD])
    sidecar = server = None
    try:
        sidecar = Sidecar(root, allow=[f"{adapters.as_uri()}/"], capacity=CACHED_ADAPTERS * adapter_bytes + 4096)
        server = start_inference_server(
            ["--model", "builtin:tiny", "--max-loras", str(MAX_LORAS), "--cache-address", sidecar.target,
             "--adapter-source-allow", f"{adapters.as_uri()}/"],
            log_dir=root, http=True)
        targets = {"loraplex-inference": [server.metrics_url.split("/")[2]],
                   "loraplex-cache": [f"127.0.0.1:{sidecar.metrics_port}"]}
        with running_prometheus(targets, rule_files=[ALERT_RULES_FILE], scrape_interval="1s") as prom:
            with InferenceClient(server.address) as client:
                for name in [*ADAPTERS, *COLD]:
                    client.load_adapter(name, (adapters / name).as_uri(), timeout=60)
            # Bad requests before and after the load: an error series is born at its first error, so
            # only the later ones show up in rate().
            _bad_requests(server.address, adapters)
            _http_requests(server.http_url)
            # A baseline sample of every series before the load, so rate() sees the load's increase.
            prom.wait_for('count(up{job=~"loraplex-inference|loraplex-cache"} == 1) == 2', timeout=30)

            stop = threading.Event()
            timer = threading.Timer(LOAD_SECONDS, stop.set)
            timer.start()
            try:
                done = _drive_load(server.address, stop)
            finally:
                timer.cancel()
                stop.set()
            assert done["finished"] > 20 and done["cancelled"] > 0, done
            _wait_no_leases(sidecar)  # every lease released once its slot copy is done
            with InferenceClient(server.address) as client:
                for name in COLD:
                    _finish(client.generate("cold", adapter=name, max_new_tokens=2, timeout=60))
            _bad_requests(server.address, adapters)
            _http_requests(server.http_url)

            # The run did what the dashboards are meant to show, as the services count it.
            assert server.value("loraplex_lora_evictions_total") > 0
            assert sidecar.metric("loraplex_cache_misses_total") >= len(ADAPTERS)
            assert sidecar.metric("loraplex_cache_hits_total") > 0
            assert sidecar.metric("loraplex_cache_evictions_total") > 0

            # Two more scrapes after the last request, so every counter's final value is in.
            after_load = time.time()
            prom.wait_for(f"min(timestamp(up)) > {after_load + 1}", timeout=15)

            # The router-compatible series arrive under their vLLM names (':' kept, not escaped to '_').
            for name in ("vllm:lora_requests_info", "vllm:num_requests_running", "vllm:num_requests_waiting",
                         "vllm:kv_cache_usage_perc"):
                assert prom.query(name), name
            assert prom.query('{__name__=~"vllm_.+"}') == []

            queries = dashboard_queries(rate_interval="1m")
            assert queries
            known = {(q.dashboard, q.panel, q.ref_id) for q in queries}
            assert set(NO_DATA_EXPECTED) <= known, set(NO_DATA_EXPECTED) - known
            empty, idle = [], []
            for q in queries:
                result = prom.query(q.expr)  # raises PrometheusError on an invalid query
                if not result and (q.dashboard, q.panel, q.ref_id) not in NO_DATA_EXPECTED:
                    empty.append(f"{q.dashboard} / {q.panel} / {q.ref_id}: {q.expr}")
                check = SHOWS_ACTIVITY.get((q.panel, q.ref_id))
                if check is not None and not check(result):
                    idle.append(f"{q.panel} / {q.ref_id}: {q.expr} -> {result}")
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
            assert not idle, "panels not showing this run's activity:\n" + "\n".join(idle)
            assert {p for p, _ in SHOWS_ACTIVITY} <= {q.panel for q in queries}

            # Every alert expression evaluates, and every rule group reports a healthy evaluation.
            expressions = alert_expressions()
            assert expressions
            for _alert, expr in expressions:
                prom.query(expr)
            rules = prom.wait_for_rule_evaluation(timeout=20)
            assert {r["name"] for r in rules} == {a for a, _ in expressions}
            unhealthy = [(r["group"], r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
            assert not unhealthy, unhealthy
            # A healthy stack under a short load raises nothing. Every alert needs minutes of `for:`,
            # longer than this test, so "firing" could not fail here: an alert whose expression holds
            # shows as pending at the first evaluation after it starts to.
            raised = [(a["labels"]["alertname"], a["state"]) for a in prom.alerts()]
            assert raised == [], raised
    finally:
        if server is not None:
            server.stop()
        if sidecar is not None:
            sidecar.stop()
        shutil.rmtree(root, ignore_errors=True)
