"""gRPC streaming overhead: tokens/s through the real server vs the in-process Engine, same workload.

Workload: CONCURRENCY concurrent requests at a time, TOTAL in all, over a few adapters (all fit in
the slots, loaded before timing), greedy, ignore_eos, fixed max_new_tokens, on a 4-layer hidden-512
LLaMA by default (`--model builtin:tiny` measures the toy model, where Python per-token overhead
rather than model compute dominates). The in-process side
runs first and is shut down before the server starts, so the two never share the CPUs.

    .venv/bin/python -m bench.grpc_overhead [--total 96] [--concurrency 16] [--max-new-tokens 64]

Last line: RESULT grpc_vs_inprocess_tokens_per_s=<ratio>   (target >= 0.9)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc

from harness.bench import print_result
from harness.inference_server import start_inference_server
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.models.config import ModelConfig


def workload(total: int, n_adapters: int) -> list[tuple[str | None, str]]:
    return [(f"b{i % n_adapters}" if i % 4 else None, f"benchmark prompt number {i} " + "z" * (i % 17))
            for i in range(total)]


def run_inprocess(args, adapters: dict[str, str], work) -> tuple[int, float]:
    from inference_service.engine.config import EngineConfig
    from inference_service.engine.in_process import Engine
    from inference_service.engine.request import SamplingParams

    engine = Engine(EngineConfig(model=args.model, device=args.device, max_loras=args.max_loras))
    engine.start()
    try:
        for name, uri in adapters.items():
            engine.load_adapter(name, uri, preload=True).result(120)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)

        async def one(sem, adapter, prompt) -> int:
            async with sem:
                stream = engine.add_request(engine.tokenizer.encode(prompt), params, adapter=adapter)
                return sum([len(out.new_token_ids) async for out in stream])

        async def all_(items) -> int:
            sem = asyncio.Semaphore(args.concurrency)
            return sum(await asyncio.gather(*(one(sem, a, p) for a, p in items)))

        asyncio.run(all_(work[: args.concurrency]))  # warm-up
        t0 = time.perf_counter()
        tokens = asyncio.run(all_(work))
        return tokens, time.perf_counter() - t0
    finally:
        engine.shutdown()


def run_grpc(args, adapters: dict[str, str], work, log_dir: str) -> tuple[int, float]:
    server = start_inference_server(["--model", args.model, "--device", args.device, "--max-loras", str(args.max_loras),
                                     "--adapter-source-allow", Path(log_dir).as_uri(),
                                     "--log-level", "WARNING"], log_dir=log_dir)
    try:
        with InferenceClient(server.address) as c:
            for name, uri in adapters.items():
                c.load_adapter(name, uri, preload=True, timeout=120)

        async def one(stub, sem, adapter, prompt) -> int:
            async with sem:
                req = pb.GenerateRequest(text=prompt, adapter=adapter or "", max_new_tokens=args.max_new_tokens,
                                         ignore_eos=True)
                return sum([len(m.token_ids) async for m in stub.Generate(req)])

        async def all_(items) -> int:
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = pb_grpc.InferenceStub(ch)
                sem = asyncio.Semaphore(args.concurrency)
                return sum(await asyncio.gather(*(one(stub, sem, a, p) for a, p in items)))

        asyncio.run(all_(work[: args.concurrency]))  # warm-up
        t0 = time.perf_counter()
        tokens = asyncio.run(all_(work))
        # The client shares the machine with the server, so its own cost is included in the figure.
        return tokens, time.perf_counter() - t0
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="",
                   help="checkpoint dir or builtin:tiny; default: a generated 4-layer hidden-512 LLaMA (the "
                        "engine_throughput model), big enough that per-token work is model compute")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (the server's too)")
    p.add_argument("--total", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=3)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2, help="runs per side; the best of each is compared")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            from harness.bench import ENGINE_MODEL as MODEL
            from harness.models import make_checkpoint

            args.model = str(make_checkpoint(Path(tmp) / "model", "llama", **MODEL))
        config = None if args.model == "builtin:tiny" else ModelConfig.from_hf(
            json.loads((Path(args.model) / "config.json").read_text()))
        adapters = {f"b{i}": write_peft_adapter(Path(tmp) / f"b{i}", config, rank=8, seed=i).as_uri()
                    for i in range(args.adapters)}
        work = workload(args.total, args.adapters)
        inproc = max((run_inprocess(args, adapters, work) for _ in range(args.repeat)), key=lambda r: r[0] / r[1])
        remote = max((run_grpc(args, adapters, work, tmp) for _ in range(args.repeat)), key=lambda r: r[0] / r[1])
    in_tps, grpc_tps = inproc[0] / inproc[1], remote[0] / remote[1]
    assert inproc[0] == remote[0] == args.total * args.max_new_tokens, (inproc, remote)
    print(f"in-process: {inproc[0]} tokens in {inproc[1]:.2f}s = {in_tps:.0f} tokens/s")
    print(f"gRPC:       {remote[0]} tokens in {remote[1]:.2f}s = {grpc_tps:.0f} tokens/s")
    print_result("grpc_vs_inprocess_tokens_per_s", grpc_tps / in_tps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
