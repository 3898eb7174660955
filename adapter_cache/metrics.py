"""The sidecar's Prometheus series, on a registry of their own (tests start many sidecars)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class CacheMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bytes = Gauge("loraplex_cache_bytes", "Bytes staged or reserved for fetches in flight", registry=r)
        self.capacity = Gauge("loraplex_cache_capacity_bytes", "Byte budget of the host cache", registry=r)
        self.entries = Gauge("loraplex_cache_entries", "Staged adapters", registry=r)
        self.leases = Gauge("loraplex_cache_leases", "Live leases", registry=r)
        self.hits = Counter("loraplex_cache_hits", "Stage calls served from the cache", registry=r)
        self.misses = Counter("loraplex_cache_misses", "Stage calls that fetched", registry=r)
        self.stage_seconds = Histogram(
            "loraplex_cache_stage_seconds",
            "Stage latency",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.fetched_bytes = Counter("loraplex_cache_fetched_bytes", "Bytes read from object stores", registry=r)
        self.fetch_requests = Counter(
            "loraplex_cache_fetch_requests", "Object-store GET requests issued (retries included)", registry=r
        )
        self.inflight = Gauge("loraplex_cache_inflight_fetches", "Adapter fetches in progress", registry=r)
        self.followers = Gauge("loraplex_cache_stage_followers",
                               "Stage calls waiting on another call's fetch of the same adapter", registry=r)
        self.evictions = Counter("loraplex_cache_evictions", "Entries evicted", registry=r)
        self.errors = Counter("loraplex_cache_errors", "Failed calls by gRPC code", ["reason"], registry=r)
        # Series that exist from the start, at 0: rate() then sees the first error too.
        for reason in ("not_found", "invalid_argument", "permission_denied", "unavailable", "resource_exhausted",
                       "unauthenticated"):
            self.errors.labels(reason)

    def bind_state(self, used: Callable[[], float], entries: Callable[[], float], leases: Callable[[], float],
                   capacity: int) -> None:
        """Gauges read the cache at scrape time, so they cannot drift from it."""
        self.bytes.set_function(used)
        self.entries.set_function(entries)
        self.leases.set_function(leases)
        self.capacity.set(capacity)

    def on_request(self) -> None:
        self.fetch_requests.inc()

    def on_bytes(self, nbytes: int) -> None:
        self.fetched_bytes.inc(nbytes)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
