"""One engine step of prefill over cached context, profiled: where a prefix-cache hit's time goes.

In-process EngineCore (no server) on bench/prefix_cache.py's small model: CONVERSATIONS requests
that each find SYSTEM + HISTORY tokens cached and prefill NEW more, all in one step (as turns 3+
of the bench do). Prints the step's wall time (median of --reps) and torch.profiler's top ops of
one step.

    .venv/bin/python -m bench.prefix_cache_step [--conversations 8] [--history 200] [--new 40]

Last line: RESULT prefix_cache_hit_step_ms=<median wall time of the step>
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.bench import print_result

ROOT = Path(os.environ.get("LORAPLEX_ROOT", Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--system", type=int, default=300)
    p.add_argument("--history", type=int, default=200, help="tokens of each conversation's own cached history")
    p.add_argument("--new", type=int, default=40, help="uncached tokens each request prefills in the step")
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()

    import torch

    from harness.bench import PREFIX_CACHE_MODEL, make_small_model_and_adapters

    print(f"root {ROOT}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(prefix="pc-step-") as tmp:
        return _run(args, make_small_model_and_adapters(Path(tmp), (), PREFIX_CACHE_MODEL))


def _run(args: argparse.Namespace, model: Path) -> int:
    from torch.profiler import ProfilerActivity, profile

    from inference_service.engine.config import EngineConfig
    from inference_service.engine.core import EngineCore
    from inference_service.engine.request import Request, SamplingParams

    core = EngineCore(EngineConfig(model=str(model), device="cpu", tokenizer="byte", max_loras=4, max_lora_rank=16,
                                   kv_cache_bytes=256 << 20, async_scheduling="off", prefix_cache=True))
    rng = random.Random(0)
    system = [rng.randrange(32, 127) for _ in range(args.system)]
    histories = [system + [rng.randrange(32, 127) for _ in range(args.history)] for _ in range(args.conversations)]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    counter = iter(range(10**9))

    def run_all(prompts: list[list[int]], timed: bool) -> float:
        for prompt in prompts:
            core.add_request(Request(f"r{next(counter)}", prompt, params), None)
        started = time.perf_counter()
        first = core.step()
        elapsed = time.perf_counter() - started
        while core.has_work():
            core.step()
        if timed:
            assert all(o.cached_tokens > 0 for o in first if o.finished), "the step did not hit the cache"
        return elapsed

    run_all([h + [1] for h in histories], timed=False)  # caches every history's full blocks

    def tails() -> list[list[int]]:  # the same cached histories, a fresh tail each time
        return [h + [rng.randrange(32, 127) for _ in range(args.new)] for h in histories]

    for _ in range(3):
        run_all(tails(), timed=False)
    times = [run_all(tails(), timed=True) for _ in range(args.reps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_all(tails(), timed=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    print(f"step ms: median {1000 * statistics.median(times):.1f} min {1000 * min(times):.1f} "
          f"max {1000 * max(times):.1f} over {len(times)}")
    print_result("prefix_cache_hit_step_ms", 1000 * statistics.median(times), ".1f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
