"""What the benchmarks share: one percentile, timing, the RESULT line, the small fixture models and
starting the real server as a subprocess. Benches run as `python -m bench.NAME` from the repository
root; a bench that needs a second process of itself starts `bench_command(NAME)`."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.ports import free_port, wait_http_healthy

ROOT = Path(__file__).resolve().parents[1]

# The serving benches' small LLaMA (random weights, ids as prompts: no tokenizer).
SMALL_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=32000, max_position_embeddings=512)
# The prefix-cache benches' (a byte-sized vocabulary, so text round-trips; long conversations).
PREFIX_CACHE_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=384, max_position_embeddings=4096)
# The in-process engine benches' fixture (wider, 8 heads: the adapter and overlap benches' model).
ENGINE_MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of `values`, interpolated between the nearest ranks (numpy's and
    `statistics.quantiles(method="inclusive")`'s rule); NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """The shortest wall time of `repeats` calls of `fn`, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def print_result(name: str, value: float, fmt: str = ".3f") -> None:
    """The line a bench is scored by: `RESULT name=value`."""
    print(f"RESULT {name}={value:{fmt}}", flush=True)


def load_line(when: str) -> str:
    """`load average at <when>: L on N CPUs`: each bench prints it at its start and end."""
    return f"load average at {when}: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"


def bench_command(name: str, *args: str) -> list[str]:
    """The command line that runs bench `name` (a module of bench/) in a new process; run it with
    cwd=ROOT."""
    return [sys.executable, "-m", f"bench.{name}", *args]


def make_small_model(out: Path, shape: dict[str, int] = SMALL_MODEL) -> Path:
    """Random weights in a Hugging Face checkpoint (save_pretrained), tokenizer-less: prompts are ids."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@dataclass
class HttpServer:
    """`python -m inference_service.cli` with its HTTP API (and gRPC listener) on loopback."""

    process: subprocess.Popen
    url: str  # the HTTP API
    grpc_address: str

    def stop(self, timeout: float = 30) -> None:
        self.process.terminate()
        self.process.wait(timeout)


def start_http_server(cli_args: Sequence[str], log: Path, env: dict[str, str] | None = None,
                      healthy_timeout: float | None = 120.0) -> HttpServer:
    """Starts the real server with `cli_args` (model, device, tuning) plus its own free ports, its
    output in `log`; waits until /health answers unless `healthy_timeout` is None."""
    http_port, grpc_port = free_port(), free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "inference_service.cli", *cli_args, "--listen", f"127.0.0.1:{grpc_port}",
             "--http-port", str(http_port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = HttpServer(process, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
    if healthy_timeout is not None:
        try:
            wait_http_healthy(server.url, process, timeout=healthy_timeout)
        except BaseException:
            server.stop()
            raise
    return server


def make_small_model_and_adapters(tmp: Path, adapters: Sequence[str], shape: dict[str, int] = SMALL_MODEL) -> Path:
    """A small model of `shape` under `tmp`/small and a PEFT adapter per name beside it (ranks 8 and 16
    in turn)."""
    import json

    from inference_service.demo_adapters import write_peft_adapter
    from inference_service.models.config import ModelConfig

    out = make_small_model(tmp / "small", shape)
    model_config = ModelConfig.from_hf(json.loads((out / "config.json").read_text()))
    for i, name in enumerate(adapters):
        write_peft_adapter(tmp / name, model_config, rank=8 * (1 + i % 2), alpha=16.0, seed=i)
    return out
