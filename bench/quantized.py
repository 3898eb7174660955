"""Quantized base weights against bf16 on the same GGUF file, in one process (`--weights-dtype`).

The real model's file (SmolLM2-135M-Instruct, Q4_1) is served three times: `bf16`, every weight
dequantized to bf16 at load (what the engine did before), and `q8_0` / `q4_0`, every projection and
the LM head quantized to that type at load by gguf-py (llama.cpp's rounding) and read as blocks by
kernels/quant_linear.c. The engines take turns (ROUNDS rounds, each timing batch 1, 8 and 32 on the
base model and batch 32 over 8 resident adapters), so a busy host's slow seconds fall on both; each figure is the median
decode step (prefill excluded, in-process EngineCore.step, as bench/roofline.py times it), and the
ratios compare the medians over the rounds. Run it with nothing else on the machine; the load
average is printed before and after.

RESULT q8_vs_bf16_batch1=<bf16 step time / q8_0 step time at batch 1> (above 1: Q8_0 is faster),
RESULT q8_vs_bf16_batch8=, RESULT q8_vs_bf16_batch32=, RESULT q8_vs_bf16_lora8_batch32=, and the same
for q4.

Where llama.cpp's server is built (scripts/install_llamacpp.sh, or `--llamacpp DIR`), the two servers
are then compared through HTTP on one 4-bit file: llama-quantize rewrites the model as Q4_0, which
our server keeps quantized (`--weights-dtype auto`) and llama-server reads as it is, both on every
CPU of the machine (32 slots and `--max-num-seqs 32`), both up at once and idle in turn. The same
client (harness/http_streams.py) streams the same text prompts, greedy with EOS ignored, 128 tokens
each: one stream at a time (its decode rate after the first token, the median of 3) and 32 at once
(every token over the burst's wall time), alternating servers over `--peer-rounds` rounds:
RESULT batch1_vs_llamacpp_q4=<our single-stream rate / llama.cpp's> (medians over the rounds),
RESULT batch32_vs_llamacpp_q4=<the same for 32 streams>. `--peer-only` skips the in-process part.

`--projection` instead times one projection (SmolLM2's gate_up, 3072 x 576, bf16 activations, random
weights) at 1, 8 and 32 rows in every build of the kernel this CPU runs (x86-64-v3: AVX2; avx512-bf16:
AVX-512 VNNI; sapphirerapids: AMX-INT8 tiles from 16 rows), each compiled here, against oneDNN's packed
bf16 GEMM: the best of 30 calls each.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import best_of, load_line, print_result, start_http_server
from harness.engine_helpers import load_adapters
from harness.http_streams import aggregate_rate, run_streams, served_model, single_stream_rate
from harness.llamacpp import INSTALL_HINT, llamacpp_bin, requantize, start_llama_server
from harness.roofline import decode_step_s, mixed_adapters, real_model_parser, real_model_start
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.kernels import bindings, build, quant_linear, variants
from inference_service.models.linear import OneDNNWeight
from inference_service.models.quantized import quantize_blocks

ROUNDS = 3
WEIGHTS = ("bf16", "q8_0", "q4_0")
WORKLOADS = (("batch1", 1, False), ("batch8", 8, False), ("batch32", 32, False), ("lora8_batch32", 32, True))
ADAPTERS = 8


def engine(model: str, dtype: str, weights_dtype: str) -> EngineCore:
    return EngineCore(EngineConfig(model=model, device="cpu", dtype=dtype, weights_dtype=weights_dtype,
                                   max_loras="auto", max_lora_rank=16, max_num_seqs=32,
                                   max_num_batched_tokens=4096, kv_cache_bytes=256 << 20))


PROJECTION = (3072, 576)  # gate_up's out and in features
PROJECTION_ROWS = (1, 8, 32)
PROJECTION_BUILDS = ("x86-64-v3", "avx512-bf16", "sapphirerapids")


def time_projection() -> None:
    """One projection in each kernel build this CPU runs, against oneDNN's bf16 GEMM."""
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}", flush=True)
    n, k = PROJECTION
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    dense = OneDNNWeight(weight.bfloat16())
    compiler = build.find_compiler()
    assert compiler is not None, "no C compiler"
    flags = variants.cpu_flags()
    with tempfile.TemporaryDirectory() as tmp:
        for type_name in quant_linear.TYPES:
            blocks = quantize_blocks(weight.numpy(), type_name).blocks
            packed = quant_linear.pack(type_name, blocks, n, k, torch.bfloat16)
            assert packed is not None
            for variant in (v for v in variants.X86_64 if v.name in PROJECTION_BUILDS and v.requires <= flags):
                library = Path(tmp) / f"{variant.name}.so"
                build.compile_library(compiler, "quant_linear", variant.flags, library)
                symbol = f"quant_linear_{type_name.lower()}_bf16"
                fn = getattr(ctypes.CDLL(str(library)), symbol)
                signature = bindings.LIBRARIES["quant_linear"][symbol]
                fn.restype, fn.argtypes = signature.restype, list(signature.argtypes)
                for rows in PROJECTION_ROWS:
                    x = torch.randn(rows, k).bfloat16()
                    out = torch.empty(rows, n, dtype=torch.bfloat16)

                    def call(x=x, out=out, rows=rows, fn=fn, packed=packed) -> None:
                        fn(x.data_ptr(), packed.storage.data_ptr(), None, out.data_ptr(), rows, n, k, 0)

                    call()
                    ours, theirs = best_of(call, 30), best_of(lambda x=x: dense(x, None), 30)
                    print(f"{type_name} {variant.name:>12} rows {rows:>2}: {ours * 1e6:7.0f} us, oneDNN bf16 "
                          f"{theirs * 1e6:7.0f} us ({theirs / ours:.2f}x)", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


PEER_ROUNDS = 3
PEER_STREAMS = 32
PEER_SINGLE = 3  # single streams per round
PEER_TOKENS = 128
SUBJECTS = ("a lighthouse keeper", "a city under the sea", "the first winter on Mars", "a lost violin",
            "a clockmaker's apprentice", "a river that runs uphill", "an old library at night", "a robot gardener",
            "the last train home", "a village of kite makers", "a map with no edges", "a storm over the desert",
            "a cat who collects keys", "the quiet moon", "a bakery at dawn", "an island of mirrors",
            "a forgotten satellite", "a letter never sent", "the tallest tree", "a ship made of glass",
            "a market in the clouds", "an orchestra of frogs", "a door in the hillside", "the museum of rain",
            "a balloon race", "a chess game lasting years", "the sound of snow", "a garden on a rooftop",
            "a bridge between two towers", "a lantern festival", "a fox who learned to read", "the end of a map")
PROMPTS = tuple(f"Here is a long, detailed story about {subject}, told from the beginning:" for subject in SUBJECTS)


def compare_with_llamacpp(source: Path, bin_dir: Path, rounds: int, tmp: Path) -> None:
    """Our HTTP server and llama-server on the same Q4_0 file, the same client and prompts, alternating."""
    threads = os.cpu_count() or 1
    q4 = requantize(bin_dir, source, tmp / f"{source.stem}.Q4_0.gguf", "Q4_0", threads)
    print(f"peer comparison on {q4.name} ({q4.stat().st_size / 2**20:.0f} MiB), {threads} threads each; "
          f"{load_line('start')}", flush=True)
    ours = start_http_server(["--model", str(q4), "--weights-dtype", "auto", "--max-num-seqs", str(PEER_STREAMS),
                              "--log-level", "WARNING"], tmp / "loraplex.log")
    try:
        theirs = start_llama_server(bin_dir, q4, PEER_STREAMS, 256 + PEER_TOKENS, threads, tmp / "llama-server.log")
        try:
            servers = {"loraplex": ours.url, "llama.cpp": theirs.url}
            models = {name: served_model(url) for name, url in servers.items()}
            print(", ".join(f"{name} at {url} serves {models[name]!r}" for name, url in servers.items()), flush=True)
            for name, url in servers.items():  # warm-up: the first requests' one-off costs fall here
                run_streams(url, models[name], PROMPTS, PEER_STREAMS, 16)
            rates: dict[tuple[str, str], list[float]] = {}
            for round_ in range(rounds):
                for name, url in servers.items():
                    single = single_stream_rate(run_streams(url, models[name], PROMPTS[:PEER_SINGLE], 1, PEER_TOKENS))
                    burst = aggregate_rate(run_streams(url, models[name], PROMPTS, PEER_STREAMS, PEER_TOKENS))
                    rates.setdefault((name, "batch1"), []).append(single)
                    rates.setdefault((name, "batch32"), []).append(burst)
                    print(f"round {round_} {name:>9}: 1 stream {single:6.1f} tok/s, {PEER_STREAMS} streams "
                          f"{burst:6.1f} tok/s; {load_line('now')}", flush=True)
        finally:
            theirs.stop()
    finally:
        ours.stop()
    print(load_line("end"), flush=True)
    for workload in ("batch1", "batch32"):
        ratio = statistics.median(rates[("loraplex", workload)]) / statistics.median(rates[("llama.cpp", workload)])
        print_result(f"{workload}_vs_llamacpp_q4", ratio, ".2f")


def in_process(model: str, args: argparse.Namespace) -> None:
    """The three engines in this process, in turns (the module docstring)."""
    engines = {weights: engine(model, args.dtype, weights) for weights in WEIGHTS}
    for weights, core in engines.items():
        saved = core.runner.model.weight_bytes_saved
        print(f"{weights}: decode stack {'on' if core.runner.decode_stack else 'off'}, "
              f"weights {saved / 2**20:.1f} MiB smaller than dense", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = mixed_adapters(Path(tmp), engines["bf16"].runner.model.config, ADAPTERS)
        for core in engines.values():
            load_adapters(core, adapters)
        steps: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds):
            for name, batch, lora in WORKLOADS:
                names: list[str | None] = list(adapters) if lora else [None]
                for weights, core in engines.items():
                    step, _ = decode_step_s(core, batch, names, f"{weights}-{name}-{round_}")
                    steps.setdefault((weights, name), []).append(step)
                    print(f"round {round_} {name:>14} {weights:>5}: {step * 1e3:7.2f} ms/step, "
                          f"{batch / step:7.1f} tok/s", flush=True)
    for core in engines.values():
        core.shutdown()
    print(f"load average at end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; torch threads "
          f"{torch.get_num_threads()}")
    for weights in WEIGHTS[1:]:
        for name, _, _ in WORKLOADS:
            ratio = statistics.median(steps[("bf16", name)]) / statistics.median(steps[(weights, name)])
            print_result(f"{weights[:2]}_vs_bf16_{name}", ratio, ".2f")


def main() -> None:
    parser = real_model_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--projection", action="store_true", help="time one projection per kernel build instead")
    parser.add_argument("--llamacpp", default="", help="llama.cpp's bin directory (default: .tools/llama.cpp/bin)")
    parser.add_argument("--peer-rounds", type=int, default=PEER_ROUNDS)
    parser.add_argument("--peer-only", action="store_true", help="only the comparison with llama.cpp's server")
    args = parser.parse_args()
    if args.projection:
        time_projection()
        return
    model, _ = real_model_start(args)
    bin_dir = llamacpp_bin(args.llamacpp)
    if bin_dir is None:
        print(f"llama.cpp's server is not built: no comparison with it ({INSTALL_HINT})", flush=True)
        if args.peer_only:
            raise SystemExit(1)
    if not args.peer_only:
        in_process(model, args)
    if bin_dir is not None:
        with tempfile.TemporaryDirectory() as tmp:
            compare_with_llamacpp(Path(model), bin_dir, args.peer_rounds, Path(tmp))


if __name__ == "__main__":
    main()
