"""Prefix cache: multi-turn conversations through the real server (HTTP, streaming), cache on vs off.

Workload: a small LLaMA (hidden 256, 4 layers, 2 KV heads, vocab 384, fp32, random weights, byte
tokenizer), CONVERSATIONS concurrent conversations over several adapters and the base model, all
opening with the same system prompt (SYSTEM tokens), TURNS turns each: every turn resends the whole
history (the previous prompt, the assistant's text as the client got it, re-encoded, and a new
user message of 16-40 tokens) and streams MAX_NEW tokens back (greedy, EOS ignored, logprobs on so
every token is its own SSE chunk). TTFT is measured by the client from sending to the first chunk.
The random model's answers are kept to ASCII bytes (logit_bias -100 on ids 128 and up): a byte that
is not valid UTF-8 on its own reaches the client as U+FFFD and re-encodes to three other bytes, so
its answers never came back as the tokens the server cached (a real model's text round-trips).
Then a no-reuse workload: single-turn requests with unique random prompts, tokens/s.

The server runs twice in this one process tree, `--prefix-cache on` then `off`; the load generator
runs in its own process.

    .venv/bin/python bench/prefix_cache.py [--conversations 8] [--turns 6] [--system 300]

Last lines:
    RESULT prefix_cache_ttft_speedup=<TTFT p50 off / on over turns 3+>   (target >= 3)
    RESULT prefix_cache_no_reuse_tps_ratio=<tokens/s on / off, no reuse>  (target >= 0.97)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_overhead import make_small_model  # noqa: E402
from harness.ports import free_port, wait_http_healthy  # noqa: E402

SMALL_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=384, max_position_embeddings=4096)
ADMIN_TOKEN = "bench-admin"
ADAPTERS = ("ad0", "ad1", "ad2")


def _printable(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def client_main(args) -> None:
    """The load generator (its own process): prints one JSON line of per-turn TTFTs and throughput."""
    import httpx2 as httpx  # the HTTP client the openai SDK is built on

    models = [*ADAPTERS, args.served_model]  # adapters and the base model

    async def stream(client, model: str, prompt: list[int]) -> tuple[float, str, int, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_new_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
        if args.ascii_vocab:  # see the module docstring: the answer's text must re-encode to its tokens
            body["logit_bias"] = {str(i): -100 for i in range(128, args.ascii_vocab)}
        sent = time.perf_counter()
        ttft, text, usage = None, [], None
        async with client.stream("POST", args.client + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - sent
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    text.append(choice.get("text") or "")
        assert ttft is not None and usage is not None
        return ttft, "".join(text), usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    async def conversation(client, i: int, system: list[int]) -> list[tuple[float, int, int]]:
        rng = random.Random(1000 + i)
        model = models[i % len(models)]
        history = system + _printable(rng, rng.randrange(16, 40))
        turns = []
        for _ in range(args.turns):
            ttft, text, tokens, cached = await stream(client, model, history)
            turns.append((ttft, tokens, cached))
            history = history + list(text.encode()) + _printable(rng, rng.randrange(16, 40))
        return turns

    async def conversations() -> dict:
        system = _printable(random.Random(7), args.system)
        limits = httpx.Limits(max_connections=args.conversations, max_keepalive_connections=args.conversations)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(conversation(client, i, system) for i in range(args.conversations)))
            seconds = time.perf_counter() - t0
        return {"ttft": [[r[t][0] for r in results] for t in range(args.turns)],
                "cached": [[r[t][2] for r in results] for t in range(args.turns)],
                "tokens": sum(r[t][1] for r in results for t in range(args.turns)), "seconds": seconds}

    async def no_reuse() -> dict:
        rng = random.Random(99)
        prompts = [[rng.randrange(3, 256) for _ in range(args.no_reuse_prompt)] for _ in range(args.no_reuse_total)]
        limits = httpx.Limits(max_connections=args.conversations, max_keepalive_connections=args.conversations)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            sem = asyncio.Semaphore(args.conversations)

            async def one(i: int, prompt: list[int]) -> tuple[int, int]:
                async with sem:
                    _, _, tokens, cached = await stream(client, models[i % len(models)], prompt)
                    return tokens, cached

            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            seconds = time.perf_counter() - t0
        return {"tokens": sum(t for t, _ in done), "cached": sum(c for _, c in done), "seconds": seconds}

    warm_rng = random.Random(5)
    asyncio.run(_warm(httpx, args, models, warm_rng, stream))
    multi = asyncio.run(conversations())
    single = asyncio.run(no_reuse())
    print(json.dumps({"multi": multi, "no_reuse": single}), flush=True)


async def _warm(httpx, args, models, rng, stream) -> None:
    """One short request per model (loads the adapters into the pool, warms the kernels)."""
    async with httpx.AsyncClient(timeout=600) as client:
        for model in models:
            await stream(client, model, [rng.randrange(3, 256) for _ in range(8)])





def _load_adapter(url: str, name: str, path: Path) -> None:
    body = json.dumps({"lora_name": name, "lora_path": str(path)}).encode()
    request = urllib.request.Request(url + "/v1/load_lora_adapter", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200


def run_server(args, tmp: Path, prefix_cache: str) -> dict:
    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    with open(tmp / f"server-{prefix_cache}.log", "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "inference_service.cli", "--model", args.model, "--device", args.device,
             "--tokenizer", "byte", "--listen", f"127.0.0.1:{free_port()}", "--http-port", str(http_port),
             "--log-level", "WARNING", "--prefix-cache", prefix_cache, "--max-lora-rank", "16",
             "--adapter-source-allow", tmp.as_uri()],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        wait_http_healthy(url, server)
        for name in ADAPTERS:
            _load_adapter(url, name, tmp / name)
        out = subprocess.run(
            [sys.executable, __file__, "--client", url, "--served-model", Path(args.model).name,
             "--conversations", str(args.conversations), "--turns", str(args.turns), "--system", str(args.system),
             "--max-new-tokens", str(args.max_new_tokens), "--no-reuse-total", str(args.no_reuse_total),
             "--no-reuse-prompt", str(args.no_reuse_prompt),
             "--ascii-vocab", str(SMALL_MODEL["vocab_size"] if args.model == str(tmp / "small") else 0)],
            check=True, capture_output=True, text=True, timeout=1800)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(30)


def make_model_and_adapters(tmp: Path) -> Path:
    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.models.config import ModelConfig

    out = make_small_model(tmp / "small", SMALL_MODEL)
    model_config = ModelConfig.from_hf(json.loads((out / "config.json").read_text()))
    for i, name in enumerate(ADAPTERS):
        write_peft_adapter(tmp / name, model_config, rank=8 * (1 + i % 2), alpha=16.0, seed=i)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(name: str, result: dict, turns: int) -> float:
    multi = result["multi"]
    print(f"--- prefix cache {name}: {multi['tokens']} tokens in {multi['seconds']:.2f}s = "
          f"{multi['tokens'] / multi['seconds']:.0f} tokens/s (multi-turn)")
    for t in range(turns):
        ttfts = multi["ttft"][t]
        p50, p99 = 1000 * statistics.median(ttfts), 1000 * _pct(ttfts, 0.99)
        print(f"  turn {t + 1}: TTFT p50 {p50:7.1f} ms  p99 {p99:7.1f} ms"
              f"  cached prompt tokens (mean) {statistics.mean(multi['cached'][t]):6.1f}")
    late = [x for t in range(2, turns) for x in multi["ttft"][t]]
    nr = result["no_reuse"]
    print(f"  no reuse: {nr['tokens']} tokens in {nr['seconds']:.2f}s = {nr['tokens'] / nr['seconds']:.0f} tokens/s"
          f" (cached tokens {nr['cached']})")
    return statistics.median(late)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="checkpoint dir; default: the generated small model")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=300, help="tokens of the shared system prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--no-reuse-total", type=int, default=48)
    p.add_argument("--no-reuse-prompt", type=int, default=300)
    p.add_argument("--device", default="cpu", help="cpu | cuda (the server gets the same)")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the load generator against this URL
    p.add_argument("--served-model", help=argparse.SUPPRESS)
    p.add_argument("--ascii-vocab", type=int, default=0, help=argparse.SUPPRESS)  # internal: bias ids 128+ away
    args = p.parse_args()
    if args.client:
        client_main(args)
        return 0
    if args.turns < 3:
        p.error("--turns must be >= 3 (the speedup is taken over turns 3+)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = make_model_and_adapters(tmp)
        args.model = args.model or str(model)
        on = run_server(args, tmp, "on")
        off = run_server(args, tmp, "off")
    on_p50, off_p50 = report("on", on, args.turns), report("off", off, args.turns)
    assert sum(map(sum, off["multi"]["cached"])) == 0 and off["no_reuse"]["cached"] == 0
    tps = {k: r["no_reuse"]["tokens"] / r["no_reuse"]["seconds"] for k, r in (("on", on), ("off", off))}
    multi_tps = {k: r["multi"]["tokens"] / r["multi"]["seconds"] for k, r in (("on", on), ("off", off))}
    print(f"multi-turn tokens/s: on {multi_tps['on']:.0f}, off {multi_tps['off']:.0f}")
    print(f"RESULT prefix_cache_ttft_speedup={off_p50 / on_p50:.2f}")
    print(f"RESULT prefix_cache_no_reuse_tps_ratio={tps['on'] / tps['off']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
