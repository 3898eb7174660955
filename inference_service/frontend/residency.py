"""Where each adapter's weights are: in a device slot, warm in host memory, or warm in the
adapter cache (sidecar / local source cache), exported as bounded Prometheus gauges.

Routers (GIE/llm-d LoRA affinity) only see adapters that have requests (vllm:lora_requests_info);
these gauges add the adapters that are resident without traffic, the cheap places to send the
next request for them (vLLM #45325, #54830). Computed on the scheduler thread, which owns the
adapter registry, when Prometheus scrapes (O(registered) per scrape, never per step):
EngineCore.adapter_residency, through the engine's EngineClient.adapter_residency.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterable
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from adapter_cache.errors import LoraplexError
from inference_service.engine.types import Residency

log = logging.getLogger(__name__)

TIERS = ("device", "host", "cache")
OTHER_ADAPTER_LABEL = "other"
SCRAPE_WAIT_S = 2.0  # a scrape waits this long for the scheduler thread, then shows the last snapshot


class _Engine(Protocol):
    """The part of engine.client.EngineClient this collector uses (tests pass a core they step)."""

    def adapter_residency(self) -> concurrent.futures.Future[Residency]: ...


class ResidencyCollector(Collector):
    """loraplex_lora_adapters_resident{tier}: how many adapters per tier (exact);
    loraplex_lora_adapter_resident{adapter, tier} = 1 per named adapter: every device-slot adapter
    (at most the slot count), then host and cache adapters up to `top_k` by name; the rest are
    summed into adapter="other" per tier, so label cardinality stays <= slots + top_k + 2."""

    def __init__(self, engine: _Engine, top_k: int) -> None:
        self._engine = engine
        self._top_k = max(0, top_k)
        self._last = Residency()
        self._lock = threading.Lock()

    def snapshot(self) -> Residency:
        done = self._engine.adapter_residency()
        try:
            now = done.result(timeout=SCRAPE_WAIT_S)
        except (concurrent.futures.TimeoutError, LoraplexError) as e:
            log.warning("no residency from the scheduler (%s): metrics show the previous snapshot",
                        type(e).__name__)
            now = None
        with self._lock:
            if now is not None:
                self._last = now
            return self._last

    def collect(self) -> Iterable[GaugeMetricFamily]:
        r = self.snapshot()
        counts = GaugeMetricFamily(
            "loraplex_lora_adapters_resident",
            "Adapters by where their weights are: device (in a slot), host (staged in host memory), "
            "cache (evicted, still in the adapter cache).",
            labels=["tier"],
        )
        for tier in TIERS:
            counts.add_metric([tier], len(getattr(r, tier)))
        yield counts
        named = GaugeMetricFamily(
            "loraplex_lora_adapter_resident",
            "1 per adapter and tier it is resident in: every device adapter, host and cache ones up to "
            "the top-K by name; adapter=\"other\" counts the rest of a tier.",
            labels=["adapter", "tier"],
        )
        for name in r.device:
            named.add_metric([name, "device"], 1)
        budget = self._top_k
        for tier in ("host", "cache"):
            names = getattr(r, tier)
            shown, rest = names[:budget], names[budget:]
            budget -= len(shown)
            for name in shown:
                named.add_metric([name, tier], 1)
            if rest:
                named.add_metric([OTHER_ADAPTER_LABEL, tier], len(rest))
        yield named
