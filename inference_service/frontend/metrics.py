"""Prometheus metrics of the inference service.

Two feeds, one registry (never the global one, so tests and embedders can run several):
- counters and histograms are fed by the engine through `MetricsSink`, called from the
  scheduler thread (prometheus_client's metric objects are thread-safe);
- gauges are read from `engine.stats()` at scrape time by `EngineCollector`, so they can
  never drift from the engine's own state.
The sink protocol lives in metrics_sink.py (the engine must not import Prometheus) and is
re-exported here. Plus the router-compatible `vllm:*` series that Kubernetes inference
gateways read for LoRA-affinity routing; their names are fixed by vLLM, so promtool's lint
finding on the ':' in them is accepted (as is `_total` on the gauge loraplex_lora_slots_total,
whose name is fixed too).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from adapter_cache.adapter_format import LoadTier
from inference_service.engine.request import PREEMPTION_CAUSES, WaitReason
from inference_service.metrics_sink import MetricsSink, NullMetrics

__all__ = ["MetricsSink", "NullMetrics", "PrometheusMetrics", "EngineCollector", "build_registry", "serve_metrics"]

LOAD_TIERS = tuple(LoadTier)
# The scheduler's wait reasons: each has a series (0 when nothing waits for it), so the waiting
# gauge never vanishes from a scrape when the queue is empty.
WAIT_REASONS = tuple(WaitReason)
BASE_ADAPTER_LABEL = "base"  # adapter label of requests on the base model
OTHER_ADAPTER_LABEL = "other"  # adapters outside the top-K by traffic
OTHER_TENANT_LABEL = "other"  # tenants outside the top-K (frontend/tenants.py's OTHER)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdapterTraffic:
    """Requests per adapter, exposed with bounded cardinality: the top-K names by traffic keep
    their own label, all others are summed under adapter="other".

    Membership is recomputed at each scrape, so when an adapter enters or leaves the top-K
    the "other" series can step down; Prometheus' rate() treats that as a counter reset.
    """

    def __init__(self, top_k: int) -> None:
        self.top_k = max(0, top_k)
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, adapter: str | None) -> None:
        name = adapter or BASE_ADAPTER_LABEL
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        top = dict(ranked[: self.top_k])
        rest = sum(n for _, n in ranked[self.top_k :])
        if rest:
            top[OTHER_ADAPTER_LABEL] = top.get(OTHER_ADAPTER_LABEL, 0) + rest
        return top


class PrometheusMetrics:
    """The MetricsSink backed by Prometheus counters and histograms in `registry`."""

    def __init__(self, registry: CollectorRegistry, adapter_top_k: int = 20) -> None:
        self.registry = registry
        self.lora_loads = Counter(
            "loraplex_lora_loads_total",
            "Adapter loads into a device slot, by the tier the bytes came from.",
            ["tier"],
            registry=registry,
        )
        self.lora_evictions = Counter(
            "loraplex_lora_evictions_total", "Adapters evicted from a device slot.", registry=registry
        )
        self.lora_load_seconds = Histogram(
            "loraplex_lora_load_seconds",
            "Time from load start until the adapter is usable in its slot, by tier.",
            ["tier"],
            buckets=_LOAD_BUCKETS,
            registry=registry,
        )
        for tier in LOAD_TIERS:  # every tier's series exists from the start (rate() needs a zero)
            self.lora_loads.labels(tier)
            self.lora_load_seconds.labels(tier)
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "loraplex_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens_total", "Prompt tokens processed (prefill).", registry=registry
        )
        self.generation_tokens = Counter(
            "loraplex_generation_tokens_total", "Tokens generated.", registry=registry
        )
        self.requests_finished = Counter(
            "loraplex_requests_finished_total",
            "Requests that left the engine, by finish reason.",
            ["finish_reason"],
            registry=registry,
        )
        self.grpc_requests = Counter(
            "loraplex_grpc_requests_total",
            "gRPC calls handled, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        # Series that exist from the start, at 0: rate() then sees the first occurrence too.
        for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED",
                     "UNAVAILABLE", "INTERNAL"):
            self.grpc_requests.labels("Generate", code)
        for reason in ("length", "stop", "eos", "cancelled", "deadline", "error"):
            self.requests_finished.labels(reason)
        self.adapter_traffic = AdapterTraffic(adapter_top_k)
        registry.register(_AdapterTrafficCollector(self.adapter_traffic))

    # MetricsSink
    def adapter_loaded(self, tier: str, seconds: float) -> None:
        self.lora_loads.labels(tier).inc()
        self.lora_load_seconds.labels(tier).observe(seconds)

    def adapter_evicted(self) -> None:
        self.lora_evictions.inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)

    def request_finished(self, finish_reason: str, adapter: str | None) -> None:
        self.requests_finished.labels(finish_reason).inc()
        self.adapter_traffic.add(adapter)

    # server side
    def grpc_request(self, method: str, code: str) -> None:
        self.grpc_requests.labels(method, code).inc()


class _AdapterTrafficCollector(Collector):
    def __init__(self, traffic: AdapterTraffic) -> None:
        self._traffic = traffic

    def collect(self) -> Iterable[Any]:
        family = CounterMetricFamily(
            "loraplex_adapter_requests",
            "Finished requests per adapter (top-K adapters by traffic; the rest as adapter=\"other\").",
            labels=["adapter"],
        )
        for name, count in self._traffic.snapshot().items():
            family.add_metric([name], count)
        yield family


class EngineCollector(Collector):
    """Gauges read from `stats()` (an EngineStats) at scrape time. `tenant_top_k`: tenants with a
    label of their own in the per-tenant pool gauge (the rest summed as `other`)."""

    def __init__(self, stats: Callable[[], Any], tenant_top_k: int = 10) -> None:
        self._stats = stats
        self.tenant_top_k = max(0, tenant_top_k)

    def collect(self) -> Iterable[Any]:
        s = self._stats()
        yield _gauge("loraplex_lora_slots_total", "Device LoRA slots.", s.slots_total)
        yield _gauge("loraplex_lora_slots_occupied", "Slots holding an adapter.", s.slots_occupied)
        yield _gauge(
            "loraplex_lora_slots_referenced",
            "Slots whose adapter a queued or running request needs.",
            s.slots_referenced,
        )
        yield _gauge("loraplex_lora_slots_pinned", "Slots holding a pinned adapter.", s.slots_pinned)
        # The slot gauges see a reference only on an adapter in a slot; this one also sees those on
        # adapters still staging, loading or failed: the leak check "zero references" reads it.
        yield _gauge(
            "loraplex_lora_adapter_references",
            "Request references held on adapter versions (queued and running requests), in a slot or not.",
            s.adapter_references,
        )
        yield _gauge(
            "loraplex_lora_pending_load_events",
            "Host-to-slot adapter copies in flight.",
            s.pending_load_events,
        )
        pool = GaugeMetricFamily(
            "loraplex_lora_pool_bytes", "Device bytes of the adapter pool's pages, used and free.", labels=["state"]
        )
        pool.add_metric(["used"], s.lora_pool_bytes_used)
        pool.add_metric(["free"], s.lora_pool_bytes_total - s.lora_pool_bytes_used)
        yield pool
        resident = GaugeMetricFamily(
            "loraplex_lora_pool_adapters", "Adapters in the pool (or being copied in), by rank.", labels=["rank"]
        )
        for rank, count in s.lora_resident_by_rank:
            resident.add_metric([str(rank)], count)
        yield resident
        evictions = CounterMetricFamily(
            "loraplex_lora_pool_evictions",
            "Adapters that left the pool, by cause: capacity (least recently used, to make room), drained "
            "(unloaded or replaced version), failed (its copy failed).",
            labels=["cause"],
        )
        for cause, count in s.lora_evictions_by_cause:
            evictions.add_metric([cause], count)
        yield evictions
        yield self._pool_by_tenant(s.lora_pool_bytes_by_owner)
        preemptions = CounterMetricFamily(
            "loraplex_preemptions",
            "Running requests preempted by recompute, by cause: kv_cache (no KV memory to grow), priority (for a "
            "waiting request of higher priority), fair_share (for a tenant below its share of the batch).",
            labels=["cause"],
        )
        for cause, count in sorted({**dict.fromkeys(PREEMPTION_CAUSES, 0), **dict(s.preemptions_by_cause)}.items()):
            preemptions.add_metric([cause], count)
        yield preemptions
        yield _gauge("loraplex_requests_running", "Requests in the running batch.", s.requests_running)
        waiting = GaugeMetricFamily(
            "loraplex_requests_waiting", "Requests waiting, by what they wait for.", labels=["reason"]
        )
        for reason, n in sorted({**dict.fromkeys(WAIT_REASONS, 0), **s.requests_waiting}.items()):
            waiting.add_metric([reason], n)
        yield waiting
        yield _gauge(
            "loraplex_kv_cache_usage_ratio",
            "Fraction of KV cache blocks requests hold (0..1; prefix-cached blocks nobody holds are not counted).",
            s.kv_cache_usage,
        )
        blocks = GaugeMetricFamily(
            "loraplex_kv_cache_blocks",
            "KV cache blocks by state: held (by requests), cached (prefix cache, held by none, reusable until "
            "evicted), free.",
            labels=["state"],
        )
        blocks.add_metric(["held"], s.kv_blocks_used)
        blocks.add_metric(["cached"], s.kv_blocks_cached)
        blocks.add_metric(["free"], s.kv_blocks_total - s.kv_blocks_used - s.kv_blocks_cached)
        yield blocks
        for prefix in ("loraplex_", "vllm:"):
            yield CounterMetricFamily(f"{prefix}prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache at admission.",
                                      value=s.prefix_cache_queries)
            yield CounterMetricFamily(f"{prefix}prefix_cache_hits",
                                      "Of the tokens looked up, those found cached (not computed again).",
                                      value=s.prefix_cache_hits)
        # Router-compatible series, named and shaped as vLLM exports them.
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (vLLM-compatible; value is the last-update time).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [str(s.max_lora), ",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters)],
            s.updated_at,
        )
        yield info
        yield _gauge("vllm:num_requests_running", "Requests in the running batch.", s.requests_running)
        yield _gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", sum(s.requests_waiting.values())
        )
        yield _gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).", s.kv_cache_usage)


    def _pool_by_tenant(self, by_owner: Iterable[tuple[str, int]]) -> GaugeMetricFamily:
        """Bytes of the pool each tenant's resident adapters hold: at most one row per resident
        adapter come from the engine; the top-K tenants by bytes (then name) keep their label."""
        family = GaugeMetricFamily(
            "loraplex_tenant_adapter_pool_bytes",
            "Device bytes of the adapter pool held by a tenant's resident adapters (shared adapters are in "
            "loraplex_lora_pool_bytes only); the top-K tenants by bytes, the rest as tenant=\"other\".",
            labels=["tenant"],
        )
        ranked = sorted(by_owner, key=lambda row: (-row[1], row[0]))
        for tenant, nbytes in ranked[: self.tenant_top_k]:
            family.add_metric([tenant], nbytes)
        if len(ranked) > self.tenant_top_k:
            family.add_metric([OTHER_TENANT_LABEL], sum(nbytes for _, nbytes in ranked[self.tenant_top_k:]))
        return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def build_registry(adapter_top_k: int = 20) -> tuple[CollectorRegistry, PrometheusMetrics]:
    """A fresh registry holding the sink's counters/histograms. The engine needs the sink to be
    built, so its gauges join afterwards: `registry.register(EngineCollector(engine.stats))`."""
    registry = CollectorRegistry(auto_describe=False)
    return registry, PrometheusMetrics(registry, adapter_top_k=adapter_top_k)


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> Any:
    """Expose `registry` on http://addr:port/metrics; returns the server (shutdown() stops it).

    Always in the classic text format: prometheus_client's OpenMetrics output, which Prometheus
    negotiates by default, turns the ':' of vllm:* sample names into '_' (client_python#1177),
    and the router-compatible names must arrive intact."""
    app = make_wsgi_app(registry)

    def text_format_app(environ: dict, start_response: Callable) -> Any:
        return app({**environ, "HTTP_ACCEPT": "text/plain; version=0.0.4"}, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET

    server = make_server(addr, port, text_format_app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape otherwise
        pass
