"""Routing signals with exact semantics, scraped over HTTP from a real engine's /metrics.

vllm:lora_requests_info (GIE model server protocol, docs/metrics.md): running_lora_adapters = the
adapters of running requests; waiting_lora_adapters = adapters with queued requests that are not
running; max_lora = slots; value = the time the engine last updated the snapshot. Residency:
loraplex_lora_adapters_resident{tier} and the bounded loraplex_lora_adapter_resident{adapter, tier}.

A real EngineCore (builtin:tiny, 2 slots, one running request at a time) is stepped by the test, so
each point (running, waiting, resident in a slot, warm in host memory, evicted) is reached exactly;
its collectors are served by the real metrics HTTP server. A real server subprocess then checks the
same families are wired into the CLI's /metrics.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from harness.engine_helpers import load_adapters
from harness.ports import free_port
from harness.tools import require_tool
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.in_process import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.frontend.metrics import EngineCollector, build_registry, serve_metrics
from inference_service.frontend.residency import Residency, ResidencyCollector

INFO = "vllm:lora_requests_info"
COUNTS = "loraplex_lora_adapters_resident"
NAMED = "loraplex_lora_adapter_resident"
PARAMS = SamplingParams(max_new_tokens=40)
PROMPT = [1, 2, 3, 4]


class InlineEngine:
    """EngineClient.adapter_residency's contract for a core the test steps itself: between steps,
    so answered at once."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def adapter_residency(self) -> concurrent.futures.Future[Residency]:
        done: concurrent.futures.Future[Residency] = concurrent.futures.Future()
        done.set_result(self.core.adapter_residency())
        return done


class Scraper:
    def __init__(self, core: EngineCore, top_k: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or build_registry(adapter_top_k=top_k)[0]
        self.registry.register(EngineCollector(core.stats))
        self.registry.register(ResidencyCollector(InlineEngine(core), top_k))
        self.server = serve_metrics(self.registry, free_port())
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def text(self) -> str:
        return urllib.request.urlopen(self.url, timeout=10).read().decode()

    def families(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in text_string_to_metric_families(self.text()):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out


def info(fams: dict) -> tuple[dict[str, str], float]:
    (sample,) = fams[INFO]  # one series, never one per label set seen before
    return sample


def residency(fams: dict) -> tuple[dict[str, float], set[tuple[str, str, float]]]:
    counts = {labels["tier"]: v for labels, v in fams[COUNTS]}
    named = {(labels["adapter"], labels["tier"], v) for labels, v in fams.get(NAMED, [])}
    return counts, named


@pytest.fixture
def adapters(tmp_path: Path) -> dict[str, str]:
    for i, name in enumerate("abcd"):
        write_peft_adapter(tmp_path / name, rank=4, seed=40 + i)
    return {name: (tmp_path / name).as_uri() for name in "abcd"}


@pytest.fixture
def core_and_registry(adapters: dict[str, str]) -> Iterator[tuple[EngineCore, CollectorRegistry]]:
    """The core feeds the registry's counters (evictions...), as in the CLI."""
    registry, sink = build_registry(adapter_top_k=20)
    prefix = adapters["a"].rsplit("/", 1)[0] + "/"
    core = EngineCore(EngineConfig(model="builtin:tiny", device="cpu", dtype="float32", max_loras=2,
                                   max_num_seqs=1, adapter_source_allow=(prefix,)), metrics=sink)
    yield core, registry
    core.shutdown()


def step_until(core: EngineCore, done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"state not reached: {core.stats()}"
        core.step()
        time.sleep(0.001)  # staging and slot copies run on other threads


def test_running_waiting_resident_evicted_exact_labels(core_and_registry, adapters: dict[str, str]) -> None:
    core, registry = core_and_registry
    load_adapters(core, {"c": adapters["c"]})
    full, capped = Scraper(core, top_k=20, registry=registry), Scraper(core, top_k=1)
    try:
        # Registered only: no requests, nothing resident; max_lora is the slot count.
        t0 = time.time()
        fams = full.families()
        labels, value = info(fams)
        assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert t0 <= value <= time.time()  # the snapshot's update time, not a constant
        assert residency(fams) == ({"device": 0, "host": 0, "cache": 0}, set())

        # a and b preloaded into the two slots first: were b still loading when r1 ends, the scheduler
        # would run r3(a) before r2(b) (it does not wait on a cold adapter) and the evictions below
        # would differ (seen under load).
        load_adapters(core, {n: adapters[n] for n in "ab"}, preload=True)
        step_until(core, lambda: core.stats().slots_occupied == 2 and core.stats().pending_load_events == 0)
        # r1(a) runs; r2(b) and r3(a) queue behind it (one running request at a time). a has a
        # queued request too, but it is running: it is listed as running only (llm-d-router #2605).
        for rid, name in (("r1", "a"), ("r2", "b"), ("r3", "a")):
            core.add_request(Request(rid, PROMPT, PARAMS), name)
        step_until(core, lambda: core.stats().running_lora_adapters == ("a",))
        fams = full.families()
        assert info(fams)[0] == {"max_lora": "2", "running_lora_adapters": "a", "waiting_lora_adapters": "b"}
        assert residency(fams) == ({"device": 2, "host": 0, "cache": 0}, {("a", "device", 1), ("b", "device", 1)})

        # r4(c) queues: both slots are held by a and b (needed by requests), so c waits.
        core.add_request(Request("r4", PROMPT, PARAMS), "c")
        core.step()
        fams = full.families()
        assert info(fams)[0] == {"max_lora": "2", "running_lora_adapters": "a", "waiting_lora_adapters": "b,c"}

        # d is preloaded while no slot can be taken: its tensors wait, staged, in host memory.
        preload = core.lora.load_adapter("d", adapters["d"], preload=True)
        step_until(core, lambda: core.stats().pending_load_events == 0 and _host_ready(core, "d"))
        fams = full.families()
        assert residency(fams) == ({"device": 2, "host": 1, "cache": 0},
                                   {("a", "device", 1), ("b", "device", 1), ("d", "host", 1)})
        assert info(fams)[0]["waiting_lora_adapters"] == "b,c"  # residency does not leak into the router view

        # Everything finishes: d and then c took slots, evicting b (least recently used) then d,
        # which stay warm in the adapter cache.
        step_until(core, lambda: not core.has_work() and preload.done() and core.stats().pending_load_events == 0)
        fams = full.families()
        assert info(fams)[0] == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert residency(fams) == ({"device": 2, "host": 0, "cache": 2},
                                   {("a", "device", 1), ("c", "device", 1), ("b", "cache", 1), ("d", "cache", 1)})
        assert fams["loraplex_lora_evictions_total"] == [({}, 2.0)]
        # Bounded: with top-K 1, device adapters (at most the slot count) keep their names, the
        # rest of the warm ones are counted under adapter="other".
        assert residency(capped.families()) == (
            {"device": 2, "host": 0, "cache": 2},
            {("a", "device", 1), ("c", "device", 1), ("b", "cache", 1), ("other", "cache", 1)})
    finally:
        full.server.shutdown()
        capped.server.shutdown()


def _host_ready(core: EngineCore, name: str) -> bool:
    # registered by the manager's next drain
    return any(n == name and state.value == "HOST_READY" for n, state, _ in core.lora.residency())


# ':' is reserved for recording rules, but the vllm:* names are the router contract; and
# loraplex_lora_slots_total is a capacity, a gauge by meaning, with its name fixed by the spec.
ACCEPTED_LINT = {"should not contain ':'", 'non-counter metrics should not have "_total" suffix'}
FIXED_NAMES = {"vllm:lora_requests_info", "vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc", "loraplex_lora_slots_total",
               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}  # vLLM's names, as the issue asks


def test_real_server_exposes_routing_families_promtool_clean(inference_server_factory, adapters) -> None:
    promtool = require_tool("promtool")
    prefix = adapters["a"].rsplit("/", 1)[0] + "/"
    server = inference_server_factory("--model", "builtin:tiny", "--max-loras", "2", "--insecure-admin",
                                      "--adapter-source-allow", prefix)
    with InferenceClient(server.address) as client:
        client.load_adapter("a", adapters["a"], preload=True, timeout=60)
        client.load_adapter("b", adapters["b"], timeout=60)
        for _ in client.generate("hello", adapter="b", max_new_tokens=2, timeout=60):
            pass
    deadline = time.monotonic() + 30
    while server.value(NAMED, adapter="b", tier="device") != 1:
        assert time.monotonic() < deadline, server.scrape()
        time.sleep(0.1)
    samples = server.samples()
    assert samples[(NAMED, (("adapter", "a"), ("tier", "device")))] == 1
    assert samples[(COUNTS, (("tier", "device"),))] == 2
    (info_value,) = [v for (n, _), v in samples.items() if n == INFO]
    assert time.time() - 60 < info_value <= time.time()
    r = subprocess.run([promtool, "check", "metrics"], input=server.scrape().encode(), capture_output=True,
                       timeout=60)
    findings = [ln for ln in (r.stdout + r.stderr).decode().splitlines() if ln.strip()]
    unexpected = [ln for ln in findings
                  if not (ln.split()[0] in FIXED_NAMES and any(a in ln for a in ACCEPTED_LINT))]
    assert not unexpected, "\n".join(findings)
