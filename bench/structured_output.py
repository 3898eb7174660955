"""Structured output's cost: tokens/s through the real server with half the streams constrained by a
JSON schema, against all streams free, in the same run.

Workload: the serving benchmark's small model (bench/http_overhead.py: LLaMA, hidden 256, 4 layers,
vocab 32000, fp32, random weights, byte tokenizer), CONCURRENCY streams through the server
over gRPC (the same engine path as HTTP's response_format; gRPC's messages carry their token ids, so
each token is counted when it arrives inside the window), spread over the base model and ADAPTERS
adapters. Each stream is a closed loop (its next request when its last ends). Free requests: 64
tokens, EOS ignored. Constrained requests: SamplingParams.json_schema = SCHEMA, up to 256 tokens,
ending where the schema's JSON ends. Phases alternate free / mixed (half constrained) ROUNDS times.
Every constrained answer that ends is parsed and validated against SCHEMA (jsonschema); one that
fails, or is cut by max_tokens, is reported.

    .venv/bin/python -m bench.structured_output [--concurrency 32] [--window 10] [--rounds 3]

Last line: RESULT structured_vs_free=<ratio>   (target >= 0.85)
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

ADAPTERS = 3
PROMPT_TOKENS = 32
FREE_TOKENS = 64
CONSTRAINED_MAX = 256
WARM_S = 2.0
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags", "active"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                         "name": {"type": "string", "maxLength": 16},
                         "score": {"type": "number"},
                         "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["new", "hot", "sale", "eol"]}},
                         "active": {"type": "boolean"}}}


def client_main(address: str, concurrency: int, window: float, constrained: int, seed: int) -> None:
    """The load generator (its own process): gRPC streams, each message's tokens counted when it
    arrives inside the window; prints {"tokens", "seconds", "valid", "invalid", "cut", ...}."""
    import grpc
    import jsonschema

    from inference_service.api import inference_pb2 as pb
    from inference_service.api import inference_pb2_grpc as pb_grpc

    rng = random.Random(seed)
    adapters = [""] + [f"a{i}" for i in range(ADAPTERS)]
    counts = {"tokens": 0, "valid": 0, "invalid": 0, "cut": 0, "requests": 0, "constrained_tokens": 0,
              "constrained_requests": 0}
    schema = json.dumps(SCHEMA)

    async def stream(stub, i: int, start: float, end: float) -> None:
        constrained_stream = i < constrained
        n = 0
        while time.monotonic() < end:
            prompt = pb.TokenIds(ids=[rng.randrange(0, 256) for _ in range(PROMPT_TOKENS)])
            sampling = pb.SamplingParams(temperature=1.0, seed=seed * 1000 + n)
            if constrained_stream:
                sampling.json_schema = schema
            request = pb.GenerateRequest(adapter=adapters[i % len(adapters)], token_ids=prompt, sampling=sampling,
                                         max_new_tokens=CONSTRAINED_MAX if constrained_stream else FREE_TOKENS,
                                         ignore_eos=not constrained_stream)
            n += 1
            text, finish = [], None
            async for message in stub.Generate(request):
                now = time.monotonic()
                if start <= now <= end:
                    counts["tokens"] += len(message.token_ids)
                    if constrained_stream:
                        counts["constrained_tokens"] += len(message.token_ids)
                text.append(message.text)
                finish = message.finish_reason or finish
            if start <= time.monotonic() <= end:
                counts["requests"] += 1
                counts["constrained_requests"] += constrained_stream
            if constrained_stream:
                if pb.FinishReason.Name(finish) == "FINISH_REASON_LENGTH":
                    counts["cut"] += 1
                    continue
                try:
                    jsonschema.validate(json.loads("".join(text)), SCHEMA)
                    counts["valid"] += 1
                except (ValueError, jsonschema.ValidationError):
                    counts["invalid"] += 1

    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            start = time.monotonic() + WARM_S
            await asyncio.gather(*(stream(stub, i, start, start + window) for i in range(concurrency)))

    asyncio.run(run())
    print(json.dumps({**counts, "seconds": window}), flush=True)


def phase(address: str, args, constrained: int, seed: int) -> dict:
    out = subprocess.run(bench_command("structured_output", "--client", address, "--concurrency", str(args.concurrency),
                          "--window", str(args.window), "--constrained", str(constrained), "--seed", str(seed)),
                         check=True, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="checkpoint dir; default: the generated small model")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--window", type=float, default=10.0, help="seconds counted per phase")
    p.add_argument("--rounds", type=int, default=3, help="free/mixed phase pairs")
    p.add_argument("--device", default="cpu")
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--constrained", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(args.client, args.concurrency, args.window, args.constrained, args.seed)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.models.llama import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            args.model = str(make_small_model(Path(tmp) / "small"))
        config = ModelConfig.from_hf(json.loads((Path(args.model) / "config.json").read_text()))
        preload = Path(tmp) / "preload.json"
        preload.write_text(json.dumps([{"name": f"a{i}", "uri": write_peft_adapter(Path(tmp) / f"a{i}", config,
                                                                                   rank=8, seed=i).as_uri()}
                                       for i in range(ADAPTERS)]))
        server = start_http_server(
            ["--model", args.model, "--device", args.device, "--tokenizer", "byte", "--log-level", "WARNING",
             "--max-num-seqs", str(max(64, args.concurrency)), "--max-loras", str(ADAPTERS), "--max-lora-rank", "8",
             "--adapter-source-allow", Path(tmp).as_uri(), "--preload-file", str(preload),
             "--served-model-name", "base"],
            Path(tmp) / "server.log", env={"OMP_NUM_THREADS": "1"})
        try:
            address = server.grpc_address
            phase(address, argparse.Namespace(concurrency=args.concurrency, window=2.0), args.concurrency // 2, 99)
            free, mixed = [], []
            for r in range(args.rounds):
                free.append(phase(address, args, 0, 2 * r))
                mixed.append(phase(address, args, args.concurrency // 2, 2 * r + 1))
        finally:
            server.stop()
    tps = lambda runs: sum(x["tokens"] for x in runs) / sum(x["seconds"] for x in runs)  # noqa: E731
    valid, invalid, cut = (sum(x[k] for x in mixed) for k in ("valid", "invalid", "cut"))
    print(f"model: {SMALL_MODEL if args.model.endswith('small') else args.model}")
    for name, runs in (("all free", free), ("half constrained", mixed)):
        each = ", ".join(f"{x['tokens'] / x['seconds']:.0f}" for x in runs)
        print(f"{name:17s} {tps(runs):8.0f} tokens/s  ({each}; {sum(x['requests'] for x in runs)} requests)")
    ctok, creq = (sum(x[k] for x in mixed) for k in ("constrained_tokens", "constrained_requests"))
    print(f"constrained streams: {ctok} tokens in {creq} requests ({ctok / max(1, creq):.0f} per request)")
    print(f"constrained answers: {valid} valid, {invalid} invalid, {cut} cut by max_tokens "
          f"({100 * valid / max(1, valid + invalid + cut):.1f}% parse and validate)")
    print_result("structured_vs_free", tps(mixed) / tps(free))
    return 0 if invalid == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
