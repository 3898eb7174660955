"""HTTP streaming overhead: tokens/s through the OpenAI-compatible HTTP API of the real server vs
the in-process Engine, same workload.

Workload: the serving benchmark's small model (LLaMA, hidden 256, 4 layers, 2 KV heads, vocab
32000, fp32, random weights), 32-token prompts given as token ids, 64 new tokens, greedy, EOS
ignored, CONCURRENCY streams at a time, TOTAL requests in all. The HTTP side streams SSE
(`stream: true`, usage in the last chunk) from a load generator in its own process; the
in-process side runs first and is shut down before the server starts, so the two never share
the CPUs. Small model on purpose: per-token front-end cost shows rather than hides behind compute.

    .venv/bin/python -m bench.http_overhead [--total 96] [--concurrency 32] [--max-new-tokens 64]

Last line: RESULT http_vs_inprocess_small_model=<ratio>   (target >= 0.8)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.bench import ROOT, SMALL_MODEL, bench_command, make_small_model, print_result, start_http_server

PROMPT_TOKENS = 32


def workload(total: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, SMALL_MODEL["vocab_size"]) for _ in range(PROMPT_TOKENS)] for _ in range(total)]


def run_inprocess(args, work: list[list[int]]) -> tuple[int, float]:
    from inference_service.engine.config import EngineConfig
    from inference_service.engine.in_process import Engine
    from inference_service.engine.request import SamplingParams

    engine = Engine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(64, args.concurrency),
                                 tokenizer="byte"))
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

        async def one(sem, prompt) -> int:
            async with sem:
                stream = engine.add_request(prompt, params)
                return sum([len(out.new_token_ids) async for out in stream])

        async def all_(items) -> int:
            sem = asyncio.Semaphore(args.concurrency)
            return sum(await asyncio.gather(*(one(sem, p) for p in items)))

        asyncio.run(all_(work[: args.concurrency]))  # warm-up
        t0 = time.perf_counter()
        tokens = asyncio.run(all_(work))
        return tokens, time.perf_counter() - t0
    finally:
        engine.shutdown()


def client_main(url: str, model: str, total: int, concurrency: int, max_new_tokens: int) -> None:
    """The load generator (its own process): SSE streams; prints {"tokens", "seconds"}."""
    import httpx2 as httpx  # the HTTP client the openai SDK is built on

    work = workload(total)

    async def one(client, sem, prompt) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with sem, client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            usage = None
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[len("data: "):])["usage"]
            return usage["completion_tokens"]

    async def all_(items) -> int:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            sem = asyncio.Semaphore(concurrency)
            return sum(await asyncio.gather(*(one(client, sem, p) for p in items)))

    asyncio.run(all_(work[:concurrency]))  # warm-up
    t0 = time.perf_counter()
    tokens = asyncio.run(all_(work))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - t0}), flush=True)



def run_http(args, log_dir: str) -> tuple[int, float]:
    server = start_http_server(
        ["--model", args.model, "--device", args.device, "--tokenizer", "byte", "--log-level", "WARNING",
         "--max-num-seqs", str(max(64, args.concurrency))],
        Path(log_dir) / "server.log", env={"OMP_NUM_THREADS": "1"})
    try:
        out = subprocess.run(
            bench_command("http_overhead", "--client", server.url, "--served-model", Path(args.model).name,
                          "--total", str(args.total), "--concurrency", str(args.concurrency),
                          "--max-new-tokens", str(args.max_new_tokens)),
            check=True, capture_output=True, text=True, timeout=1800, cwd=ROOT)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        # The client shares the machine with the server, so its own cost is included in the figure.
        return result["tokens"], result["seconds"]
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="checkpoint dir; default: the generated small model")
    p.add_argument("--total", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="runs per side; the best of each is compared")
    p.add_argument("--device", default="cpu", help="cpu | cuda (the server gets the same)")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the load generator against this URL
    p.add_argument("--served-model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args.client, args.served_model, args.total, args.concurrency, args.max_new_tokens)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            args.model = str(make_small_model(Path(tmp) / "small"))
        work = workload(args.total)
        inproc = max((run_inprocess(args, work) for _ in range(args.repeat)), key=lambda r: r[0] / r[1])
        remote = max((run_http(args, tmp) for _ in range(args.repeat)), key=lambda r: r[0] / r[1])
    in_tps, http_tps = inproc[0] / inproc[1], remote[0] / remote[1]
    assert inproc[0] == remote[0] == args.total * args.max_new_tokens, (inproc, remote)
    print(f"in-process:    {inproc[0]} tokens in {inproc[1]:.2f}s = {in_tps:.0f} tokens/s")
    print(f"HTTP (stream): {remote[0]} tokens in {remote[1]:.2f}s = {http_tps:.0f} tokens/s")
    print_result("http_vs_inprocess_small_model", http_tps / in_tps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
