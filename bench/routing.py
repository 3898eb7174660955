"""LoRA-affinity routing across real replicas vs round-robin, on a skewed multi-adapter workload.

Replicas: REPLICAS real `loraplex-inference` processes on loopback (builtin:tiny model, SLOTS LoRA
slots each, the OpenAI HTTP API on, one CPU thread each), every adapter registered on every replica
by LoadAdapter (no preload: slots fill on demand, the least recently used idle one is evicted).
Workload: Poisson arrivals of REQUESTS completions (streamed), the adapter of each drawn from a Zipf
law (exponent ZIPF_S) over ADAPTERS adapters, the same seeded sequence for every router. Each run of
a router gets fresh replicas; REPEATS rounds run every router once, every other round in reverse
order, so that no router always runs first or last while other work shares the machine.

Routers; all but round-robin read each replica's real /metrics on the serving port every 50 ms, as
the GIE endpoint picker (EPP) does (its --refresh-metrics-interval default):
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
- affinity (the RESULT): the same scorers, weights and picker, with two changes:
  * an adapter idle in a device slot (loraplex_lora_adapter_resident{tier="device"}, docs/metrics.md)
    scores as running (1.0). GIE sees only adapters that have requests: with requests shorter than
    the gaps between them, an adapter's slot looks empty again between its requests, most pods have
    "room" (0.8) and the pick is a tie, so a warm adapter is found again only by chance;
  * ties go to the adapter's rendezvous-hash (highest random weight) home among the tied pods, the
    rule NVIDIA Dynamo's LoRA router places adapters by (ai-dynamo/dynamo,
    lib/llm/src/lora/routing/hrw.rs), instead of a random one: every router instance picks alike
    without sharing state, and its picks do not depend on a random draw.
  The queue and KV scorers are kept: a pod with a longer queue loses a request for its adapter to
  another pod, which loads it, so a hot adapter spreads over several pods under load.
- gie+rendezvous, gie+residency (only with --routers): one change each.

Prints per run: adapter loads into slots (from loraplex_lora_loads_total), TTFT p50/p99, tokens/s
(the offered load when every router keeps up), requests per replica. Then per router over all
rounds: loads summed, TTFT p50/p99 as the median of the rounds' values (on a shared machine one
round's p99 can be set by a single stall of the host), and loads and p99 relative to round-robin.
Measured figures: docs/metrics.md.

    .venv/bin/python bench/routing.py [--replicas 5] [--slots 4] [--adapters 32] [--requests 400] \
        [--rate 20] [--max-tokens 32] [--repeats 3] [--routers round-robin,gie,affinity]

Last line: RESULT affinity_loads_vs_roundrobin=<ratio>   (target <= 0.5 with TTFT p99 no worse).
Capacity decides how low it can go: round-robin makes every replica's slots serve the whole Zipf
law, an affinity router lets each replica keep a different part of the hot set. 5 x 4 = 20 slots
for 32 adapters is the default; with 2 x 4 even a perfect split of the 8 hottest adapters misses on
~33% of requests at s=1 against ~64% for round-robin's LRU, a ratio of ~0.5 at best.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from harness.inference_server import InferenceServer, start_inference_server  # noqa: E402
from inference_service.client import InferenceClient  # noqa: E402
from inference_service.demo_adapters import write_peft_adapter  # noqa: E402

METRICS_REFRESH_S = 0.05  # the GIE EPP's default metrics refresh interval


@dataclass
class Replica:
    name: str  # stable across runs, as a pod name is: the rendezvous hash keys on it
    http: str
    server: InferenceServer | None
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


def rendezvous_rank(adapter: str, replicas: list[Replica]) -> list[Replica]:
    """The replicas in rendezvous (highest-random-weight) order for `adapter`: each (adapter, pod)
    pair hashes to a weight and the highest weight is the adapter's home. Deterministic, so every
    router instance agrees without coordination, and removing a pod moves only its own adapters."""
    def weight(r: Replica) -> bytes:
        return hashlib.blake2b(f"{adapter}\0{r.name}".encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


def affinity_router(replicas: list[Replica], rng: random.Random, residency: bool = False,
                    tie_break: str = "random") -> Callable[[str], Replica]:
    """GIE's scorers summed with equal weights, the max-score pod wins. `residency`: an adapter idle
    in a device slot (loraplex's residency gauge, docs/metrics.md) counts as active too; GIE itself
    cannot see it. `tie_break`: "random" as GIE's max-score picker, or "rendezvous": among the
    best-scored pods, the adapter's rendezvous-hash home first, so an adapter that is active nowhere
    keeps landing on the same pod instead of a random one."""
    def pick(adapter: str) -> Replica:
        q = queue_scores(replicas)
        totals = [lora_affinity_score(r, adapter, residency) + q[i] + (1.0 - r.kv) for i, r in enumerate(replicas)]
        best = [r for r, t in zip(replicas, totals, strict=True) if t == max(totals)]
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
    "affinity": lambda replicas, rng: affinity_router(replicas, rng, residency=True, tie_break="rendezvous"),
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


def start_replicas(args, adapters_dir: Path, log_dir: Path) -> list[Replica]:
    with ThreadPoolExecutor(args.replicas) as pool:  # side by side
        started = [pool.submit(start_replica, f"replica-{i}", args, adapters_dir, log_dir)
                   for i in range(args.replicas)]
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

    def line(self, name: str) -> str:
        return (f"{name:15s} adapter loads {self.loads:5.0f}   TTFT p50 {pct(self.ttft, 50) * 1e3:7.1f} ms  "
                f"p99 {pct(self.ttft, 99) * 1e3:7.1f} ms   {self.tokens / self.seconds:7.1f} tokens/s   "
                f"requests per replica {self.per_replica}")


async def run_policy(name: str, args, adapters_dir: Path, work: list[tuple[float, str]], log_dir: Path) -> Result:
    import httpx2 as httpx  # the HTTP client the openai SDK is built on

    replicas = start_replicas(args, adapters_dir, log_dir)
    try:
        loads0 = [refresh(r)["loads"] for r in replicas]
        pick = ROUTERS[name](replicas, random.Random(args.seed))
        sent = [0] * len(replicas)
        ttft: list[float] = []
        tokens = 0
        stop_scraping = asyncio.Event()

        async def scraper() -> None:  # the EPP's metrics refresh loop: every pod at once, as its collectors do
            while not stop_scraping.is_set():
                await asyncio.gather(*(asyncio.to_thread(refresh, r) for r in replicas))
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
    p.add_argument("--replicas", type=int, default=5)
    p.add_argument("--slots", type=int, default=4, help="LoRA slots per replica (--max-loras)")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second, all replicas together")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds over the routers, every other one in reverse order (fresh replicas every run)")
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
        for rnd in range(args.repeats):  # every other round in reverse order: each router runs early and late
            for name in routers if rnd % 2 == 0 else routers[::-1]:
                res = asyncio.run(run_policy(name, args, adapters_dir, work, root))
                assert res.tokens == args.requests * args.max_tokens, (name, res.tokens)
                runs[name].append(res)
                print(f"[round {rnd + 1}] {res.line(name)}", flush=True)
    # Loads add up over the rounds; a latency is the median of the rounds' values, so that one round
    # hit by a stall of this shared machine does not decide it.
    loads = {name: sum(r.loads for r in rs) for name, rs in runs.items()}
    p99 = {name: statistics.median(pct(r.ttft, 99) for r in rs) for name, rs in runs.items()}
    print(f"over {args.repeats} rounds (loads: total; TTFT: median of the rounds):")
    for name, rs in runs.items():
        p50 = statistics.median(pct(r.ttft, 50) for r in rs)
        tps = sum(r.tokens for r in rs) / sum(r.seconds for r in rs)
        print(f"{name:15s} adapter loads {loads[name]:5.0f}   TTFT p50 {p50 * 1e3:7.1f} ms  "
              f"p99 {p99[name] * 1e3:7.1f} ms   {tps:7.1f} tokens/s")
    for name in (n for n in routers if n != "round-robin"):
        ratio = p99[name] / p99["round-robin"]
        print(f"{name:15s} vs round-robin: adapter loads {loads[name] / max(loads['round-robin'], 1.0):.3f}, "
              f"TTFT p99 {ratio:.3f} ({'no worse' if ratio <= 1.0 else 'WORSE'})")
    print(f"RESULT affinity_loads_vs_roundrobin={loads['affinity'] / max(loads['round-robin'], 1.0):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
