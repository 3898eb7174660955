"""A cancel/deadline storm with hostile inputs mixed in: does anything leak or break?

TOTAL Generate calls, CONCURRENCY at a time, against a real `loraplex-inference` subprocess
(builtin:tiny, two adapters): a quarter run to completion, a quarter are cancelled after their
first message, a quarter get a deadline too short to finish, and a quarter are hostile (tiny
temperature or top_p, 150k stop strings, 900k stop ids, out-of-vocabulary ids, a name outside the
grammar, a megabyte or CR/LF request id, invalid UTF-8, an oversized prompt). Afterwards the leak
gauges must all read 0, health SERVING, and the server log hold no traceback.

    .venv/bin/python -m bench.isolation_storm [--total 10000] [--concurrency 64]

Prints the status codes seen per kind, requests/s, and the gauges; last line:
RESULT leaks=<sum of the leak gauges> tracebacks=<n> unexpected=<calls with a code not allowed for their kind>
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from harness.bench import ROOT
from harness.ports import free_port
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.demo_adapters import write_peft_adapter

LEAK_GAUGES = ("loraplex_lora_slots_referenced", "loraplex_lora_adapter_references",
               "loraplex_lora_pending_load_events", "loraplex_requests_running", "loraplex_requests_waiting",
               "loraplex_kv_cache_usage_ratio")
REFUSED = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
ALLOWED = {
    "complete": {"OK"},
    "cancel": {"OK", "CANCELLED"},
    "deadline": {"OK", "DEADLINE_EXCEEDED"},
    "hostile": {"OK"} | REFUSED,
}


def hostile_requests() -> list[bytes]:
    big = [pb.GenerateRequest(text="x", stop=[f"s{i}" for i in range(150_000)]),
           pb.GenerateRequest(text="x", stop_token_ids=[7] * 900_000),
           pb.GenerateRequest(text="x", request_id="r" * (1 << 20)),
           pb.GenerateRequest(text="p" * (3 << 20))]
    small = [pb.GenerateRequest(text="x", max_new_tokens=8, sampling=pb.SamplingParams(temperature=1e-300)),
             pb.GenerateRequest(text="x", max_new_tokens=8, sampling=pb.SamplingParams(temperature=1.0, top_p=1e-300)),
             pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9])),
             pb.GenerateRequest(text="x", adapter="a0@1"),
             pb.GenerateRequest(text="x", adapter="zero\u200bwidth"),
             pb.GenerateRequest(text="x", request_id="x\r\nFORGED")]
    return [r.SerializeToString() for r in big + small * 4] + [b"\x1a\x02\xff\xfe"] * 4


async def one(channel: grpc.aio.Channel, kind: str, rng: random.Random, hostile: list[bytes]) -> str:
    stub = pb_grpc.InferenceStub(channel)
    adapter = rng.choice(["", "a0", "a1"])
    request = pb.GenerateRequest(text=f"storm {rng.random()}", adapter=adapter, ignore_eos=True,
                                 max_new_tokens=rng.randint(1, 24))
    try:
        if kind == "hostile":
            call = channel.unary_stream("/loraplex.v1.Inference/Generate", request_serializer=None,
                                        response_deserializer=pb.GenerateResponse.FromString)
            async for _ in call(rng.choice(hostile), timeout=60):
                pass
        elif kind == "cancel":
            call = stub.Generate(request, timeout=60)
            async for _ in call:
                call.cancel()
                break
            return "CANCELLED"
        elif kind == "deadline":
            async for _ in stub.Generate(request, timeout=rng.uniform(0.005, 0.1)):
                pass
        else:
            async for _ in stub.Generate(request, timeout=120):
                pass
    except grpc.aio.AioRpcError as e:
        return e.code().name
    return "OK"


async def storm(address: str, total: int, concurrency: int) -> tuple[dict, float]:
    rng = random.Random(0)
    hostile = hostile_requests()
    kinds = [("complete", "cancel", "deadline", "hostile")[i % 4] for i in range(total)]
    rng.shuffle(kinds)
    seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    queue = iter(kinds)
    options = [("grpc.max_send_message_length", 8 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        async def worker() -> None:
            for kind in queue:
                seen[kind][await one(channel, kind, rng, hostile)] += 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return seen, time.monotonic() - t0


def gauges(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = dict.fromkeys(LEAK_GAUGES, 0.0)
    for line in text.splitlines():
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def start_server(tmp: Path) -> tuple[subprocess.Popen, str, str, Path]:
    for i in range(2):
        write_peft_adapter(tmp / f"a{i}", seed=i)
    preload = tmp / "preload.json"
    preload.write_text(json.dumps([{"name": f"a{i}", "uri": (tmp / f"a{i}").as_uri()} for i in range(2)]))
    log = tmp / "server.log"
    args = [sys.executable, "-m", "inference_service.cli", "--model", "builtin:tiny", "--http-port", "0",
            "--listen", "127.0.0.1:0", "--metrics-port", "0",
            "--adapter-source-allow", tmp.as_uri(), "--preload-file", str(preload), "--max-queue", "4096"]
    metrics_port = free_port()
    args[args.index("--metrics-port") + 1] = str(metrics_port)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(r"LISTENING (\S+)", log.read_text(errors="replace"))
        if match:
            return proc, match.group(1), f"http://127.0.0.1:{metrics_port}/metrics", log
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="isolation-storm-"))
    proc, address, metrics_url, log = start_server(tmp)
    try:
        seen, seconds = asyncio.run(storm(address, args.total, args.concurrency))
        values = gauges(metrics_url)
        deadline = time.monotonic() + 10
        while any(values.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            values = gauges(metrics_url)
        unexpected = sum(n for kind, codes in seen.items() for code, n in codes.items() if code not in ALLOWED[kind])
        for kind, codes in sorted(seen.items()):
            print(f"{kind:9s} {dict(codes.most_common())}")
        print(f"{args.total} calls in {seconds:.1f} s ({args.total / seconds:.0f}/s); gauges after: {values}")
        tracebacks = log.read_text(errors="replace").count("Traceback")
        print(f"RESULT leaks={sum(values.values()):g} tracebacks={tracebacks} unexpected={unexpected}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
