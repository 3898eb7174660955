"""Many adapters in one batch (S-LoRA's figure): throughput vs distinct adapters, in-process.

Workload: a 4-layer hidden-256 LLaMA; 64 requests submitted at once, 32-token prompts,
64 new tokens each, greedy, EOS ignored. Adapters of ranks 8 and 16 (alternating) on all 7
modules. With A distinct adapters, request i uses adapter i mod A (`uniform`), or one drawn from a
Zipf distribution with s=1 over the A adapters (`zipf`: a few hot adapters, a long tail).

Engines: the default configuration (`--max-loras auto`: the pool sized by memory, paged by rank),
the base model in the same engine (requests without an adapter), and the old fixed-slot pool
(`--baseline-slots` slots of rank 16) as the baseline. Each measurement runs the workload once to
warm up (adapters staged into the host cache, loaded into the pool) and then `--rounds` times, each
round a base-model run and an adapter run in the same engine; the median of the rounds' ratios
counts (the machine's load drifts; alternating puts the drift on both sides of a ratio).
Adapter loads during the timed rounds (when the pool cannot hold every
adapter) count: they are part of serving that many adapters.
Every request must produce exactly `--new-tokens` tokens, and the default pool's tokens must equal
the fixed-slot pool's (the same adapters, greedy) in at least 95% of requests (a near-tie may flip),
else no RESULT and exit status 1.
`--model PATH` (a checkpoint or .gguf, e.g. the real SmolLM2 GGUF) replaces the made-up LLaMA;
`--counts 64 --kinds uniform` measures the one point of 64 requests over 64 adapters.
Last lines: RESULT many_adapters_64_vs_base=<tokens/s at 64 distinct adapters / base> and
RESULT many_adapters_256_zipf_vs_base=<...>.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import inference_service  # first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import print_result
from harness.engine_helpers import load_adapters, run_to_completion
from harness.models import make_checkpoint
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.models.config import ModelConfig

MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512)
COUNTS = (1, 8, 32, 64, 128, 256)


def assignment(count: int, requests: int, kind: str) -> list[int]:
    """The adapter index of each request."""
    if kind == "uniform":
        return [i % count for i in range(requests)]
    weights = torch.tensor([1.0 / (k + 1) for k in range(count)])  # Zipf, s = 1
    gen = torch.Generator().manual_seed(count)
    return torch.multinomial(weights, requests, replacement=True, generator=gen).tolist()


def run(core: EngineCore, prompts: list[list[int]], names: list[str | None], new_tokens: int, tag: str
        ) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        core.add_request(Request(f"{tag}-{i}", prompt, params), name)
    outputs = run_to_completion(core, timeout=3600)
    elapsed = time.perf_counter() - start
    tokens = [[t for o in outputs[f"{tag}-{i}"] for t in o.new_token_ids] for i in range(len(prompts))]
    return sum(map(len, tokens)) / elapsed, tokens


def measure(core: EngineCore, prompts: list[list[int]], names: list[str | None], args: argparse.Namespace,
            tag: str) -> tuple[float, list[list[int]]]:
    """Median tokens/s over the timed rounds (after one warm-up), and the last round's tokens."""
    run(core, prompts, names, args.new_tokens, f"{tag}-warm")
    rates, tokens = [], []
    for r in range(args.rounds):
        rate, tokens = run(core, prompts, names, args.new_tokens, f"{tag}-{r}")
        rates.append(rate)
    return statistics.median(rates), tokens


def measure_against_base(core: EngineCore, prompts: list[list[int]], names: list[str | None],
                         args: argparse.Namespace, tag: str) -> tuple[float, float, list[list[int]]]:
    """Rounds of the base model and of `names` alternated in the same engine (after one warm-up
    of each): the median of the rounds' ratios (drift in the machine's load hits both sides of a
    round alike), the median adapter tokens/s, and the last round's tokens."""
    base_names: list[str | None] = [None] * len(prompts)
    run(core, prompts, base_names, args.new_tokens, f"{tag}-base-warm")
    run(core, prompts, names, args.new_tokens, f"{tag}-warm")
    ratios, rates, tokens = [], [], []
    for r in range(args.rounds):
        base, _ = run(core, prompts, base_names, args.new_tokens, f"{tag}-base-{r}")
        rate, tokens = run(core, prompts, names, args.new_tokens, f"{tag}-{r}")
        ratios.append(rate / base)
        rates.append(rate)
    return statistics.median(ratios), statistics.median(rates), tokens


def engine(checkpoint: Path | str, adapters: dict[str, Path], max_loras: int | str, dtype: str) -> EngineCore:
    """`max_loras` auto: the default configuration (memory budget, pool and KV cache as the server
    sizes them); N: the fixed-slot baseline, with the same KV cache."""
    fixed = max_loras != "auto"
    core = EngineCore(EngineConfig(model=str(checkpoint), device="cpu", dtype=dtype, max_loras=max_loras,
                                   max_lora_rank=16 if fixed else "auto", max_num_seqs=64,
                                   max_num_batched_tokens=2048, kv_cache_bytes=256 << 20 if fixed else None))
    load_adapters(core, adapters)  # registered; loaded into the pool by the requests
    return core


def model_config(model: str) -> ModelConfig:
    """The LoRA-relevant shapes of `--model` (its adapters are made for them)."""
    from inference_service.models.gguf import GGUFFile
    from inference_service.models.source import resolve_model

    source = resolve_model(model, None)
    assert source.path is not None, f"{model}: a checkpoint directory or a .gguf file"
    if source.kind == "gguf":
        return ModelConfig.from_hf(GGUFFile(source.path).hf_config())
    return ModelConfig.from_hf(json.loads((source.path / "config.json").read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per point; the median counts")
    parser.add_argument("--baseline-slots", type=int, default=8, help="slots of the old fixed-slot pool")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)), help="distinct adapters per point")
    parser.add_argument("--kinds", default="uniform,zipf", help="adapter assignments measured")
    parser.add_argument("--model", help="a checkpoint or .gguf to serve (default: a 4-layer hidden-256 LLaMA "
                        "made on the spot)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    counts = [int(c) for c in args.counts.split(",")]
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; OpenMP wait: "
          f"{inference_service.openmp_wait_policy()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model:
            checkpoint, config = args.model, model_config(args.model)
        else:
            checkpoint = make_checkpoint(root / "model", "llama", **MODEL)
            config = ModelConfig.from_hf(json.loads((checkpoint / "config.json").read_text()))
        adapters = {f"ad{i}": write_peft_adapter(root / f"ad{i}", config, rank=8 if i % 2 else 16, alpha=16.0,
                                                 seed=i, scale=0.05)
                    for i in range(max(counts))}
        names_all = list(adapters)
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, config.vocab_size, (args.requests, args.prompt_tokens), generator=gen).tolist()

        auto = engine(checkpoint, adapters, "auto", args.dtype)
        info = auto.model_info
        print(f"default pool: {info.lora_pool_bytes / 2**20:.1f} MiB, pages of rank {info.lora_page_rank}, "
              f"{info.max_loras} adapters of rank {info.max_lora_rank} at once (more of lower ranks); KV cache "
              f"{info.kv_cache_blocks} blocks of {info.kv_block_size}, context {info.max_context}", flush=True)
        base, _ = measure(auto, prompts, [None] * args.requests, args, "base")
        print(f"base model: {base:8.1f} tokens/s", flush=True)
        # The process warms up too: whichever point ran first read ~0.63 of base and the same 64
        # adapters ~0.75 a minute later, in either order of points (its own warm-up run was not enough).
        for w in range(2):
            names = [names_all[a] for a in assignment(min(max(counts), args.requests), args.requests, "uniform")]
            measure_against_base(auto, prompts, list(names), argparse.Namespace(**{**vars(args), "rounds": 1}),
                                 f"process-warm-{w}")
        fixed = engine(checkpoint, adapters, args.baseline_slots, args.dtype)
        results: dict[tuple[str, int], float] = {}
        problems: list[str] = []
        same = total = 0
        for kind in args.kinds.split(","):
            for count in counts:
                names = [names_all[a] for a in assignment(count, args.requests, kind)]
                ratio, ours, ours_tokens = measure_against_base(auto, prompts, list(names), args,
                                                                f"auto-{kind}-{count}")
                old_ratio, old, old_tokens = measure_against_base(fixed, prompts, list(names), args,
                                                                  f"fixed-{kind}-{count}")
                for label, tokens in (("default pool", ours_tokens), ("fixed slots", old_tokens)):
                    if any(len(t) != args.new_tokens for t in tokens):
                        problems.append(f"{kind} {count}: {label}: a request did not make {args.new_tokens} tokens")
                same += sum(a == b for a, b in zip(ours_tokens, old_tokens, strict=True))
                total += len(ours_tokens)
                results[(kind, count)] = ratio
                stats = auto.lora.stats()
                print(f"{kind:7} {count:3} adapters ({len(set(names)):3} distinct in the batch): default pool "
                      f"{ours:8.1f} tok/s = {ratio:.3f} of base; fixed {args.baseline_slots} slots {old:8.1f} "
                      f"= {old_ratio:.3f}; pool {stats.pool_bytes_used / 2**20:.1f}/"
                      f"{stats.pool_bytes_total / 2**20:.1f} MiB, resident by rank {dict(stats.resident_by_rank)}, "
                      f"evictions {dict(stats.evictions_by_cause)}", flush=True)
        auto.shutdown()
        fixed.shutdown()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"{same} of {total} requests made the same tokens in the default pool and the fixed-slot pool")
    if same < 0.95 * total:
        problems.append("the default pool's tokens differ from the fixed-slot pool's in more than 5% of requests")
    if problems:
        sys.exit("no RESULT:\n" + "\n".join(problems))
    if ("uniform", 64) in results:
        print_result("many_adapters_64_vs_base", results[('uniform', 64)])
    if ("zipf", 256) in results:
        print_result("many_adapters_256_zipf_vs_base", results[('zipf', 256)])


if __name__ == "__main__":
    main()
