"""LoRA-affinity routing across real replicas vs round-robin, on a skewed multi-adapter workload.

Replicas: REPLICAS real `loraplex-inference` processes on loopback (builtin:tiny model, SLOTS LoRA
slots each, the OpenAI HTTP API on, one CPU thread each), every adapter registered on every replica
by LoadAdapter (no preload: slots fill on demand). Workload: Poisson arrivals of REQUESTS
completions (streamed), the adapter of each drawn from a Zipf law (exponent ZIPF_S) over ADAPTERS
adapters, the same seeded sequence for both routers. Each router gets fresh replicas.

Routers:
- round-robin: replica i mod N.
- affinity: the Gateway API Inference Extension endpoint picker's scoring, re-implemented from its
  published source and protocol (kubernetes-sigs/gateway-api-inference-extension):
  * metrics per pod, refreshed every 50 ms as the EPP does (its --refresh-metrics-interval default)
    from each replica's real /metrics on the serving port: `vllm:lora_requests_info{max_lora,
    running_lora_adapters, waiting_lora_adapters}` (the newest series by value, as the model server
    protocol, docs/proposals/003-model-server-protocol, says), `vllm:num_requests_waiting`,
    `vllm:kv_cache_usage_perc`;
  * lora-affinity-scorer (pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go): 1.0 when
    the adapter is running on the pod; 0.8 when running + waiting adapters < max_lora; 0.6 when it is
    waiting there; else 0;
  * queue-scorer (scorer/queue.go): (max_q - q) / (max_q - min_q) over the candidates, 1 when equal;
  * kv-cache-utilization-scorer (scorer/kvcache_utilization.go): 1 - usage;
  * equal weights (1 each), summed; the max-score picker takes the best, ties broken at random.
  The llm-d scheduler composes the same scorers (llm-d-inference-scheduler, its default profile).

A third router, affinity+residency, is GIE's with one change: an adapter idle in a device slot
(loraplex_lora_adapter_resident{tier="device"}, docs/metrics.md) scores as active. GIE itself sees
only adapters with requests, so when requests are short and replicas are not saturated its picks
are mostly ties (every pod has "room"), broken at random: close to round-robin for slot loads.

Prints per router: adapter loads into slots (from loraplex_lora_loads_total), TTFT p50/p99, tokens/s.

    .venv/bin/python bench/routing.py [--replicas 2] [--slots 4] [--adapters 32] [--requests 400] [--rate 20]

Last line: RESULT affinity_loads_vs_roundrobin=<ratio>   (the GIE router; target <= 0.5 with TTFT p99
no worse). Bound: even a perfect static split of the 8 hottest adapters over 2 x 4 slots misses on
~33% of requests at Zipf s=1 over 32 (vs ~64% measured for round-robin LRU), a ratio of ~0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from inference_service.client import InferenceClient  # noqa: E402
from inference_service.demo_adapters import write_peft_adapter  # noqa: E402

METRICS_REFRESH_S = 0.05  # the GIE EPP's default metrics refresh interval


@dataclass
class Replica:
    http: str
    grpc: str
    proc: subprocess.Popen
    # The endpoint picker's view, refreshed by scrape().
    max_lora: int = 0
    running: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)
    queue: int = 0
    kv: float = 0.0
    resident: set[str] = field(default_factory=set)  # loraplex_lora_adapter_resident{tier="device"}

    def metrics_text(self) -> str:
        return urllib.request.urlopen(self.http + "/metrics", timeout=5).read().decode()


def parse_view(text: str) -> dict:
    """The EPP's metrics for one pod, from the Prometheus text."""
    view: dict = {"queue": 0, "kv": 0.0, "loads": 0.0, "resident": set()}
    newest = -1.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:lora_requests_info" and s.value > newest:  # the latest update wins
                newest = s.value
                view["max_lora"] = int(s.labels["max_lora"])
                view["running"] = {a for a in s.labels["running_lora_adapters"].split(",") if a}
                view["waiting"] = {a for a in s.labels["waiting_lora_adapters"].split(",") if a}
            elif s.name == "vllm:num_requests_waiting":
                view["queue"] = int(s.value)
            elif s.name == "vllm:kv_cache_usage_perc":
                view["kv"] = s.value
            elif s.name == "loraplex_lora_adapter_resident" and s.labels["tier"] == "device":
                view["resident"].add(s.labels["adapter"])
            elif s.name == "loraplex_lora_loads_total":
                view["loads"] += s.value
    return view


def refresh(replica: Replica) -> dict:
    view = parse_view(replica.metrics_text())
    replica.max_lora, replica.running, replica.waiting = view["max_lora"], view["running"], view["waiting"]
    replica.queue, replica.kv, replica.resident = view["queue"], view["kv"], view["resident"]
    return view


# ---- the routers ----------------------------------------------------------------------------------

def lora_affinity_score(r: Replica, adapter: str, residency: bool = False) -> float:
    if adapter in r.running or (residency and adapter in r.resident):
        return 1.0
    if len(r.running) + len(r.waiting) < r.max_lora:
        return 0.8
    if adapter in r.waiting:
        return 0.6
    return 0.0


def queue_scores(replicas: list[Replica]) -> list[float]:
    lo, hi = min(r.queue for r in replicas), max(r.queue for r in replicas)
    return [1.0 if hi == lo else (hi - r.queue) / (hi - lo) for r in replicas]


def affinity_router(replicas: list[Replica], rng: random.Random, residency: bool = False
                    ) -> Callable[[str], Replica]:
    """GIE's scorers; with `residency`, an adapter idle in a device slot (loraplex's residency
    gauge, docs/metrics.md) counts as active too: GIE itself cannot see it."""
    def pick(adapter: str) -> Replica:
        q = queue_scores(replicas)
        totals = [lora_affinity_score(r, adapter, residency) + q[i] + (1.0 - r.kv) for i, r in enumerate(replicas)]
        best = max(totals)
        return rng.choice([r for r, t in zip(replicas, totals, strict=True) if t == best])
    return pick


def round_robin_router(replicas: list[Replica]) -> Callable[[str], Replica]:
    cycle = itertools.cycle(replicas)
    return lambda adapter: next(cycle)


# ---- replicas -------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(args, allow: str, log_dir: Path) -> Replica:
    http_port, grpc_port = free_port(), free_port()
    log = open(log_dir / f"replica-{http_port}.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_service.cli", "--model", "builtin:tiny", "--device", args.device,
         "--dtype", "float32", "--listen", f"127.0.0.1:{grpc_port}", "--http-port", str(http_port),
         "--metrics-port", "0", "--max-loras", str(args.slots), "--adapter-source-allow", allow,
         "--log-level", "WARNING"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return Replica(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", proc)


def wait_healthy(r: Replica, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.proc.poll() is not None:
            raise RuntimeError(f"replica {r.http} exited with {r.proc.returncode}")
        try:
            if urllib.request.urlopen(r.http + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{r.http} not healthy after {timeout}s")


def stop(replicas: list[Replica]) -> None:
    for r in replicas:
        r.proc.terminate()
    for r in replicas:
        try:
            r.proc.wait(30)
        except subprocess.TimeoutExpired:
            r.proc.kill()


# ---- the workload ---------------------------------------------------------------------------------

def workload(args) -> list[tuple[float, str]]:
    """(arrival offset in s, adapter) per request: Poisson arrivals, Zipf-distributed adapters."""
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf_s for k in range(args.adapters)]
    names = [f"lora-{k:02d}" for k in range(args.adapters)]
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, rng.choices(names, weights)[0]))
    return out


@dataclass
class Result:
    ttft: list[float]
    tokens: int
    seconds: float
    loads: float
    per_replica: list[int]


async def run_policy(name: str, args, adapters_dir: Path, work: list[tuple[float, str]], log_dir: Path) -> Result:
    import httpx2 as httpx  # the HTTP client the openai SDK is built on

    allow = adapters_dir.as_uri() + "/"
    replicas = [start_replica(args, allow, log_dir) for _ in range(args.replicas)]
    try:
        for r in replicas:
            wait_healthy(r)
            with InferenceClient(r.grpc) as client:  # registered only: slots fill on demand
                for k in range(args.adapters):
                    client.load_adapter(f"lora-{k:02d}", (adapters_dir / f"lora-{k:02d}").as_uri(), timeout=60)
        loads0 = [refresh(r)["loads"] for r in replicas]
        pick = (round_robin_router(replicas) if name == "round-robin"
                else affinity_router(replicas, random.Random(args.seed), residency=name == "affinity+residency"))
        sent = [0] * len(replicas)
        ttft: list[float] = []
        tokens = 0
        stop_scraping = asyncio.Event()

        async def scraper() -> None:  # the EPP's metrics refresh loop, one pod after the other
            while not stop_scraping.is_set():
                for r in replicas:
                    await asyncio.to_thread(refresh, r)
                await asyncio.sleep(METRICS_REFRESH_S)

        async def one(client, offset: float, adapter: str, t0: float) -> None:
            nonlocal tokens
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            r = pick(adapter)
            sent[replicas.index(r)] += 1
            body = {"model": adapter, "prompt": "Route me to a warm adapter, please.", "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            start, first = time.perf_counter(), None
            async with client.stream("POST", r.http + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttft.append((first or time.perf_counter()) - start)

        scraping = asyncio.create_task(scraper())
        await asyncio.sleep(3 * METRICS_REFRESH_S)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(client, off, a, t0) for off, a in work))
            seconds = time.perf_counter() - t0
        stop_scraping.set()
        await scraping
        loads = sum(refresh(r)["loads"] - l0 for r, l0 in zip(replicas, loads0, strict=True))
        return Result(ttft, tokens, seconds, loads, sent)
    finally:
        stop(replicas)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--slots", type=int, default=4, help="LoRA slots per replica (--max-loras)")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second, all replicas together")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.replicas < 2:
        p.error("--replicas must be at least 2")
    with tempfile.TemporaryDirectory(prefix="loraplex-routing-") as tmp:
        root = Path(tmp)
        adapters_dir = root / "adapters"
        for k in range(args.adapters):
            write_peft_adapter(adapters_dir / f"lora-{k:02d}", rank=8, seed=1000 + k)
        work = workload(args)
        counts: dict[str, int] = {}
        for _, a in work:
            counts[a] = counts.get(a, 0) + 1
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
        print(f"workload: {args.requests} requests at {args.rate}/s over {len(counts)} of {args.adapters} adapters "
              f"(Zipf s={args.zipf_s}); top: {top}; {args.replicas} replicas x {args.slots} slots", flush=True)
        results = {}
        for name in ("round-robin", "affinity", "affinity+residency"):
            results[name] = asyncio.run(run_policy(name, args, adapters_dir, work, root))
            res = results[name]
            print(f"{name:18s} adapter loads {res.loads:5.0f}   TTFT p50 {pct(res.ttft, 50) * 1e3:7.1f} ms  "
                  f"p99 {pct(res.ttft, 99) * 1e3:7.1f} ms   {res.tokens / res.seconds:7.1f} tokens/s   "
                  f"requests per replica {res.per_replica}", flush=True)
    rr, aff, res = results["round-robin"], results["affinity"], results["affinity+residency"]
    assert rr.tokens == aff.tokens == res.tokens == args.requests * args.max_tokens, (rr.tokens, aff.tokens)
    print(f"affinity+residency: loads vs round-robin {res.loads / max(rr.loads, 1.0):.3f}, "
          f"TTFT p99 vs round-robin {pct(res.ttft, 99) / pct(rr.ttft, 99):.3f}")
    p99_ok = pct(aff.ttft, 99) <= pct(rr.ttft, 99)
    print(f"TTFT p99 affinity/round-robin = {pct(aff.ttft, 99) / pct(rr.ttft, 99):.3f} "
          f"({'no worse' if p99_ok else 'WORSE'})")
    print(f"RESULT affinity_loads_vs_roundrobin={aff.loads / max(rr.loads, 1.0):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
