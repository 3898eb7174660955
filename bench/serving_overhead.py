"""The serving layer's own benchmark: what the front end costs, measured through the real server.

Two regimes and a stalled-reader check, each with the load generator in processes of its own:

- **Simulated accelerator** (`sim`): the server is the real `loraplex-inference` (scheduler, LoRA manager,
  detokenizer, outputs, gRPC) except that the model runner's forward pass is a stand-in that sleeps a fixed
  wall time (`--sim-step-ms`, no CPU used, like a GPU kernel) and emits deterministic tokens. Ideal
  tokens/s = streams x steps/s; `efficiency` = achieved / ideal, under two loads (`--load`):
  - `burst`: every stream sends one request (128 new tokens) at the same moment; measured from that
    moment to the last token, so the intake of the synchronized burst counts in full. `steady state` =
    the same ratio while every stream is streaming (the last first token to the first last one).
  - `sustained`: N streams kept open as a closed loop (each sends its next request as soon as its last
    one ends, like benchmark_serving's --max-concurrency), lengths uniform within +-50% of the mean as
    real traffic varies (fixed lengths keep every stream in lockstep with the first burst forever);
    measured over `--sustain-s` seconds after a settling period, so each request's turnaround (its end,
    the next call, its first token) counts and the one-off burst at the start does not.
- **Real model on CPU** (`real`): a small real-shaped LLaMA (hidden 256, 4 layers, 2 KV heads, vocab 32000,
  fp32), 32 concurrent streams of 32-token prompts and 64 new tokens (greedy, EOS ignored), on the base model
  and over 8 adapters in 4 slots, gRPC against the in-process EngineCore stepping the same requests. The
  two sides take turns (`--real-turns`, two rounds each) and the figure is the median of the turns'
  ratios (a round is ~1 s and this machine's speed drifts). `--model-threads 0,1`: the model on torch's
  default threads on both sides (every core: the front end and the load generator then take their CPU
  from the model's), then on one thread on both sides (a core left to them, as an accelerator would).
  `--model` (a .gguf file or a checkpoint directory) runs this regime on that model instead, with its own
  tokenizer (the default model's is byte-level).
  `--floor` (default on): the in-process engine again, while after each of its steps a bare grpc.aio server
  (no engine, no streams, no detokenizer: a prebuilt message per token) writes that step's tokens to the
  same load generator; its rate over the engine's alone is what the cheapest front end on grpc.aio costs the
  engine on this machine, and the gRPC side's ratio to it is what our own serving code costs on top.
- **Stalled reader** (`stalled`): 64 simulated streams at 10 ms alone, then beside a client that opened a
  long stream and stopped reading; the others' inter-token p99 ratio (target <= 1.2).

`--engine-core thread,process` runs each server both ways (before/after the core got its own process);
`--async-scheduling off,on` and `--stream-interval 1,8` compare the simulated servers' settings.

    .venv/bin/python -m bench.serving_overhead                     # everything
    .venv/bin/python -m bench.serving_overhead sim --streams 64,256,1024 --sim-step-ms 5,10
    .venv/bin/python -m bench.serving_overhead sim --async-scheduling off,on --stream-interval 1 --load burst
    .venv/bin/python -m bench.serving_overhead real --engine-core thread,process --model-threads 0

Every load line gives the CPU seconds of the server (its engine core process apart), of the load
generator, and the host's steal time meanwhile: these are virtual machines, and a run where the host took
a large share of our CPUs measured the host.

RESULT lines: `serving_efficiency_256` (achieved/ideal at 256 streams, 10 ms step, the last `--load`,
sustained by default, and the last `--stream-interval`, 8 by default: coalescing is allowed there;
target >= 0.90), `grpc_vs_inprocess_small_model` (the lower of base and mixed, with the first
`--model-threads`, torch's default by default; target >= 0.80).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.bench import ROOT, bench_command, percentile, print_result

PR_SET_TIMERSLACK = 29  # prctl(2)
SMALL_MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)


# ---- the server side: the real CLI with a stand-in forward pass ----------------------------------------

def serve_simulated(step_ms: float, trace: str, cli_args: list[str]) -> int:
    """Runs `loraplex-inference` whose ModelRunner.execute sleeps `step_ms` instead of computing
    (planning the step's rows, the scheduler, outputs and transport are all the real code). Each step
    appends `start slept rows` to `trace` (`StepTrace`)."""
    from inference_service import cli
    from inference_service.engine.model_runner import ModelRunner
    from inference_service.engine.request import TokenLogprobs

    step_s = step_ms / 1000.0
    # A device's step ends when it ends; a sleep ends up to the thread's timer slack later (50 us by
    # default on Linux, ~1% of a 5 ms step). 1 ns, for this process's threads (inherited by each).
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)

    steps = open(trace, "a", buffering=1)  # noqa: SIM115 - for the process's life

    def execute(self, rows, previous):  # noqa: ANN001 - same signature as ModelRunner.execute
        start = time.time()
        # The accelerator's step, `step_s` of wall time in all: it samples a token for each row that
        # reaches its request's end (deterministic stand-ins, logprobs too when asked) ...
        vocab = self.model.config.vocab_size
        sampled = [row for row in rows if row.samples]
        tokens = [((row.start + len(row.input_ids)) * 7919 + 13) % (vocab - 3) + 3 for row in sampled]
        logprobs = [None if row.params.logprobs is None else
                    TokenLogprobs(token, -0.5, tuple((t, -1.0 - t) for t in range(row.params.logprobs)))
                    for row, token in zip(sampled, tokens, strict=True)]
        time.sleep(max(0.0, start + step_s - time.time()))  # ... and takes no CPU (the GIL is released)
        steps.write(f"{start:.6f} {time.time() - start:.6f} {len(rows)}\n")
        # The host's part once the device is done, as ModelRunner.execute does it: results by request.
        return {row.request_id: (token, None, lp) for row, token, lp in zip(sampled, tokens, logprobs, strict=True)}

    ModelRunner.execute = execute
    return cli.main(cli_args)


def serve_bare(signal_port: int, listen: str) -> None:
    """The least a front end on grpc.aio can do: a bare server with the Inference service's Generate and
    health and nothing else. Each datagram on `signal_port` is one engine step that made N tokens: it
    writes one prebuilt one-token GenerateResponse to each of N open streams, the longest waiting first
    (b"e" ends them all). The in-process engine sends one per step, so the bare server's bursts come
    when the real front end's would, with as many messages."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from inference_service.api import inference_pb2 as pb

    message = pb.GenerateResponse(request_id="0" * 32, token_ids=[1234], text="x").SerializeToString()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        waiting: collections.deque[asyncio.Future] = collections.deque()  # streams owed their next token
        ended = asyncio.Event()

        class Steps(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple) -> None:
                if data == b"e":
                    ended.set()
                tokens = len(waiting) if data == b"e" else int(data)
                for _ in range(min(tokens, len(waiting))):
                    waiting.popleft().set_result(None)

        async def generate(raw: bytes, context: grpc.aio.ServicerContext) -> None:
            for _ in range(pb.GenerateRequest.FromString(raw).max_new_tokens):
                if ended.is_set():
                    return
                turn = loop.create_future()
                waiting.append(turn)
                await turn
                if not ended.is_set():
                    await context.write(message)

        await loop.create_datagram_endpoint(Steps, local_addr=("127.0.0.1", signal_port))
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "loraplex.v1.Inference", {"Generate": grpc.unary_stream_rpc_method_handler(generate)}),))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(listen)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


@dataclass
class StepTrace:
    """What the stand-in device did over a load's window: where the efficiency went. Efficiency is about
    (step_ms / period) x (rows / streams): a period longer than the step is the device waiting (its own
    sleep ending late on this machine, then the gap before the next step starts), fewer rows than streams
    are requests between their end and the next one's first step (turnaround)."""
    period_ms: float  # start to start, mean
    slept_ms: float  # the stand-in's sleep, mean: a 10 ms sleep on these VMs takes longer
    rows: float  # per step, mean

    @classmethod
    def read(cls, path: Path, window: tuple[float, float]) -> StepTrace:
        steps = [tuple(float(x) for x in line.split()) for line in path.read_text().splitlines()]
        inside = [s for s in steps if window[0] <= s[0] <= window[1]]
        if len(inside) < 2:
            return cls(float("nan"), float("nan"), float("nan"))
        period = (inside[-1][0] - inside[0][0]) / (len(inside) - 1)
        return cls(period * 1000, statistics.mean(s[1] for s in inside) * 1000, statistics.mean(s[2] for s in inside))

    def line(self, step_ms: float, streams: int) -> str:
        return (f"device: a step every {self.period_ms:5.2f} ms (slept {self.slept_ms:5.2f}), {self.rows:5.1f} rows: "
                f"{step_ms / self.period_ms:.3f} x {self.rows / streams:.3f}")


@dataclass
class Server:
    proc: subprocess.Popen
    address: str
    log: Path
    trace: Path | None = None  # a simulated server's StepTrace file

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds of the server's front end, and of its engine core process (and any other child)."""
        front = children_total = 0.0
        pids = [self.proc.pid]
        while pids:
            pid = pids.pop()
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                continue  # exited meanwhile
            seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            if pid == self.proc.pid:
                front = seconds
            else:
                children_total += seconds
            pids += [int(c) for c in children]
        return front, children_total

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(cmd_prefix: list[str], args: list[str], log_dir: Path, torch_threads: int | None = None) -> Server:
    from harness.inference_server import wait_serving
    from harness.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    log = log_dir / f"server-{address.rsplit(':', 1)[1]}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the same torch threads as the in-process side
    if torch_threads is not None:
        env["OMP_NUM_THREADS"] = str(torch_threads)  # torch's intra-op threads at start-up
    with open(log, "wb") as f:
        proc = subprocess.Popen([*cmd_prefix, "--listen", address, "--log-level", "WARNING", *args], cwd=ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_serving(address, proc, timeout=180)
    except (RuntimeError, TimeoutError) as e:
        proc.kill()
        raise RuntimeError(f"{e}\n{log.read_text()[-3000:]}") from None
    return Server(proc, address, log)


# ---- the load generator: its own processes ------------------------------------------------------------

LOAD_START_S = 1.5  # generate_load's streams start this long after it is called: every client connected

def client_main(spec_json: str) -> None:
    """One load-generator process: `streams` concurrent Generate calls on grpc.aio; prints per-stream
    arrival times (monotonic, relative to the shared start) and its own CPU seconds as JSON."""
    import resource

    import grpc

    from inference_service.api import inference_pb2 as pb
    from inference_service.api import inference_pb2_grpc as pb_grpc

    spec = json.loads(spec_json)

    async def request(stub, i: int, k: int) -> dict:
        adapters, prompts = spec["adapters"], spec["prompts"]
        adapter = adapters[i % len(adapters)] if adapters else ""
        # Sustained: lengths vary around the mean like real traffic's (uniform within +-50%, seeded),
        # so the streams' turnovers spread out instead of staying in lockstep with the first burst.
        length = spec["new_tokens"] if k == 0 or spec["until"] is None else \
            random.Random(i * 7919 + k).randint(spec["new_tokens"] // 2, spec["new_tokens"] * 3 // 2)
        req = pb.GenerateRequest(adapter=adapter, max_new_tokens=length, ignore_eos=True)
        req.token_ids.ids.extend(prompts[(i + k) % len(prompts)])
        sent = time.time()
        arrivals, counts = [], []
        async for msg in stub.Generate(req):
            arrivals.append(time.time())
            counts.append(len(msg.token_ids))
        return {"sent": sent, "arrivals": arrivals, "counts": counts, "tokens": sum(counts), "length": length}

    async def one(stub, i: int) -> list[dict]:
        # burst: one request per stream; sustained: the stream sends its next request as soon as the
        # last one ends, until `until` (a closed loop, like benchmark_serving's --max-concurrency)
        done = [await request(stub, i, 0)]
        while spec["until"] is not None and time.time() < spec["until"]:
            done.append(await request(stub, i, len(done)))
        return done

    def cpu_s() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def cpu_at(moment: float) -> float:
        await asyncio.sleep(max(0.0, moment - time.time()))
        return cpu_s()

    async def run() -> tuple[list[dict], float]:
        channels = [grpc.aio.insecure_channel(spec["address"]) for _ in range(spec["channels"])]
        stubs = [pb_grpc.InferenceStub(ch) for ch in channels]
        for ch in channels:
            await ch.channel_ready()
        await asyncio.sleep(max(0.0, spec["start_at"] - time.time()))
        window = [asyncio.ensure_future(cpu_at(t)) for t in spec["window"] or ()]
        results = await asyncio.gather(*(one(stubs[i % len(stubs)], spec["first"] + i)
                                         for i in range(spec["streams"])))
        window_cpu = window[1].result() - window[0].result() if window else None
        for ch in channels:
            await ch.close()
        return [r for stream in results for r in stream], window_cpu

    t0 = cpu_s()
    results, window_cpu = asyncio.run(run())
    print(json.dumps({"requests": results, "cpu_s": cpu_s() - t0 if window_cpu is None else window_cpu}))


def stalled_reader_main(address: str, new_tokens: int) -> None:
    """A client that opens a long stream (with logprobs: big messages that fill the flow-control
    window), reads its first message, then never reads again until it is killed."""
    import grpc

    from inference_service.api import inference_pb2 as pb
    from inference_service.api import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        req = pb.GenerateRequest(text="stalled", max_new_tokens=new_tokens, ignore_eos=True, logprobs=20)
        stream = pb_grpc.InferenceStub(channel).Generate(req)
        next(stream)
        print("STALLED", flush=True)
        time.sleep(3600)


def machine_ticks() -> tuple[int, int]:
    """(steal, all) CPU ticks of the machine so far (/proc/stat): the share of time a virtual machine's
    host ran something else on our CPUs. On these VMs it grows with wakeups, not with load: 1% with
    both cores spinning, 30%+ under a benchmark that sleeps and wakes thousands of times a second."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])


def steal_between(a: tuple[int, int], b: tuple[int, int]) -> float:
    return (b[0] - a[0]) / max(1, b[1] - a[1])


@dataclass
class LoadResult:
    tokens: int
    messages: int
    wall_s: float
    server_cpu_s: float  # the front end and the engine core process
    core_cpu_s: float  # the engine core process alone (with --engine-core process)
    client_cpu_s: float
    ttft: list[float]
    itl: list[float]
    steady_tok_s: float  # while every stream was streaming: from the last first token to the first last one
    steal: float  # the host's share of our CPUs meanwhile (machine_ticks)
    window: tuple[float, float]  # what was measured (time.time())

    @property
    def front_cpu_s(self) -> float:
        """The server's front end alone."""
        return self.server_cpu_s - self.core_cpu_s

    def line(self) -> str:
        busy = (self.server_cpu_s + self.client_cpu_s) / self.wall_s  # of os.cpu_count() cores
        return (f"{self.tokens / self.wall_s:8.0f} tok/s {self.messages / self.wall_s:8.0f} msg/s  "
                f"cpu server {self.server_cpu_s:5.2f}s (core {self.core_cpu_s:5.2f}s) "
                f"client {self.client_cpu_s:5.2f}s ({busy:4.2f} of {os.cpu_count()} cores busy, "
                f"steal {self.steal:4.0%})  "
                f"ttft p50/p99 {percentile(self.ttft, 0.5) * 1000:6.1f}/{percentile(self.ttft, 0.99) * 1000:6.1f} ms  "
                f"itl p50/p99 {percentile(self.itl, 0.5) * 1000:6.1f}/{percentile(self.itl, 0.99) * 1000:6.1f} ms")


def generate_load(server: Server, streams: int, new_tokens: int, prompts: list[list[int]],
                  adapters: list[str], clients: int, sustain_s: float | None = None,
                  exact: bool = True) -> LoadResult:
    """`streams` concurrent streams from `clients` processes, all starting at once.

    Burst (`sustain_s` None): one request per stream, measured from the start to the last token, so the
    intake of the synchronized burst counts in full. Sustained: every stream sends its next request as
    soon as its last one ends, and the figures cover `sustain_s` seconds after a settling period as long
    as one request (the tokens that arrived in that window, the requests sent in it, each process's CPU
    over it), so every request's turnaround counts but the one-off burst at the start does not."""
    start_at = time.time() + LOAD_START_S
    window = None
    if sustain_s is not None:
        settle = max(1.0, new_tokens * 0.015)
        window = (start_at + settle, start_at + settle + sustain_s)
    per = [streams // clients + (1 if i < streams % clients else 0) for i in range(clients)]
    procs, first = [], 0
    for n in per:
        spec = {"address": server.address, "streams": n, "first": first, "new_tokens": new_tokens,
                "prompts": prompts, "adapters": adapters, "channels": max(1, n // 64), "start_at": start_at,
                "until": window[1] if window else None, "window": window}
        first += n
        procs.append(subprocess.Popen(bench_command("serving_overhead", "_client", json.dumps(spec)), cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE))
    server_cpu, ticks = [], []
    for moment in window or (start_at,):
        while time.time() < moment - 0.05:
            time.sleep(0.01)
        time.sleep(max(0.0, moment - time.time()))
        server_cpu.append(server.cpu_seconds())
        ticks.append(machine_ticks())
    outs = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    if window is None:
        server_cpu.append(server.cpu_seconds())
        ticks.append(machine_ticks())
    requests = [r for o in outs for r in o["requests"]]
    assert not exact or all(r["tokens"] == r["length"] for r in requests), "a request ended short"
    lo, hi = window or (start_at, max(r["arrivals"][-1] for r in requests))
    tokens = messages = 0
    itl, ttft = [], []
    for r in requests:
        in_window = [(t, n) for t, n in zip(r["arrivals"], r["counts"], strict=True) if lo <= t <= hi]
        tokens += sum(n for _, n in in_window)
        messages += len(in_window)
        itl += [b - a for a, b in itertools.pairwise(r["arrivals"]) if lo <= b <= hi]
        if lo <= r["sent"] <= hi:
            ttft.append(r["arrivals"][0] - r["sent"])
    steady = float("nan")
    if window is None:  # while every stream was streaming: the last first token to the first last one
        s_lo, s_hi = max(r["arrivals"][0] for r in requests), min(r["arrivals"][-1] for r in requests)
        if s_hi > s_lo:
            steady = sum(n for r in requests for t, n in zip(r["arrivals"], r["counts"], strict=True)
                         if s_lo < t <= s_hi) / (s_hi - s_lo)
    (front0, core0), (front1, core1) = server_cpu
    return LoadResult(tokens, messages, hi - lo, front1 + core1 - front0 - core0, core1 - core0,
                      sum(o["cpu_s"] for o in outs), ttft, itl, steady, steal_between(*ticks), (lo, hi))


# ---- regimes -----------------------------------------------------------------------------------------

ROUNDS_PER_TURN = 2  # the real regime's
SIM_PROMPT_TOKENS = 32
SIM_PROMPTS = [[(i * 31 + j) % 200 + 3 for j in range(SIM_PROMPT_TOKENS)] for i in range(64)]


def start_sim_server(engine_core: str, step_ms: float, streams: int, new_tokens_limit: int, tmp: Path,
                     async_scheduling: str = "on", stream_interval: int = 1) -> Server:
    """The simulated-accelerator server, sized so `streams` requests run (and prefill) in one step."""
    # --async-scheduling on: the stand-in is an accelerator (auto turns it on for one, off on CPU)
    args = ["--engine-core", engine_core, "--async-scheduling", async_scheduling,
            "--stream-interval", str(stream_interval), "--model", "builtin:tiny",
            "--device", "cpu",
            "--max-num-seqs", str(streams), "--max-queue", str(streams),
            "--max-num-batched-tokens", str(streams * SIM_PROMPT_TOKENS),
            "--kv-cache-bytes", str(64 << 20), "--max-new-tokens-limit", str(new_tokens_limit)]
    trace = tmp / f"steps-{time.monotonic_ns()}.txt"
    server = start_server(bench_command("serving_overhead", "_serve_sim", str(step_ms), str(trace), "--"), args, tmp)
    server.trace = trace
    return server


def run_sim(args: argparse.Namespace, tmp: Path) -> float | None:
    result_256 = None
    prompts = SIM_PROMPTS
    for engine_core, overlap, interval, step_ms, streams in itertools.product(
            args.engine_core, args.async_scheduling, args.stream_interval, args.sim_step_ms, args.streams):
        server = start_sim_server(engine_core, step_ms, streams, args.sim_new_tokens * 2, tmp, overlap, interval)
        try:
            generate_load(server, min(streams, 16), 8, prompts, [], 1)  # warm-up
            runs = [(load, generate_load(server, streams, args.sim_new_tokens, prompts, [], args.clients,
                                         args.sustain_s if load == "sustained" else None))
                    for load in args.load]
        finally:
            server.stop()
        ideal = streams * 1000.0 / step_ms
        for load, r in runs:
            eff = r.tokens / r.wall_s / ideal
            steady = f" (steady state {r.steady_tok_s / ideal:.3f})" if load == "burst" else ""
            assert server.trace is not None
            device = StepTrace.read(server.trace, r.window).line(step_ms, streams)
            print(f"sim core={engine_core:7s} async={overlap:3s} interval={interval} step {step_ms:4.1f} ms, "
                  f"{streams:5d} streams, {load:9s}: {r.line()}  "
                  f"tokens/msg {r.tokens / r.messages:4.2f}  efficiency {eff:.3f}{steady} | {device}", flush=True)
            last = (args.engine_core[-1], args.async_scheduling[-1], args.stream_interval[-1], args.load[-1])
            if streams == 256 and step_ms == 10 and (engine_core, overlap, interval, load) == last:
                result_256 = eff
    return result_256


def run_stalled_reader(args: argparse.Namespace, tmp: Path) -> None:
    """64 streams at a 10 ms step, alone and beside a client that stops reading: the others'
    inter-token p99 must stay within 1.2x."""
    streams, step_ms, prompts = 64, 10.0, SIM_PROMPTS
    server = start_sim_server(args.engine_core[-1], step_ms, streams + 1, 1000, tmp)  # + the stalled stream
    stalled = None
    try:
        generate_load(server, 16, 8, prompts, [], 1)  # warm-up
        alone = generate_load(server, streams, args.sim_new_tokens, prompts, [], args.clients)
        stalled = subprocess.Popen(bench_command("serving_overhead", "_stalled", server.address, "1000"), cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
        assert stalled.stdout is not None and stalled.stdout.readline().strip() == b"STALLED"
        beside = generate_load(server, streams, args.sim_new_tokens, prompts, [], args.clients)
    finally:
        if stalled is not None:
            stalled.kill()
            stalled.wait()
        server.stop()
    p99 = [statistics.quantiles(r.itl, n=100)[98] * 1000 for r in (alone, beside)]
    print(f"stalled reader, 64 streams at 10 ms: alone {alone.line()}", flush=True)
    print(f"stalled reader, 64 streams at 10 ms: beside a client that stopped reading {beside.line()}", flush=True)
    print(f"stalled reader: others' inter-token p99 {p99[1]:.1f} ms vs {p99[0]:.1f} ms alone: "
          f"ratio {p99[1] / p99[0]:.2f} (target <= 1.2)", flush=True)


def make_small_checkpoint(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SMALL_MODEL, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


class InProcess:
    """The EngineCore stepping requests itself, no transport at all: the real regime's baseline."""

    def __init__(self, model: str, adapters: dict[str, str], streams: int, max_loras: int,
                 tokenizer: str = "byte", dtype: str = "float32") -> None:
        from inference_service.engine.config import EngineConfig
        from inference_service.engine.in_process import EngineCore

        self.core = EngineCore(EngineConfig(model=model, device="cpu", dtype=dtype, tokenizer=tokenizer,
                                            max_loras=max_loras, max_num_seqs=streams))
        self.names, self.streams, self.rounds = list(adapters), streams, 0
        for name, uri in adapters.items():
            self.core.lora.load_adapter(name, uri, preload=True)
        while self.core.lora.has_pending_work():
            self.core.step()
            time.sleep(0.001)

    def once(self, new_tokens: int, prompts: list[list[int]],
             on_step: Callable[[int], None] = lambda tokens: None) -> tuple[int, float, float]:
        """One round of `streams` requests: tokens, seconds, and CPU seconds (all its threads: torch's too);
        `on_step` after each step, with the tokens it made."""
        from inference_service.engine.request import Request, SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        self.rounds += 1
        for i in range(self.streams):
            adapter = self.names[i % len(self.names)] if self.names else None
            self.core.add_request(Request(f"r{self.rounds}-{i}", list(prompts[i % len(prompts)]), params), adapter)
        t0, cpu0, tokens = time.perf_counter(), time.process_time(), 0
        while self.core.has_work() or self.core.lora.has_pending_work():
            made = sum(len(o.new_token_ids) for o in self.core.step())
            tokens += made
            on_step(made)
        assert tokens == self.streams * new_tokens, tokens
        return tokens, time.perf_counter() - t0, time.process_time() - cpu0


@dataclass
class Turn:
    """Consecutive rounds on one side: its tokens/s and CPU per token over them."""
    tok_s: float
    cpu_per_token: float

    @classmethod
    def of(cls, rounds: list[tuple[int, float, float]]) -> Turn:
        tokens = sum(t for t, _, _ in rounds)
        return cls(tokens / sum(s for _, s, _ in rounds), sum(c for _, _, c in rounds) / tokens)


def us_per_token(runs: list[LoadResult], part: str) -> float:
    """The median over `runs` of one of their CPU seconds (`part`) per token, in microseconds."""
    return statistics.median(getattr(r, part) / r.tokens for r in runs) * 1e6


def inprocess_beside_bare(inproc: InProcess, new_tokens: int, prompts: list[list[int]],
                          tmp: Path) -> tuple[Turn, LoadResult]:
    """The in-process engine's tokens/s over a turn while, after each of its steps, a bare grpc.aio
    server (`serve_bare`) writes a message per token it made to as many streams of the same load generator
    the gRPC side uses: the cheapest front end there can be, on the same machine. A gRPC server here does
    at least that server's and that client's work per token on top of the model's, so this is a reference
    for what the gRPC side can reach here (`--floor`; not a strict bound: its turns vary as the engine's do)."""
    import socket

    from harness.ports import free_port

    signal_port = free_port()
    bare = start_server(bench_command("serving_overhead", "_serve_bare", str(signal_port), "--"), [], tmp)
    signal = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        loads: list[LoadResult] = []
        load = threading.Thread(target=lambda: loads.append(
            generate_load(bare, inproc.streams, 1 << 20, prompts, [], 1, exact=False)))
        load.start()
        time.sleep(LOAD_START_S + 0.3)  # every stream open
        to = ("127.0.0.1", signal_port)
        turn = Turn.of([inproc.once(new_tokens, prompts, lambda made: signal.sendto(b"%d" % made, to))
                        for _ in range(ROUNDS_PER_TURN)])
        signal.sendto(b"e", to)
        load.join()
    finally:
        signal.close()
        bare.stop()
    return turn, loads[0]


def run_real(args: argparse.Namespace, tmp: Path) -> float:
    import torch

    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.engine.heap import freeze_startup_objects
    from inference_service.models.config import ModelConfig
    from inference_service.models.gguf import GGUFFile

    checkpoint, tokenizer = (Path(args.model), "auto") if args.model else (
        make_small_checkpoint(tmp / "small-model"), "byte")
    config = ModelConfig.from_hf(GGUFFile(checkpoint).hf_config() if checkpoint.suffix == ".gguf"
                                 else json.loads((checkpoint / "config.json").read_text()))
    adapters = {f"a{i}": write_peft_adapter(tmp / f"a{i}", config, rank=8, seed=i).as_uri() for i in range(8)}
    streams, new_tokens = args.real_streams, 64
    prompts = [[(i * 131 + j * 7) % min(31000, config.vocab_size - 100) + 100 for j in range(32)]
               for i in range(streams)]
    ratios = []
    default_threads = torch.get_num_threads()
    for threads, engine_core, (label, used) in itertools.product(
            args.model_threads, args.engine_core, (("base", {}), ("8 adapters / 4 slots", adapters))):
        torch.set_num_threads(threads or default_threads)  # this thread steps the in-process engine
        inproc = InProcess(str(checkpoint), used, streams, 4, tokenizer, args.dtype)
        server = start_server([sys.executable, "-m", "inference_service.cli"],
                              ["--engine-core", engine_core,
                               "--model", str(checkpoint), "--device", "cpu", "--dtype", args.dtype,
                               "--tokenizer", tokenizer, "--max-loras", "4",
                               "--max-num-seqs", str(streams),
                               "--adapter-source-allow", tmp.as_uri()], tmp, threads or None)
        try:
            from inference_service.client import InferenceClient

            with InferenceClient(server.address) as c:
                for name, uri in used.items():
                    c.load_adapter(name, uri, timeout=120)
            inproc.once(new_tokens, prompts)  # warm-up, both
            generate_load(server, streams, new_tokens, prompts, list(used), 1)
            freeze_startup_objects()  # as the server's processes do: no full collection over torch's objects
            # A round is ~1 s here and this machine's speed drifts 20% between rounds, so the two sides
            # take turns and the figure is the median of the turns' ratios. A turn is two rounds: with 8
            # adapters over 4 slots, the slots a round leaves behind make the next one alternately fast
            # and slow, on both sides.
            turns, grpc_runs = [], []
            for _ in range(args.real_turns):
                inproc_turn = Turn.of([inproc.once(new_tokens, prompts) for _ in range(ROUNDS_PER_TURN)])
                runs = [generate_load(server, streams, new_tokens, prompts, list(used), 1)
                        for _ in range(ROUNDS_PER_TURN)]
                grpc_runs += runs
                turns.append((inproc_turn, Turn.of([(r.tokens, r.wall_s, r.server_cpu_s + r.client_cpu_s)
                                                    for r in runs])))
            server.stop()  # the floor's engine runs beside the bare server alone
            inproc_tok_s = statistics.median(i.tok_s for i, _ in turns)
            floor = [inprocess_beside_bare(inproc, new_tokens, prompts, tmp)
                     for _ in range(args.real_turns)] if args.floor else []
        finally:
            server.stop()
            inproc.core.shutdown()
        turn_ratios = [g.tok_s / i.tok_s for i, g in turns]
        ratio = statistics.median(turn_ratios)
        if engine_core == args.engine_core[-1] and threads == args.model_threads[0]:
            ratios.append(ratio)
        # Both runs keep every core busy here, so the ratio cannot beat the CPU each token costs:
        # the model's (in-process) against the model's + the front end's + the load generator's.
        inproc_cpu = statistics.median(i.cpu_per_token for i, _ in turns)
        grpc_cpu = statistics.median(g.cpu_per_token for _, g in turns)
        best = max(grpc_runs, key=lambda r: r.tokens / r.wall_s)
        shown_threads = f"{threads} torch thread(s)" if threads else f"all {default_threads} torch threads"
        print(f"real core={engine_core:7s} model on {shown_threads}, {label:22s}: in-process "
              f"{inproc_tok_s:6.0f} tok/s, gRPC "
              f"{statistics.median(g.tok_s for _, g in turns):6.0f} tok/s (medians of {len(turns)} turns of "
              f"{ROUNDS_PER_TURN} rounds; turns' in-process/gRPC tok/s "
              f"{' '.join(f'{i.tok_s:.0f}/{g.tok_s:.0f}' for i, g in turns)}) | gRPC's best round: {best.line()} | "
              f"ratio per turn {' '.join(f'{x:.3f}' for x in turn_ratios)}, median {ratio:.3f} | "
              f"CPU per token (medians): in-process {inproc_cpu * 1e6:.0f} us, gRPC server + client "
              f"{grpc_cpu * 1e6:.0f} us (engine core process {us_per_token(grpc_runs, 'core_cpu_s'):.0f}, front end "
              f"{us_per_token(grpc_runs, 'front_cpu_s'):.0f}, load generator "
              f"{us_per_token(grpc_runs, 'client_cpu_s'):.0f}): CPU-bound ceiling {inproc_cpu / grpc_cpu:.3f} | steal "
              f"{statistics.median(r.steal for r in grpc_runs):.0%}", flush=True)
        if floor:
            floor_tok_s = statistics.median(t.tok_s for t, _ in floor)
            bound, bare_runs = floor_tok_s / inproc_tok_s, [r for _, r in floor]
            print(f"real floor, model on {shown_threads}, {label:22s}: in-process with a bare grpc.aio server "
                  f"writing each step's tokens to the same load generator: {floor_tok_s:.0f} tok/s (turns "
                  f"{' '.join(f'{t.tok_s:.0f}' for t, _ in floor)}): {bound:.3f} of in-process alone, what the "
                  f"cheapest front end on grpc.aio costs the engine here; gRPC reached {ratio / bound:.3f} of that | "
                  f"CPU per token (medians): model {statistics.median(t.cpu_per_token for t, _ in floor) * 1e6:.0f} "
                  f"us, bare server {us_per_token(bare_runs, 'server_cpu_s'):.0f} us, load generator "
                  f"{us_per_token(bare_runs, 'client_cpu_s'):.0f} us", flush=True)
    return min(ratios)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        client_main(sys.argv[2])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_stalled":
        stalled_reader_main(sys.argv[2], int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_serve_sim":
        return serve_simulated(float(sys.argv[2]), sys.argv[3], sys.argv[5:])
    if len(sys.argv) > 1 and sys.argv[1] == "_serve_bare":
        serve_bare(int(sys.argv[2]), sys.argv[sys.argv.index("--listen") + 1])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("regime", nargs="?", choices=("sim", "stalled", "real", "both"), default="both",
                   help="both: sim, stalled and real")
    p.add_argument("--sim-step-ms", type=lambda s: [float(x) for x in s.split(",")], default=[5.0, 10.0])
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    p.add_argument("--sim-new-tokens", type=int, default=128)
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--load", type=lambda s: s.split(","), default=["burst", "sustained"],
                   help="burst: one request per stream, all sent at once, measured to the last token; "
                   "sustained: each stream sends its next request when the last ends, measured over "
                   "--sustain-s after settling (the RESULT uses the last)")
    p.add_argument("--sustain-s", type=float, default=8.0)
    p.add_argument("--real-streams", type=int, default=32)
    p.add_argument("--model", default="", help="the real regime's model: a .gguf file or a Hugging Face checkpoint "
                   "directory (default: a random hidden-256 4-layer LLaMA with a byte-level tokenizer)")
    p.add_argument("--model-threads", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1],
                   help="the real regime's torch threads on both sides; 0: torch's default (every core; the "
                   "RESULT uses the first); 1 leaves a core to the serving layer and the load generator, as an "
                   "accelerator would")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="the real regime's reference: the in-process engine with a bare grpc.aio server writing "
                   "each of its steps' tokens to the load generator")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the real regime's dtype (bfloat16: AMX and the decode stack where the CPU has AMX)")
    p.add_argument("--real-turns", type=int, default=5,
                   help=f"turns the in-process and gRPC sides take, {ROUNDS_PER_TURN} rounds each")
    p.add_argument("--stream-interval", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                   help="the simulated servers' --stream-interval (1: a message per token; the RESULT uses the "
                   "last: the issue allows coalescing at 256 streams)")
    p.add_argument("--async-scheduling", type=lambda s: s.split(","), default=["on"],
                   help="the simulated servers' --async-scheduling; off,on compares (the RESULT uses the last)")
    p.add_argument("--engine-core", type=lambda s: s.split(","), default=["process"],
                   help="thread,process compares the two (the RESULT lines use the last)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        eff = run_sim(args, Path(tmp)) if args.regime in ("sim", "both") else None
        if args.regime in ("stalled", "both"):
            run_stalled_reader(args, Path(tmp))
        ratio = run_real(args, Path(tmp)) if args.regime in ("real", "both") else None
    if eff is not None:
        print_result("serving_efficiency_256", eff)
    if ratio is not None:
        print_result("grpc_vs_inprocess_small_model", ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
