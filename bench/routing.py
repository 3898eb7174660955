"""LoRA-affinity routing across real replicas vs round-robin, on a skewed multi-adapter workload.

Replicas: REPLICAS real `loraplex-inference` processes per router on loopback (builtin:tiny model,
SLOTS LoRA slots each, the OpenAI HTTP API on, one CPU thread each), every adapter registered on
every replica by LoadAdapter (no preload: slots fill on demand, the least recently used idle one is
evicted). Workload: Poisson arrivals of REQUESTS streamed completions at RATE per second, the
adapter of each drawn from a Zipf law (exponent ZIPF_S) over ADAPTERS adapters, one seeded sequence.
The routers run side by side, each on its own fresh replicas and on the same arrival times: a stall
of this shared host hits them all alike, where one router after the other would each draw their own
(single-round TTFT p99 here ranges 50-2000 ms with other work on the machine). REPEATS rounds.

Routers; each replica's real /metrics on the serving port is read every 50 ms, as the GIE endpoint
picker (EPP) does (its --refresh-metrics-interval default, one refresh loop per pod,
pkg/epp/backend/metrics/pod_metrics.go), round-robin's too though it uses none of it:
- round-robin: replica i mod N.
- gie: the Gateway API Inference Extension EPP's scoring, re-implemented from its published source
  and protocol (kubernetes-sigs/gateway-api-inference-extension):
  * per pod: `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` (the
    newest series by value, as the model server protocol, docs/proposals/003-model-server-protocol,
    says), `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`;
  * lora-affinity-scorer (pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go): 1.0 when
    the adapter is running on the pod; 0.8 when running + waiting adapters < max_lora; 0.6 when it is
    waiting there; else 0;
  * queue-scorer (scorer/queue.go): (max_q - q) / (max_q - min_q) over the candidates, 1 when equal;
  * kv-cache-utilization-scorer (scorer/kvcache_utilization.go): 1 - usage;
  * equal weights (1 each, what a scheduling profile gives a plugin that names no weight), summed;
    the max-score picker (picker/max_score_picker.go) takes the best, ties broken at random.
  The llm-d scheduler composes the same scorers (llm-d-inference-scheduler, its default profile).
- affinity (the RESULT): the same scorers, weights and picker, with three changes:
  * an adapter idle in a device slot (loraplex_lora_adapter_resident{tier="device"}, docs/metrics.md)
    scores as running (1.0). GIE sees only adapters that have requests: with requests shorter than
    the gaps between them, an adapter's slot looks empty again between its requests, most pods have
    "room" (0.8) and the pick is a tie, so a warm adapter is found again only by chance;
  * ties go to the adapter's rendezvous-hash (highest random weight) home among the tied pods, the
    rule NVIDIA Dynamo's LoRA router places adapters by (ai-dynamo/dynamo,
    lib/llm/src/lora/routing/hrw.rs), instead of a random one: every router instance picks alike
    without sharing state;
  * a bounded-load filter before scoring (consistent hashing with bounded loads, Mirrokni, Thorup,
    Zadimoghaddam, SODA 2018): a pod is a candidate while its in-flight requests, counted by the
    router as llm-d's active-request-scorer counts them, are under max(2, ceil(1.25 * mean)). Without
    it the replica holding the hottest adapter (a quarter of the traffic) takes ~40% of requests,
    and its bursts set the TTFT tail (`affinity-unbounded`: loads 0.31-0.38 of round-robin's, TTFT
    p99 1.24x the bounded router's side by side); with it a hot adapter spills to a second pod in a
    burst and stays warm there.
  The queue and KV scorers are kept: a pod with a longer queue loses requests to another pod.
- gie+rendezvous, gie+residency, affinity-unbounded (only with --routers): part of the changes.

Prints per router and round: adapter loads into slots (from loraplex_lora_loads_total), TTFT p50/p99
(client side, to the first streamed token), tokens/s (the offered load when a router keeps up),
requests per replica; then the same over all rounds and each router's loads and TTFT p99 relative to
round-robin. Measured figures: docs/metrics.md.

    .venv/bin/python -m bench.routing [--replicas 5] [--slots 4] [--adapters 32] [--requests 400] \
        [--rate 5] [--max-tokens 32] [--repeats 2] [--routers round-robin,gie,affinity]

Last line: RESULT affinity_loads_vs_roundrobin=<ratio>   (target <= 0.5 with TTFT p99 no worse).
Both halves are printed, each saying whether it held; if either failed there is no RESULT (the
line says which half failed) and the exit status is 1.
Capacity decides how low it can go: round-robin makes every replica's slots serve the whole Zipf
law, an affinity router lets each replica keep a different part of the hot set. 5 x 4 = 20 slots
for 32 adapters is the default; with 2 x 4 even a perfect split of the 8 hottest adapters misses on
~33% of requests at s=1 against ~64% for round-robin's LRU, a ratio of ~0.5 at best.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import itertools
import math
import operator
import random
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.bench import percentile, print_result
from harness.http_streams import sse_events
from harness.inference_server import InferenceServer, start_inference_server
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

# The affinity router's load bound: factor 1.25 (as Vimeo ran bounded-load hashing in HAProxy, and
# brpc's c_murmurhash_bl default) and a floor of two in flight: at this load the mean is under one,
# and ceil(1.25 * mean) = 1 would refuse a pod a second request whenever another pod is idle.
LOAD_BOUND = (1.25, 2)
METRICS_REFRESH_S = 0.05  # the GIE EPP's default metrics refresh interval


@dataclass
class Replica:
    name: str  # stable across runs, as a pod name is: the rendezvous hash keys on it
    http: str
    server: InferenceServer | None
    # The endpoint picker's view, refreshed by refresh().
    max_lora: int = 0
    running: set[str] = field(default_factory=set)
    waiting: set[str] = field(default_factory=set)
    queue: int = 0
    kv: float = 0.0
    resident: set[str] = field(default_factory=set)  # loraplex_lora_adapter_resident{tier="device"}
    in_flight: int = 0  # requests the router sent here that have not finished (its own count)

    def metrics_text(self) -> str:
        return urllib.request.urlopen(self.http + "/metrics", timeout=5).read().decode()


READ = ("vllm:lora_requests_info", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "loraplex_lora_adapter_resident", "loraplex_lora_loads_total")


def parse_view(text: str) -> dict:
    """The EPP's metrics for one pod, from the Prometheus text. Only the families read are parsed:
    Python's parser is slow, and the bench's CPU is the replicas' CPU here."""
    view: dict = {"queue": 0, "kv": 0.0, "loads": 0.0, "resident": set()}
    newest = -1.0
    wanted = "\n".join(line for line in text.splitlines()
                       if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(READ))
    for fam in text_string_to_metric_families(wanted + "\n"):
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


def rendezvous_rank(adapter: str, replicas: list[Replica]) -> list[Replica]:
    """The replicas in rendezvous (highest-random-weight) order for `adapter`: each (adapter, pod)
    pair hashes to a weight and the highest weight is the adapter's home. Deterministic, so every
    router instance agrees without coordination, and removing a pod moves only its own adapters."""
    def weight(r: Replica) -> bytes:
        return hashlib.blake2b(f"{adapter}\0{r.name}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


def within_load_bound(replicas: list[Replica], factor: float, floor: int) -> list[Replica]:
    """The pods that may take one more request under consistent hashing with bounded loads
    (Mirrokni, Thorup, Zadimoghaddam, SODA 2018): fewer than max(floor, ceil(factor * mean)) in flight,
    the mean counting the new request."""
    bound = max(floor, math.ceil(factor * (sum(r.in_flight for r in replicas) + 1) / len(replicas)))
    return [r for r in replicas if r.in_flight < bound]


def affinity_router(replicas: list[Replica], rng: random.Random, residency: bool = False,
                    tie_break: str = "random", load_bound: tuple[float, int] | None = None) -> Callable[[str], Replica]:
    """GIE's scorers summed with equal weights, the max-score pod wins. `residency`: an adapter idle
    in a device slot (loraplex's residency gauge, docs/metrics.md) counts as active too; GIE itself
    cannot see it. `tie_break`: "random" as GIE's max-score picker, or "rendezvous": among the
    best-scored pods, the adapter's rendezvous-hash home first, so an adapter that is active nowhere
    keeps landing on the same pod instead of a random one. `load_bound` (factor, floor): only pods
    within_load_bound are scored, as a GIE filter plugin runs before its scorers."""
    def pick(adapter: str) -> Replica:
        candidates = within_load_bound(replicas, *load_bound) if load_bound else replicas
        q = queue_scores(candidates)
        totals = [lora_affinity_score(r, adapter, residency) + q[i] + (1.0 - r.kv) for i, r in enumerate(candidates)]
        best = [r for r, t in zip(candidates, totals, strict=True) if t == max(totals)]
        return rendezvous_rank(adapter, best)[0] if tie_break == "rendezvous" else rng.choice(best)
    return pick


def round_robin_router(replicas: list[Replica]) -> Callable[[str], Replica]:
    cycle = itertools.cycle(replicas)
    return lambda adapter: next(cycle)


ROUTERS: dict[str, Callable[[list[Replica], random.Random], Callable[[str], Replica]]] = {
    "round-robin": lambda replicas, rng: round_robin_router(replicas),
    "gie": lambda replicas, rng: affinity_router(replicas, rng),
    "gie+rendezvous": lambda replicas, rng: affinity_router(replicas, rng, tie_break="rendezvous"),
    "gie+residency": lambda replicas, rng: affinity_router(replicas, rng, residency=True),
    "affinity": lambda replicas, rng: affinity_router(replicas, rng, residency=True, tie_break="rendezvous",
                                                      load_bound=LOAD_BOUND),
    "affinity-unbounded": lambda replicas, rng: affinity_router(replicas, rng, residency=True, tie_break="rendezvous"),
}


# ---- replicas -------------------------------------------------------------------------------------

def start_replica(name: str, args, adapters_dir: Path, log_dir: Path) -> Replica:
    """A real server (the harness waits until its gRPC health says SERVING; the HTTP API is up then)
    with every adapter registered, none loaded: slots fill on demand."""
    server_args = ["--model", "builtin:tiny", "--device", args.device, "--dtype", "float32", "--max-loras",
                   str(args.slots), "--adapter-source-allow", adapters_dir.as_uri() + "/", "--log-level", "WARNING"]
    for attempt in range(3):
        try:
            server = start_inference_server(server_args, log_dir=log_dir, timeout=180, http=True)
            break
        except RuntimeError as e:  # a port picked free was taken before the server bound it: pick again
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    try:
        with InferenceClient(server.address) as client:
            for k in range(args.adapters):
                client.load_adapter(f"lora-{k:02d}", (adapters_dir / f"lora-{k:02d}").as_uri(), timeout=60)
    except BaseException:
        server.stop()
        raise
    return Replica(name, server.http_url, server)


def start_replicas(names: list[str], args, adapters_dir: Path, log_dir: Path) -> list[Replica]:
    with ThreadPoolExecutor(len(names)) as pool:  # side by side
        started = [pool.submit(start_replica, name, args, adapters_dir, log_dir) for name in names]
    try:
        return [f.result() for f in started]
    except Exception:
        stop([f.result() for f in started if f.exception() is None])
        raise


def stop(replicas: list[Replica]) -> None:
    with ThreadPoolExecutor(len(replicas) or 1) as pool:
        list(pool.map(lambda r: r.server.stop(), replicas))


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

    def __add__(self, other: Result) -> Result:
        per_replica = [a + b for a, b in zip(self.per_replica, other.per_replica, strict=True)]
        return Result(self.ttft + other.ttft, self.tokens + other.tokens, self.seconds + other.seconds,
                      self.loads + other.loads, per_replica)

    def line(self, name: str) -> str:
        return (f"{name:15s} adapter loads {self.loads:5.0f}   TTFT p50 {percentile(self.ttft, 0.5) * 1e3:7.1f} ms  "
                f"p99 {percentile(self.ttft, 0.99) * 1e3:7.1f} ms   {self.tokens / self.seconds:7.1f} tokens/s   "
                f"requests per replica {self.per_replica}")


async def drive(name: str, replicas: list[Replica], args, work: list[tuple[float, str]], t0: float) -> Result:
    """One router over its replicas: the workload's requests at t0 + their offsets."""
    import httpx2 as httpx  # the HTTP client the openai SDK is built on

    loads0 = [v["loads"] for v in await asyncio.gather(*(asyncio.to_thread(refresh, r) for r in replicas))]
    pick = ROUTERS[name](replicas, random.Random(args.seed))
    sent = [0] * len(replicas)
    ttft: list[float] = []
    tokens = 0
    stop_scraping = asyncio.Event()

    async def scraper() -> None:  # the EPP's metrics refresh loops: every pod on its own, 50 ms apart
        while not stop_scraping.is_set():
            await asyncio.gather(*(asyncio.to_thread(refresh, r) for r in replicas))
            await asyncio.sleep(METRICS_REFRESH_S)

    async def one(client, offset: float, adapter: str) -> None:
        nonlocal tokens
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        r = pick(adapter)
        sent[replicas.index(r)] += 1
        body = {"model": adapter, "prompt": "Route me to a warm adapter, please.", "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start, first = time.perf_counter(), None
        r.in_flight += 1
        try:
            async with client.stream("POST", r.http + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for chunk in sse_events(resp):
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
        finally:
            r.in_flight -= 1
        ttft.append((first or time.perf_counter()) - start)

    # Round-robin reads nothing but is scraped alike: a scrape costs a replica CPU (and the residency
    # snapshot a turn of its scheduler thread), and what is compared is the routing.
    scraping = asyncio.create_task(scraper())
    # Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them under a request.
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, off, a) for off, a in work))
        seconds = time.perf_counter() - t0
    stop_scraping.set()
    await scraping
    ends = await asyncio.gather(*(asyncio.to_thread(refresh, r) for r in replicas))
    return Result(ttft, tokens, seconds, sum(v["loads"] for v in ends) - sum(loads0), sent)


def run_round(routers: list[str], args, adapters_dir: Path, work: list[tuple[float, str]], log_dir: Path
              ) -> dict[str, Result]:
    """Every router on its own fresh replicas, all at once on the same arrival times: a stall of the
    shared host hits them alike, where one router after the other would each draw their own."""
    replicas = start_replicas([f"replica-{i}" for _ in routers for i in range(args.replicas)], args, adapters_dir,
                              log_dir)
    sets = [replicas[k * args.replicas:(k + 1) * args.replicas] for k in range(len(routers))]

    async def all_routers() -> list[Result]:
        t0 = time.perf_counter() + 0.5  # the first metrics are in by then
        return await asyncio.gather(*(drive(name, rs, args, work, t0) for name, rs in zip(routers, sets, strict=True)))

    try:
        return dict(zip(routers, asyncio.run(all_routers()), strict=True))
    finally:
        stop(replicas)


LOADS_TARGET = 0.5  # affinity's adapter loads over round-robin's


def halves(loads_ratio: float, ttft_p99_ratio: float) -> list[tuple[str, bool]]:
    """The two halves of the claim (fewer loads, and TTFT p99 no worse for it), each as the line
    that states it and whether it held."""
    return [(f"adapter loads {loads_ratio:.3f} of round-robin's (target <= {LOADS_TARGET})",
             loads_ratio <= LOADS_TARGET),
            (f"TTFT p99 {ttft_p99_ratio:.3f} of round-robin's (target <= 1.0: no worse)", ttft_p99_ratio <= 1.0)]


def report(total: dict[str, Result], routers: list[str]) -> int:
    """Every router against round-robin, then affinity's two halves; the RESULT only if both held."""
    rr = total["round-robin"]
    for name in (n for n in routers if n != "round-robin"):
        ratio = percentile(total[name].ttft, 0.99) / percentile(rr.ttft, 0.99)
        print(f"{name:15s} vs round-robin: adapter loads {total[name].loads / max(rr.loads, 1.0):.3f}, "
              f"TTFT p99 {ratio:.3f} ({'no worse' if ratio <= 1.0 else 'WORSE'})")
    loads = total["affinity"].loads / max(rr.loads, 1.0)
    checks = halves(loads, percentile(total["affinity"].ttft, 0.99) / percentile(rr.ttft, 0.99))
    for line, held in checks:
        print(f"affinity: {line}: {'held' if held else 'FAILED'}")
    failed = [line for line, held in checks if not held]
    if failed:
        print("no RESULT: affinity failed " + "; ".join(failed))
        return 1
    print_result("affinity_loads_vs_roundrobin", loads)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=5, help="replicas per router (each router gets its own)")
    p.add_argument("--slots", type=int, default=4, help="LoRA slots per replica (--max-loras)")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=5.0, help="Poisson arrivals per second, per router")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=2, help="rounds, each on fresh replicas")
    p.add_argument("--routers", default="round-robin,gie,affinity",
                   help=f"comma-separated, from {', '.join(ROUTERS)}; round-robin and affinity are required")
    args = p.parse_args()
    if args.replicas < 2 or args.repeats < 1:
        p.error("--replicas must be at least 2, --repeats at least 1")
    routers = args.routers.split(",")
    if not {"round-robin", "affinity"} <= set(routers) <= set(ROUTERS):
        p.error(f"--routers: round-robin and affinity, plus any of {', '.join(ROUTERS)}")
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
        runs: dict[str, list[Result]] = {name: [] for name in routers}
        for rnd in range(args.repeats):
            for name, res in run_round(routers, args, adapters_dir, work, root).items():
                assert res.tokens == args.requests * args.max_tokens, (name, res.tokens)
                runs[name].append(res)
                print(f"[round {rnd + 1}] {res.line(name)}", flush=True)
    # All rounds together: loads summed, latencies over every request.
    total = {name: functools.reduce(operator.add, rs) for name, rs in runs.items()}
    print(f"all {args.repeats} rounds:")
    for name, res in total.items():
        print(res.line(name))
    return report(total, routers)


if __name__ == "__main__":
    sys.exit(main())
