"""Overlapped adapter loading: does decoding stay steady while adapters churn through slots?

Resident requests decode on their adapters while other adapters (rank 256 on all 7 modules by
default) are staged and copied into the remaining slots at a fixed cadence (one every
`--churn-every` steps), each evicting the least recently used churn adapter. Three modes in one process,
interleaved over `--rounds` runs: no churn, churn with overlapped loads, and churn with
blocking loads (`--no-overlap`-style baseline: preparation and copy on the scheduler thread). Also compares
the slot-load bandwidth with a plain torch copy of the same bytes.

Each run starts a fresh engine, so every churn adapter's first load reads and checks its files
and later ones come from the source's host cache (`--host-cache-bytes 0`: every load reads).
The p99 ratios are taken within each round and the median over rounds is reported (the pooled
ratios are printed too). Why these sizes, this cadence and per-round ratios:
docs/performance.md, "The adapter pool with many adapters".
A churn turn skipped (the previous load still running when the next is due) is a load that
did not happen, which would flatter the ratio: then no RESULT is printed and the exit status is 1
(raise `--churn-every`, or find out why loads fall behind).
Last line: RESULT overlap_p99_itl_ratio=<median over rounds of p99 with churn / p99 without>.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import ENGINE_MODEL as MODEL
from harness.bench import percentile, print_result
from harness.engine_helpers import load_adapters
from harness.models import AdapterSpec, make_adapter, make_checkpoint
from inference_service.device import make_copy_engine
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, SamplingParams
from inference_service.kernels.copy import CopyJob
from inference_service.lora.mem_pool import LoRAMemoryPool
from inference_service.lora.source import LocalDirectorySource
from inference_service.models.loader import load_model
from inference_service.platform import Platform

RESIDENT, CHURN, SLOTS = 4, 8, 8


def measure(checkpoint: Path, resident: dict[str, Path], churn: dict[str, Path], steps: int, churn_every: int,
            overlap: bool, max_rank: int, host_cache_bytes: int, device: str) -> tuple[list[float], int, int]:
    """Inter-token latencies of the resident requests, churn loads completed, and churn turns skipped
    because the previous load had not finished (`churn_every=0`: no churn)."""
    core = EngineCore(EngineConfig(model=str(checkpoint), device=device, max_loras=SLOTS, max_lora_rank=max_rank,
                                   max_num_seqs=64, kv_cache_bytes=128 << 20, overlap_loads=overlap,
                                   host_cache_bytes=host_cache_bytes))
    load_adapters(core, resident, pinned=False, preload=True)
    load_adapters(core, churn)  # registered only: every use below is a cold load
    params = SamplingParams(max_new_tokens=steps + 20, ignore_eos=True)
    for i in range(16):
        core.add_request(Request(f"r{i}", list(range(3, 40)), params), list(resident)[i % RESIDENT])
    for _ in range(3):  # prefill and warm-up
        core.step()
    needed = {core.lora.uid_of(n) for n in resident}
    churn_uids = [core.lora.uid_of(n) for n in churn]
    loads_before = core.lora.loads_total
    itl: list[float] = []
    current: str | None = None
    skipped = 0
    last = time.perf_counter()
    for step in range(steps):
        if churn_every:
            # The same cadence in both modes: every `churn_every` steps the next churn adapter is
            # staged and copied into a slot, evicting the least recently used churn adapter.
            if current is not None and core.lora.slot_of(current) is None:
                core.lora.ensure_loading(current, needed)  # staged by now? then start its slot copy
            if step % churn_every == 0:
                if current is not None and core.lora.slot_of(current) is None:
                    skipped += 1  # the previous load is still running: no second one on top
                else:
                    current = churn_uids[(step // churn_every) % len(churn_uids)]
                    core.lora.ensure_loading(current, needed)
                    core.lora.ensure_loading(current, needed)  # blocking mode: staged already, copy now
        outputs = core.step()
        now = time.perf_counter()
        assert len(outputs) == 16
        itl.append(now - last)
        last = now
    loads = core.lora.loads_total - loads_before
    core.shutdown()
    return itl, loads, skipped


def copy_bandwidth(checkpoint: Path, adapter: Path, max_rank: int, device: str) -> tuple[float, float]:
    """Slot load (staging excluded) vs one torch copy of the same bytes on the same copy engine, in GB/s:
    the engine's own parts (op, slot pool, source, copy engine) as EngineCore assembles them."""
    config = EngineConfig(model=str(checkpoint), device=device)
    plan = Platform.for_device(config.torch_device(), config)
    device, dtype = plan.device, plan.dtype
    model, _ = load_model(config.model, device, dtype, compute=plan.model_compute())
    shapes, op = model.config.lora_shapes(), plan.make_lora_op()
    pool = LoRAMemoryPool(2, max_rank, shapes, device, op.slot_dtype(dtype), op.b_rank_major)
    host = LocalDirectorySource(shapes, max_rank, 0).fetch(str(adapter), None, pool.host_form)  # as a load gets it
    nbytes = host.size_bytes
    engine = make_copy_engine(device, overlap=True)
    copy = pool.copy_into_slot(0, host)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        engine.submit(copy).wait()
        times.append(time.perf_counter() - start)
    src = engine.pin(torch.cat([t.flatten() for a, b, _ in host.modules.values() for t in (a, b)]))
    dst = torch.empty_like(src, device=device)
    plain = []
    for _ in range(10):  # on the same copy engine (thread or stream), so only the work differs
        start = time.perf_counter()
        engine.submit(CopyJob(lambda: dst.copy_(src))).wait()
        plain.append(time.perf_counter() - start)
    engine.close()
    return nbytes / min(times) / 1e9, nbytes / min(plain) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="decode steps per run")
    parser.add_argument("--rounds", type=int, default=7, help="runs of each mode, interleaved")
    parser.add_argument("--churn-rank", type=int, default=256, help="rank of the churning adapters (all 7 modules)")
    parser.add_argument("--churn-every", type=int, default=10, help="start one churn load every N steps")
    parser.add_argument("--host-cache-bytes", type=int, default=EngineConfig.host_cache_bytes,
                        help="the local source's host cache (0: every load reads and checks its files)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = make_checkpoint(root / "model", "llama", **MODEL)
        resident = {f"res{i}": make_adapter(checkpoint, root / f"res{i}", AdapterSpec(f"res{i}", 16, 16, seed=i))
                    for i in range(RESIDENT)}
        rank = args.churn_rank
        churn = {f"churn{i}": make_adapter(checkpoint, root / f"churn{i}", AdapterSpec(f"churn{i}", rank, rank,
                                                                                      seed=100 + i))
                 for i in range(CHURN)}
        modes = [("no churn", 0, True), ("churn, overlapped", args.churn_every, True),
                 ("churn, blocking", args.churn_every, False)]
        results: dict[str, list[float]] = {label: [] for label, _, _ in modes}
        loads = dict.fromkeys(results, 0)
        skipped = dict.fromkeys(results, 0)
        round_ratios: dict[str, list[float]] = {"churn, overlapped": [], "churn, blocking": []}
        # Rounds interleave the modes so that drift in the machine's load hits all three alike.
        for round_index in range(args.rounds):
            p99s = {}
            for label, churn_every, overlap in modes:
                itl, done, missed = measure(checkpoint, resident, churn, args.steps, churn_every, overlap, rank,
                                            args.host_cache_bytes, args.device)
                results[label] += itl
                loads[label] += done
                skipped[label] += missed
                p99s[label] = percentile(itl, 0.99)
            for label, ratios in round_ratios.items():
                ratios.append(p99s[label] / p99s["no churn"])
            print(f"round {round_index}: p99 no churn {p99s['no churn'] * 1e3:.2f} ms; ratio overlapped "
                  f"{round_ratios['churn, overlapped'][-1]:.3f}, blocking {round_ratios['churn, blocking'][-1]:.3f}",
                  flush=True)
        for label, itl in results.items():
            print(f"{label:18s}: p50 {statistics.median(itl) * 1e3:7.2f} ms  p99 {percentile(itl, 0.99) * 1e3:7.2f} ms"
                  f"  ({loads[label]} adapter loads, {skipped[label]} churn turns skipped, {len(itl)} steps)",
                  flush=True)
        load_gbps, plain_gbps = copy_bandwidth(checkpoint, churn["churn0"], rank, args.device)
        print(f"slot load bandwidth {load_gbps:.2f} GB/s vs plain torch copy {plain_gbps:.2f} GB/s "
              f"({load_gbps / plain_gbps:.2f}x)")
    base_p99 = percentile(results["no churn"], 0.99)
    for label in round_ratios:
        print(f"{label:18s}: p99 ratio pooled over rounds {percentile(results[label], 0.99) / base_p99:.3f}, "
              f"median of rounds {statistics.median(round_ratios[label]):.3f}")
    missed = {label: n for label, n in skipped.items() if n}
    expected = args.rounds * len(range(0, args.steps, args.churn_every))
    short = {label: loads[label] for label in round_ratios if loads[label] < expected}
    if missed or short:
        sys.exit(f"no RESULT: churn turns skipped {missed}, or fewer loads than the {expected} turns {short}")
    print_result("overlap_p99_itl_ratio", statistics.median(round_ratios['churn, overlapped']))


if __name__ == "__main__":
    main()
