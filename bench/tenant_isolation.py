"""Tenant isolation in the adapter pool: does a noisy tenant's adapter churn reach quiet tenants?

Workload: builtin:tiny on the CPU, in-process (real staging threads and slot copies), every
adapter rank 8 on all 7 modules. Two quiet tenants keep 4 adapters each busy: each adapter has one
request at a time (16-token prompt, 16 new tokens, greedy), and the next one comes `--think-ms`
after the last ended (a client's think time: meanwhile the adapter is idle and evictable, and
alone the engine idles too). A noisy tenant churns `--noisy-adapters` adapters of its own: `--noisy-in-flight`
short requests at a time (8-token prompt, 4 new tokens), each on its next adapter, so nearly every
one loads an adapter.

Pool: pages of rank 8 (one adapter each); the tenants file's shares give each quiet tenant 4 pages
and the noisy one 4, and the pool holds 4 pages more (what the shares leave for shared adapters).
Without shares (`--no-shares`, the old pool) it is one least-recently-used pool for everyone.

Each of `--rounds` rounds measures the quiet tenants (`--quiet-tokens` tokens each time) alone,
beside the noisy tenant's requests on the last 4 of its adapters (reloaded at the start if the
churn evicted them, then resident: no churn), and beside its churn (round robin over all its
adapters, continued from round to round), in the same engine; the median of the rounds' ratios
counts (the machine's load drifts; alternating puts it on both sides of a ratio). Every request
must produce exactly its tokens, and each quiet request's tokens must equal its alone run's
(greedy, same prompt), else no RESULT and exit status 1.
Last lines: RESULT quiet_tenant_adapter_reloads=<loads of quiet tenants' adapters during the churn>
(target 0), RESULT quiet_tenant_tps_ratio=<quiet tokens/s beside the churn / alone> (target >= 0.85)
and RESULT quiet_tenant_churn_tps_ratio=<quiet tokens/s beside the churn / beside the same noisy
requests on 4 adapters that stay resident>: what the churn itself costs, apart from the noisy
tenant's requests sharing the steps (which fair share, not the pool, governs).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# isort: off
import inference_service  # noqa: F401 - first: the server's OpenMP settings, before torch loads libgomp
import torch
# isort: on


from harness.bench import print_result
from harness.engine_helpers import load_adapters
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.heap import freeze_startup_objects
from inference_service.engine.request import Request, SamplingParams
from inference_service.lora.mem_pool import bytes_per_page
from inference_service.models.loader import builtin_tiny_config

QUIET_TENANTS, QUIET_ADAPTERS = ("quiet-a", "quiet-b"), 4  # adapters per quiet tenant
SHARE_PAGES, COMMON_PAGES = 4, 4
QUIET = SamplingParams(max_new_tokens=16, ignore_eos=True)
NOISY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def quiet_prompt(name: str, turn: int) -> list[int]:
    seed = sum(map(ord, name))
    return [(seed * 7 + 13 * i + turn) % 250 + 3 for i in range(16)]


class Workload:
    """The quiet tenants' closed loops and the noisy tenant's churn, stepped by hand."""

    def __init__(self, core: EngineCore, quiet: list[str], noisy: list[str], think_s: float,
                 noisy_in_flight: int) -> None:
        self.core, self.quiet, self.noisy = core, quiet, noisy
        self.think_s, self.noisy_in_flight = think_s, noisy_in_flight
        self.turn = dict.fromkeys(quiet, 0)
        self.expected: dict[tuple[str, int], list[int]] = {}  # (adapter, turn % 4) → tokens alone
        self.mismatches: list[str] = []
        self.short: list[str] = []
        self.ids = 0

    def run(self, quiet_tokens: int, churn: Iterator[str] | None) -> tuple[int, float]:
        """The quiet loops until they made `quiet_tokens`, beside the noisy tenant's requests on the
        adapters `churn` yields (None: alone); returns (quiet tokens, seconds)."""
        core, quiet_live, noisy_live = self.core, {}, set()
        idle_until = dict.fromkeys(self.quiet, 0.0)  # when each quiet adapter's next request comes
        produced, tokens = 0, {}
        start = time.perf_counter()
        while produced < quiet_tokens:
            for name in self.quiet:
                if name not in quiet_live.values() and time.monotonic() >= idle_until[name]:
                    rid = f"q{self.ids}"
                    self.ids += 1
                    core.add_request(Request(rid, quiet_prompt(name, self.turn[name] % 4), QUIET), name)
                    quiet_live[rid] = name
            while churn is not None and len(noisy_live) < self.noisy_in_flight:
                rid = f"n{self.ids}"
                self.ids += 1
                core.add_request(Request(rid, [5, 6, 7, 8, 9, 10, 11, 12], NOISY), next(churn))
                noisy_live.add(rid)
            for out in core.step():
                if out.request_id not in quiet_live and out.request_id not in noisy_live:
                    continue  # the end of one the last run cut off
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.request_id in quiet_live:
                    produced += len(out.new_token_ids)
                if not out.finished:
                    continue
                got = tokens.pop(out.request_id)
                if out.request_id in noisy_live:
                    noisy_live.discard(out.request_id)
                    if len(got) != NOISY.max_new_tokens:
                        self.short.append(out.request_id)
                    continue
                name = quiet_live.pop(out.request_id)
                if len(got) != QUIET.max_new_tokens:
                    self.short.append(out.request_id)
                key = (name, self.turn[name] % 4)
                if self.expected.setdefault(key, got) != got:
                    self.mismatches.append(f"{name} turn {self.turn[name]}")
                self.turn[name] += 1
                idle_until[name] = time.monotonic() + self.think_s
            if not core.has_work():  # every quiet client thinking, alone: the engine idles meanwhile (in
                time.sleep(0.001)  # short sleeps: one to the next arrival oversleeps by a time slice here)
        elapsed = time.perf_counter() - start
        for rid in [*quiet_live, *noisy_live]:  # the loops' last requests, cut off: not counted
            core.abort(rid)
        # Stagings and copies the churn started go on after it: done before the next run is timed.
        while core.has_work() or core.lora.has_pending_work():
            core.step()
            time.sleep(0.001)
        return produced, elapsed


def rate(tokens: int, seconds: float) -> float:
    return tokens / seconds


def quiet_loads(core: EngineCore) -> int:
    return sum(info.loads for info in core.list_adapters() if info.owner in QUIET_TENANTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--noisy-adapters", type=int, default=200)
    parser.add_argument("--noisy-in-flight", type=int, default=4)
    parser.add_argument("--think-ms", type=float, default=100.0, help="between a quiet request's end and the next")
    parser.add_argument("--quiet-tokens", type=int, default=1024, help="quiet tokens per run, alone or beside")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-shares", action="store_true", help="one LRU pool for all (the old pool)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    page = bytes_per_page(builtin_tiny_config().lora_shapes(), 8, torch.float32)
    tenants = (*QUIET_TENANTS, "noisy")
    pages = SHARE_PAGES * len(tenants) + COMMON_PAGES
    shares = {} if args.no_shares else {t: SHARE_PAGES * page for t in tenants}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        quiet = {t: {f"{t}-{i}": write_peft_adapter(root / f"{t}-{i}", rank=8, seed=10 * k + i)
                     for i in range(QUIET_ADAPTERS)} for k, t in enumerate(QUIET_TENANTS)}
        noisy = {f"noisy-{i}": write_peft_adapter(root / f"noisy-{i}", rank=8, seed=1000 + i)
                 for i in range(args.noisy_adapters)}
        core = EngineCore(EngineConfig(model="builtin:tiny", device="cpu", max_loras="auto", max_lora_rank=8,
                                       lora_page_rank=8, lora_memory_bytes=(pages + 1) * page,
                                       kv_cache_bytes=64 << 20, adapter_pool_shares=shares))
        try:
            for tenant, adapters in quiet.items():
                load_adapters(core, adapters, owner=tenant, preload=True)
            load_adapters(core, noisy, owner="noisy")
            workload = Workload(core, [n for a in quiet.values() for n in a], list(noisy), args.think_ms / 1e3,
                                args.noisy_in_flight)
            workload.run(args.quiet_tokens // 4, None)  # warm-up: the quiet tenants' expected tokens
            freeze_startup_objects()  # as the server does: what setup made is never collected again
            before, loads_before = quiet_loads(core), core.lora.stats().loads_total
            churn = itertools.cycle(noisy)  # round robin: every adapter loaded again once the pool dropped it
            steady = itertools.cycle(list(noisy)[-SHARE_PAGES:])  # as many as its share holds: no churn
            ratios, churn_ratios = [], []
            for r in range(args.rounds):
                alone = rate(*workload.run(args.quiet_tokens, None))
                steady_rate = rate(*workload.run(args.quiet_tokens, steady))
                loads = core.lora.stats().loads_total
                beside = rate(*workload.run(args.quiet_tokens, churn))
                loads = core.lora.stats().loads_total - loads
                ratios.append(beside / alone)
                churn_ratios.append(beside / steady_rate)
                print(f"round {r}: quiet tok/s alone {alone:.0f}, beside the noisy tenant on {SHARE_PAGES} resident "
                      f"adapters {steady_rate:.0f}, beside its churn ({loads} loads) {beside:.0f}: ratios "
                      f"{ratios[-1]:.3f} (churn / alone), {churn_ratios[-1]:.3f} (churn / no churn)", flush=True)
            reloads = quiet_loads(core) - before
            stats = core.lora.stats()
            noisy_loads = stats.loads_total - loads_before - reloads
            print(f"pool: {pages} pages, shares {'off' if args.no_shares else SHARE_PAGES}; noisy loads {noisy_loads}, "
                  f"evictions {stats.evictions_total}; bytes by tenant {dict(stats.pool_bytes_by_owner)}")
        finally:
            core.shutdown()
    problems = [f"{len(workload.short)} requests ended short"] if workload.short else []
    if noisy_loads < args.noisy_adapters:
        problems.append(f"the noisy tenant loaded {noisy_loads} adapters, fewer than {args.noisy_adapters}: "
                        "raise --rounds or --quiet-tokens")
    if workload.mismatches:
        problems.append(f"quiet tokens differ from their alone runs: {workload.mismatches[:5]}")
    if problems:
        sys.exit("no RESULT:\n" + "\n".join(problems))
    print_result("quiet_tenant_adapter_reloads", reloads, "d")
    print_result("quiet_tenant_tps_ratio", statistics.median(ratios))
    print_result("quiet_tenant_churn_tps_ratio", statistics.median(churn_ratios))


if __name__ == "__main__":
    main()
