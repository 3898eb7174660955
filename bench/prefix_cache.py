"""Prefix cache: multi-turn conversations through the real server (HTTP, streaming), cache on vs off.

Two servers run at once from this process, `--prefix-cache on` and `off`, same model, same adapters
(PEFT LoRA, random non-zero B, loaded through POST /v1/load_lora_adapter); the load generator runs
in its own process. Only one server has work at a time.

Models (the workload follows the model):
  - `--real` (the default when the file is there): SmolLM2-135M-Instruct, the Q4_1 GGUF of
    harness/real_model.py, its own tokenizer and chat template, 3 adapters (ranks 8/16/8, all 7
    modules, std 0.02 as tests/test_real_model.py: the answers change, the model stays a language
    model). Conversations go through /v1/chat/completions with real text: a 342-token system prompt
    (a shop's support assistant), user messages of 16-34 tokens from SUPPORT_QUESTIONS, and each
    turn resends the whole history with the assistant's answers as the client received them (the
    server re-encodes them; with a real tokenizer they mostly come back as the tokens it cached).
    Answers end at EOS or MAX_NEW tokens (greedy). When the file is missing and neither `--real`
    nor `--fixture` is given, the bench says so on stderr and runs the fixture model; `--real` then
    fails with the command that fetches it. `--model` serves another checkpoint or .gguf this way.
  - `--fixture`: a random LLaMA (hidden 256, 4 layers, 2 KV heads, vocab 384, fp32, byte tokenizer)
    through /v1/completions with token-id prompts: a SYSTEM-token printable-byte system prompt,
    16-40 byte user messages, MAX_NEW tokens (EOS ignored); its answers are kept to ASCII bytes
    (logit_bias -100 on ids 128 and up), since a byte that is not valid UTF-8 alone reaches the
    client as U+FFFD and would never re-encode to the tokens the server cached.
Per-request overhead dominates the fixture model (a hit's prefill is a few ms); the real model is
the issue's "small CPU model".

Multi-turn phase: CONVERSATIONS concurrent conversations spread over the adapters and the base
model, all with the same system prompt, TURNS turns each, on the cache-on server then the cache-off
one. Every response is streamed (logprobs on, so every token is its own SSE chunk); TTFT is the
client's time from sending to the first chunk that carries a token (chat's leading role chunk
does not count). Per turn: TTFT p50/p99 on and off, prompt and cached tokens, and how many
conversations found everything cached up to the end of their previous answer (the full blocks of
previous prompt + answer - 1 tokens: the round trip of the answer's text held).

No-reuse phase: single-turn requests with random token-id prompts (NO_REUSE_PROMPT tokens, never
repeated, so never a hit), CONVERSATIONS at a time, in ROUNDS rounds of ROUND_REQUESTS requests
alternating between the servers (on-off, then off-on, ...), after a warm-up round on each; the
figure is the median of the rounds' on/off tokens/s ratios (a burst of another job then moves one
round, not the figure).

    .venv/bin/python -m bench.prefix_cache [--real | --fixture] [--conversations 8] [--turns 6]
        [--rounds 16] [--round-requests 8]

Last lines:
    RESULT prefix_cache_ttft_speedup=<TTFT p50 off / on over turns 3+>   (target >= 3)
    RESULT prefix_cache_no_reuse_tps_ratio=<median over rounds of tokens/s on / off, no reuse>  (target >= 0.97)

Measured (`--real`, the defaults; 2-core dev box shared with other jobs; dtype auto =
bf16 here; three runs, 1-minute load at start -> end):
    run 1 (3.23 -> 3.39; 8 no-reuse rounds of 16):  speedup 6.09, no reuse 0.973 (rounds 0.70-1.01)
    run 2 (2.77 -> 1.80; 16 rounds of 8):           speedup 5.16, no reuse 0.976 (quartiles 0.94-1.00)
    run 3 (1.30 -> 2.42; 16 rounds of 8):           speedup 4.58, no reuse 1.010 (quartiles 0.92-1.08)
  TTFT p50 ms on / off per turn, run 2 (run 3): 1: 2093 / 2287 (1951 / 3181), 2: 515 / 1638
  (520 / 2185), 3: 369 / 1836 (510 / 2481), 4: 383 / 1637 (563 / 2152), 5: 418 / 1799 (629 / 3072),
  6: 333 / 2045 (662 / 3180); p99 at turns 3-6 on 440-860 ms, off 1890-5150 ms.
  Prompts 379 -> ~705 tokens over the turns; from turn 2 on 91-94% of each prompt is cached, and in
  all three runs 8 of 8 conversations at every turn found everything up to the end of their
  previous answer cached (the answers' text round-trips through the real tokenizer). What a hit
  still waits for is the uncached tail, ~40 tokens a conversation (the new user message, the
  template's tags, the last partial block), 8 conversations arriving together: ~320 tokens of real
  prefill over 470-660 cached ones each, ~350-650 ms at this machine's ~1000 prompt tokens/s
  (turn 1: 8 x 379 tokens in ~2-3 s): an estimate from these figures, not a profile. The off
  side recomputes 450-710 tokens each.
  Turn 1's "cached" (160-168 of 379) is the shared system prompt: the conversations admitted after
  the first ones found its blocks.
  No reuse: the per-round ratios spread 0.78-1.14 with the other jobs; runs 1-2 had the cache-on
  side slower in most rounds, run 3 in half. The engine's own cache work on this workload,
  cProfile'd in-process (EngineCore, 2 rounds of 8 such requests, a full pool evicting cached
  blocks): hashing, lookups, the block pool and `_admit_kv` ~15 ms of 12.6 s (0.1%; the
  scheduler's whole schedule + postprocess 62 ms), so a gap of a few % is the machine, not the
  cache; this bench cannot resolve +-2% here.
  Answers equal on and off: 14, 4, 16 of 48. Not a cache bug: bf16 numerics. A prefill over
  cached context runs other GEMM shapes than a whole-prompt prefill, and greedy flips at near-ties
  in bf16. In-process (EngineCore, one request at a time, these prompts, 32 tokens): fp32, 2
  conversations x 3 turns, all equal with the cache on and off; bf16, 4 x 3, 6 of 12 differed.
The fixture model's figures in docs/performance.md ("The prefix cache") came from the older
one-server-at-a-time version of this bench.
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

from harness.bench import (
    PREFIX_CACHE_MODEL,
    ROOT,
    bench_command,
    make_small_model_and_adapters,
    percentile,
    print_result,
    start_http_server,
)
from harness.http_streams import sse_events
from harness.ports import wait_http_healthy
from harness.real_model import FETCH_HINT, real_model_path

SMALL_MODEL = PREFIX_CACHE_MODEL
ADMIN_TOKEN = "bench-admin"
ADAPTERS = ("ad0", "ad1", "ad2")
SERVED_NAME = "base"  # --served-model-name of both servers: the base model's id in requests
REAL_ADAPTER_STD = 0.02  # as tests/test_real_model.py's ADAPTER_STD

SYSTEM_PROMPT = """\
You are Ada, the customer support assistant of Northwind Hardware, an online shop that sells hand tools, power \
tools, garden equipment and spare parts to customers in Europe. Answer in a friendly, plain and short way, in the \
language the customer writes in. Follow these rules.

1. Orders. A customer may change or cancel an order until it ships, usually within one working day. After that, \
they must wait for the parcel and return it. Never promise a delivery date; give the carrier's estimate and the \
tracking link instead.
2. Returns. Unused items can be returned within 30 days of delivery for a full refund. Power tools that were used \
can be returned only if they are faulty. Refunds reach the customer's card within five to ten working days after \
the return arrives at our warehouse in Rotterdam.
3. Warranty. Power tools carry a two-year warranty, batteries and chargers one year. Ask for the order number and \
a short description of the fault, and offer a repair or a replacement, never cash.
4. Safety. If a customer describes smoke, sparks, a burning smell or a swollen battery, tell them to stop using \
the tool at once, unplug it or remove the battery, and keep it outside away from anything that can burn.
5. Privacy. Never ask for a full card number or a password. To find an order, the order number and the postcode \
are enough.
6. Tone. Do not invent products, prices or policies. If you do not know, say so and offer to pass the question to \
a human colleague, who answers within one working day."""

PRODUCTS = ("cordless drill", "angle grinder", "hedge trimmer", "socket set", "lawn mower", "jigsaw",
            "pressure washer", "workbench", "chainsaw", "circular saw", "leaf blower", "tile cutter")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "weekend")
SUPPORT_QUESTIONS = (
    "Hi, I ordered a {p} last {d} (order {o}) and it still has not arrived. Can you check where it is?",
    "Can I still cancel order {o}? I found the same {p} cheaper in a shop near me.",
    "The battery of my {p} gets very hot after ten minutes of use. Is that normal?",
    "I want to return the {p} from order {o}. I opened the box but never used it.",
    "How long does a refund take once my return of the {p} arrives at your warehouse?",
    "My {p} stopped working after {n} months. What does the warranty cover?",
    "Do you deliver to Norway, and how much would shipping for a {p} cost?",
    "Could you change the delivery address of order {o} to my office in Utrecht, postcode {z}?",
    "The {p} I received is missing a part. The manual says there should be two blades.",
    "Which charger do I need for the {p}? The old one broke when it fell off the shelf.",
    "I smelled something burning when I switched on the {p} this {d}. What should I do now?",
    "Thanks. One more thing: can I pay for order {o} by bank transfer instead of card?",
    "Is there a discount if I buy a {p} together with a spare battery?",
    "My postcode is {z} and the order number is {o}. Please tell me when the {p} will ship.",
)


def support_question(rng: random.Random, template: str) -> str:
    return template.format(p=rng.choice(PRODUCTS), d=rng.choice(DAYS), o=rng.randrange(100000, 999999),
                           n=rng.randrange(2, 20), z=f"{rng.randrange(1000, 9999)} {rng.choice('ABCDEFGH')}"
                                                     f"{rng.choice('KLMNPRST')}")


def _printable(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


# ---- the load generator (its own process) ----

class Client:
    """The load generator's requests (conversations, no-reuse rounds, warm-up) against either server."""

    def __init__(self, httpx, args):
        self.httpx, self.args = httpx, args
        self.real = not args.ascii_vocab
        self.models = [*ADAPTERS, SERVED_NAME]

    async def stream(self, client, url: str, model: str, prompt) -> dict:
        """prompt: chat messages (a list of dicts) or token ids. Returns the reply's ttft, text, usage."""
        args = self.args
        body = {"model": model, "max_tokens": args.max_new_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        chat = bool(prompt) and isinstance(prompt[0], dict)
        if chat:
            body.update(messages=prompt, logprobs=True)
        else:  # token ids: the fixture's conversations and every no-reuse request, a fixed length each
            body.update(prompt=prompt, logprobs=0, ignore_eos=True)
        if not self.real:
            body["logit_bias"] = {str(i): -100 for i in range(128, args.ascii_vocab)}  # see the module docstring
        sent = time.perf_counter()
        ttft, text, usage = None, [], None
        async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"),
                                 json=body) as r:
            r.raise_for_status()
            async for chunk in sse_events(r):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk["choices"]:
                    piece = choice["delta"].get("content") if chat else choice.get("text")
                    if ttft is None and (piece or choice.get("logprobs")):
                        ttft = time.perf_counter() - sent
                    text.append(piece or "")
        assert ttft is not None and usage is not None
        return {"ttft": ttft, "text": "".join(text), "prompt": usage["prompt_tokens"],
                "tokens": usage["completion_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}

    async def conversation(self, client, url: str, i: int) -> list[dict]:
        args, rng = self.args, random.Random(1000 + i)
        model = self.models[i % len(self.models)]
        if self.real:
            questions = rng.sample(SUPPORT_QUESTIONS, len(SUPPORT_QUESTIONS))
            history: list = [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": support_question(rng, questions[0])}]
        else:
            history = _printable(random.Random(7), args.system) + _printable(rng, rng.randrange(16, 40))
        turns = []
        for t in range(args.turns):
            reply = await self.stream(client, url, model, history)
            turns.append(reply)
            if self.real:
                history = [*history, {"role": "assistant", "content": reply["text"]},
                           {"role": "user", "content": support_question(rng, questions[(t + 1) % len(questions)])}]
            else:
                history = history + list(reply["text"].encode()) + _printable(rng, rng.randrange(16, 40))
        return turns

    async def conversations(self, url: str) -> dict:
        args = self.args
        limits = self.httpx.Limits(max_connections=args.conversations, max_keepalive_connections=args.conversations)
        async with self.httpx.AsyncClient(timeout=600, limits=limits) as client:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(self.conversation(client, url, i) for i in range(args.conversations)))
            seconds = time.perf_counter() - t0
        # turns[t][i]: conversation i's turn t
        return {"turns": [[r[t] for r in results] for t in range(args.turns)], "seconds": seconds,
                "tokens": sum(x["tokens"] for r in results for x in r)}

    async def no_reuse_round(self, url: str, prompts: list[list[int]]) -> dict:
        args = self.args
        limits = self.httpx.Limits(max_connections=args.conversations, max_keepalive_connections=args.conversations)
        async with self.httpx.AsyncClient(timeout=600, limits=limits) as client:
            sem = asyncio.Semaphore(args.conversations)

            async def one(i: int, prompt: list[int]) -> dict:
                async with sem:
                    return await self.stream(client, url, self.models[i % len(self.models)], prompt)

            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            seconds = time.perf_counter() - t0
        return {"tokens": sum(d["tokens"] for d in done), "cached": sum(d["cached"] for d in done),
                "seconds": seconds}

    async def warm(self, url: str) -> None:
        """One short request per model (loads the adapters into the pool, warms the kernels)."""
        rng = random.Random(5)
        async with self.httpx.AsyncClient(timeout=600) as client:
            for model in self.models:
                await self.stream(client, url, model, [rng.randrange(3, 256) for _ in range(8)])


def client_main(args) -> None:
    """Runs every phase against both servers; prints one JSON line."""
    import httpx2 as httpx  # the HTTP client the openai SDK is built on

    c = Client(httpx, args)
    urls = {"on": args.client, "off": args.client_off}
    for url in urls.values():
        asyncio.run(c.warm(url))
    loads = {"multi-turn": os.getloadavg()[0]}
    multi = {side: asyncio.run(c.conversations(url)) for side, url in urls.items()}
    loads["no reuse"] = os.getloadavg()[0]
    rng = random.Random(99)
    low, high = (100, args.vocab) if c.real else (3, 256)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(low, high) for _ in range(args.no_reuse_prompt)] for _ in range(args.round_requests)]

    warm = prompts()
    for url in urls.values():  # a warm-up round on each
        asyncio.run(c.no_reuse_round(url, warm))
    rounds = []
    for r in range(args.rounds):  # both servers get the round's fresh prompts: the same work, never a hit
        order, work = (("on", "off") if r % 2 == 0 else ("off", "on")), prompts()
        rounds.append({side: asyncio.run(c.no_reuse_round(urls[side], work)) for side in order})
    loads["end"] = os.getloadavg()[0]
    print(json.dumps({"multi": multi, "no_reuse": rounds, "loads": loads}), flush=True)


# ---- the servers ----

def _load_adapter(url: str, name: str, path: Path) -> None:
    body = json.dumps({"lora_name": name, "lora_path": str(path)}).encode()
    request = urllib.request.Request(url + "/v1/load_lora_adapter", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200


def start_server(args, tmp: Path, prefix_cache: str) -> tuple[subprocess.Popen, str]:
    server = start_http_server(
        ["--model", args.model, "--device", args.device, "--tokenizer", "auto" if args.real else "byte",
         "--served-model-name", SERVED_NAME, "--log-level", "WARNING", "--prefix-cache", prefix_cache,
         "--max-lora-rank", "16", "--adapter-source-allow", tmp.as_uri()],
        tmp / f"server-{prefix_cache}.log", env={"LORAPLEX_ADMIN_TOKEN": ADMIN_TOKEN}, healthy_timeout=None)
    return server.process, server.url


def run_bench(args, tmp: Path) -> dict:
    servers = {side: start_server(args, tmp, side) for side in ("on", "off")}
    try:
        for server, url in servers.values():
            wait_http_healthy(url, server, timeout=300)
            for name in ADAPTERS:
                _load_adapter(url, name, tmp / name)
        out = subprocess.run(
            bench_command("prefix_cache", "--client", servers["on"][1], "--client-off", servers["off"][1],
             "--conversations", str(args.conversations), "--turns", str(args.turns), "--system", str(args.system),
             "--max-new-tokens", str(args.max_new_tokens), "--rounds", str(args.rounds),
             "--round-requests", str(args.round_requests), "--no-reuse-prompt", str(args.no_reuse_prompt),
             "--ascii-vocab", str(0 if args.real else SMALL_MODEL["vocab_size"]), "--vocab", str(args.vocab)),
            check=True, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for server, _ in servers.values():
            server.terminate()
        for server, _ in servers.values():
            server.wait(30)


def make_model_and_adapters(tmp: Path) -> Path:
    """The fixture model and its adapters under `tmp`."""
    return make_small_model_and_adapters(tmp, ADAPTERS, PREFIX_CACHE_MODEL)


def make_real_adapters(model: str, tmp: Path) -> int:
    """Adapters for a real checkpoint or .gguf under `tmp`; returns its vocabulary size."""
    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.models.config import ModelConfig

    if model.endswith(".gguf"):
        from inference_service.models.gguf import GGUFFile

        hf = GGUFFile(Path(model)).hf_config()
    else:
        hf = json.loads((Path(model) / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    for i, name in enumerate(ADAPTERS):
        write_peft_adapter(tmp / name, config, rank=8 * (1 + i % 2), alpha=16.0, seed=i, scale=REAL_ADAPTER_STD)
    return config.vocab_size


# ---- the report ----

def answer_hits(turns: list[list[dict]], block: int = 16) -> list[int]:
    """Per turn: conversations whose cached tokens reach the full blocks of the previous prompt and
    answer (its last token aside: the last sampled token has no KV), i.e. the answer came back as
    the tokens the server cached. Turn 1 has no previous answer: its count is the conversations."""
    hits = [len(turns[0])]
    for t in range(1, len(turns)):
        hits.append(sum(now["cached"] >= min(block * ((prev["prompt"] + prev["tokens"] - 1) // block),
                                             block * ((now["prompt"] - 1) // block))
                        for prev, now in zip(turns[t - 1], turns[t], strict=True)))
    return hits


def report(on: dict, off: dict, turns: int) -> float:
    for side, multi in (("on", on), ("off", off)):
        print(f"--- prefix cache {side}: {multi['tokens']} tokens in {multi['seconds']:.2f}s = "
              f"{multi['tokens'] / multi['seconds']:.0f} tokens/s (multi-turn)")
    hits = answer_hits(on["turns"])
    print("turn  TTFT p50/p99 on (ms)  TTFT p50/p99 off (ms)  prompt  cached on  hit rate  answer round-trip")
    for t in range(turns):
        ton, toff = [x["ttft"] for x in on["turns"][t]], [x["ttft"] for x in off["turns"][t]]
        prompt = statistics.mean(x["prompt"] for x in on["turns"][t])
        cached = statistics.mean(x["cached"] for x in on["turns"][t])
        on_p50, on_p99 = 1000 * statistics.median(ton), 1000 * percentile(ton, 0.99)
        off_p50, off_p99 = 1000 * statistics.median(toff), 1000 * percentile(toff, 0.99)
        print(f"{t + 1:4}  {on_p50:8.1f} {on_p99:8.1f}    {off_p50:8.1f} {off_p99:8.1f}   {prompt:6.1f}  {cached:9.1f}"
              f"  {cached / prompt:8.2f}  {hits[t]}/{len(on['turns'][t])}" + ("" if t else " (first turn)"))
    same = sum(a["text"] == b["text"] for t in range(turns) for a, b in zip(on["turns"][t], off["turns"][t],
                                                                            strict=True))
    print(f"answers equal on and off: {same} of {turns * len(on['turns'][0])}")
    late = {side: statistics.median(x["ttft"] for t in range(2, turns) for x in multi["turns"][t])
            for side, multi in (("on", on), ("off", off))}
    print(f"TTFT p50 turns 3+: on {1000 * late['on']:.1f} ms, off {1000 * late['off']:.1f} ms")
    return late["off"] / late["on"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct, real text (default if present)")
    kind.add_argument("--fixture", action="store_true", help="the tiny random model, byte tokenizer")
    p.add_argument("--model", default="", help="another .gguf or checkpoint dir to run the real-text workload on")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system", type=int, default=300, help="tokens of the fixture's system prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=16, help="timed no-reuse rounds (alternating servers)")
    p.add_argument("--round-requests", type=int, default=8, help="requests per no-reuse round and server")
    p.add_argument("--no-reuse-prompt", type=int, default=300, help="tokens of each no-reuse prompt")
    p.add_argument("--device", default="cpu", help="cpu | cuda (the server gets the same)")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run as the load generator against these URLs
    p.add_argument("--client-off", help=argparse.SUPPRESS)
    p.add_argument("--ascii-vocab", type=int, default=0, help=argparse.SUPPRESS)  # internal: bias ids 128+ away
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args)
        return 0
    if args.turns < 3:
        p.error("--turns must be >= 3 (the speedup is taken over turns 3+)")
    if args.model and args.fixture:
        p.error("--model serves the real-text workload; --fixture makes its own model")
    if not args.fixture and not args.model:
        found = real_model_path()
        if found is not None:
            args.model = str(found)
        elif args.real:
            sys.exit(f"the real model is missing: {FETCH_HINT}")
        else:
            print(f"the real model is missing ({FETCH_HINT}); running the fixture model", file=sys.stderr)
    args.real = bool(args.model)
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; "
          f"model {args.model or 'fixture'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.real:
            args.vocab = make_real_adapters(args.model, tmp)
        else:
            args.model = str(make_model_and_adapters(tmp))
        result = run_bench(args, tmp)
    on, off = result["multi"]["on"], result["multi"]["off"]
    speedup = report(on, off, args.turns)
    assert all(x["cached"] == 0 for turn in off["turns"] for x in turn), "the cache-off server reported a hit"
    ratios = []
    for r, rnd in enumerate(result["no_reuse"]):
        tps = {side: x["tokens"] / x["seconds"] for side, x in rnd.items()}
        assert rnd["on"]["cached"] == rnd["off"]["cached"] == 0, f"a no-reuse prompt hit in round {r}"
        ratios.append(tps["on"] / tps["off"])
        print(f"no reuse round {r + 1} ({' then '.join(rnd)}): on {tps['on']:.0f} tokens/s, off {tps['off']:.0f}"
              f" tokens/s, ratio {ratios[-1]:.3f}")
    load = os.getloadavg()
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(f"no reuse ratio: median {statistics.median(ratios):.3f}, quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} rounds")
    print("1-minute load average at the start of each phase: "
          + ", ".join(f"{phase} {value:.2f}" for phase, value in result["loads"].items()))
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print_result("prefix_cache_ttft_speedup", speedup, ".2f")
    print_result("prefix_cache_no_reuse_tps_ratio", statistics.median(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
