"""The synchronous engine: one object that takes requests in, steps them, and reports.

`EngineCore` owns the scheduler, the model runner, the LoRA manager and output processing; call
it from one thread only. `engine.Engine` runs it on the scheduler thread and is the only bridge
to other threads: everything it needs is a method here, so a process bridge could replace it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from adapter_cache.adapter_format import BaseModelShapes
from adapter_cache.errors import FailedPreconditionError, LoraplexError
from inference_service.device import InlineExecutor, make_copy_engine, shorten_gil_switch_interval
from inference_service.engine.batch import ScheduledBatch
from inference_service.engine.config import EngineConfig
from inference_service.engine.decode_graphs import DecodeGraphs, capture_mode_for
from inference_service.engine.grammar import GrammarCompiler
from inference_service.engine.kv_cache import KVCache, kv_bytes_per_block
from inference_service.engine.memory import default_budget
from inference_service.engine.model_runner import ModelRunner, PlannedRow, StepResults
from inference_service.engine.output_processor import OutputProcessor
from inference_service.engine.request import FinishReason, Request, RequestOutput, SamplingParams, WaitReason
from inference_service.engine.sampling import FORWARD_FAILED, NON_FINITE
from inference_service.engine.scheduler import Scheduler
from inference_service.engine.types import (
    TEST_FAULT_ENV,
    TEST_STEP_DELAY_ENV,
    AdapterInfo,
    EngineStats,
    ModelInfo,
    Residency,
    TestFault,
    test_faults_enabled,
    validate_request,
)
from inference_service.limits import shown
from inference_service.lora.manager import LoRAManager
from inference_service.lora.mem_pool import bytes_per_page, pages_for
from inference_service.lora.registry import AdapterVersion, adapter_name
from inference_service.lora.sidecar_source import SidecarSource
from inference_service.lora.source import AdapterSource, LocalDirectorySource
from inference_service.metrics_sink import MetricsSink, NullMetrics
from inference_service.models.decode_step import DEFAULT_BUCKETS
from inference_service.models.llama import LlamaModel
from inference_service.models.loader import load_model
from inference_service.models.qwen3_moe import Qwen3MoeModel
from inference_service.models.registry import CausalLM
from inference_service.platform import Platform, PlatformPlan

log = logging.getLogger(__name__)
T = TypeVar("T")

# Async scheduling plans step N+2 while N+1 runs. Planned the moment N completes, it misses every
# request that arrives during N+1 (a closed-loop client's next request always does: it follows
# N's last token), which then waits for N+3. So the next plan waits, taking commands as they come,
# until this fraction of the shortest recent step has passed since N+1 started, and never closer
# than PLAN_SLACK_S to that step's end (time to plan and launch before the device runs dry).
PLAN_AT_FRACTION = 0.6
PLAN_SLACK_S = 0.003
RECENT_STEPS = 16
# --max-lora-rank auto: the largest of these ranks the pool holds AUTO_RANK_ADAPTERS adapters of
AUTO_RANKS = (64, 32, 16)
AUTO_RANK_ADAPTERS = 8


@dataclass(slots=True)
class _Launch:
    """A step handed to the device worker; the worker stamps when it ran."""

    batch: ScheduledBatch
    future: concurrent.futures.Future[StepResults] = field(init=False)  # set once submitted
    started: float | None = None
    seconds: float | None = None


def default_source(config: EngineConfig, shapes: BaseModelShapes) -> AdapterSource:
    """Where adapters come from: the sidecar when one is configured, else local directories."""
    if config.cache_address:
        return SidecarSource(config.cache_address, shapes, config.max_lora_rank,
                             token_file=config.cache_token_file)
    return LocalDirectorySource(shapes, config.max_lora_rank, config.host_cache_bytes,
                                allow=config.adapter_source_allow)


def memory_budget(config: EngineConfig, device: torch.device, weight_bytes_saved: int = 0) -> int:
    """Bytes for the adapter pool and the KV cache together: --memory-budget-bytes, else a fraction of
    the memory available once the weights are loaded (engine/memory.py): what quantized weights save
    against dense ones is already in that measurement, and logged."""
    if weight_bytes_saved:
        log.info("quantized weights take %.1f MiB less than dense ones", weight_bytes_saved / 2**20)
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    budget, how = default_budget(device)
    log.info("memory budget %.0f MiB: %s", budget / 2**20, how)
    return budget


def model_len(config: EngineConfig, model: CausalLM) -> int:
    """Longest prompt + output the model takes: --max-model-len within the model's positions."""
    positions = model.config.max_position_embeddings
    return min(config.max_model_len or positions, positions)


def lora_pool_pages(config: EngineConfig, budget: int, shapes: BaseModelShapes, dtype: torch.dtype,
                    device: torch.device, kv_reserve: int = 0) -> int:
    """Pages of the pool sized by memory (`--max-loras auto`): --lora-memory-bytes, else a fraction
    of the memory budget (docs/engine.md, "The adapter pool") that leaves `kv_reserve` bytes
    (one request of the whole context) to the KV cache, and holds one adapter of the largest rank at
    least; less the zero page."""
    per_page = bytes_per_page(shapes, config.lora_page_rank, dtype)
    rank = floor_rank(config)
    if config.lora_memory_bytes is not None:
        nbytes = config.lora_memory_bytes
    else:
        fraction = config.lora_memory_fraction
        if fraction is None:
            fraction = 0.5 if device.type == "cpu" else 0.25
        least = (pages_for(rank, config.lora_page_rank) + 1) * per_page
        nbytes = max(min(int(budget * fraction), budget - kv_reserve), least)
    pages = nbytes // per_page - 1
    if pages < pages_for(rank, config.lora_page_rank):
        raise ValueError(f"an adapter pool of {nbytes} B cannot hold one adapter of rank {rank} "
                         f"({per_page} B per page of rank {config.lora_page_rank})")
    return pages


def floor_rank(config: EngineConfig) -> int:
    """The rank the pool must hold one adapter of: --max-lora-rank, or auto's smallest choice."""
    return AUTO_RANKS[-1] if config.max_lora_rank == "auto" else int(config.max_lora_rank)


def resolve_max_rank(config: EngineConfig, pool_pages: int | None) -> int:
    """--max-lora-rank; auto: on the pool sized by memory the largest of AUTO_RANKS it holds
    AUTO_RANK_ADAPTERS adapters of (a paged pool spends memory by an adapter's real rank, so the limit
    costs nothing until such an adapter comes), on fixed slots the smallest (every slot is that big)."""
    if config.max_lora_rank != "auto":
        return int(config.max_lora_rank)
    if pool_pages is not None:
        for rank in AUTO_RANKS:
            if pool_pages // pages_for(rank, config.lora_page_rank) >= AUTO_RANK_ADAPTERS:
                return rank
    return AUTO_RANKS[-1]


def build_lora_manager(
    config: EngineConfig, model: CausalLM, source: AdapterSource | None, metrics: MetricsSink, budget: int,
    plan: PlatformPlan,
) -> LoRAManager:
    """The model's adapter pool (allocated now, before the KV cache, from `budget` with
    `--max-loras auto`) and the manager that fills it, with the plan's copy engine and pages.
    `config.max_lora_rank` is resolved (not auto); `source` None: the default one for that rank."""
    shapes, dtype = model.config.lora_shapes(), model.lora_op.slot_dtype(model.dtype)
    fixed = config.fixed_loras()
    rank = int(config.max_lora_rank)
    lora = LoRAManager(
        num_slots=fixed,
        num_pages=None if fixed is not None else pool_pages_for(config, model, budget),
        page_rank=config.lora_page_rank,
        max_rank=rank,
        shapes=shapes,
        device=model.device,
        dtype=dtype,
        source=source or default_source(config, shapes),
        copy_engine=make_copy_engine(model.device, plan.copy_engine != "blocking"),
        host_workers=config.host_load_workers,
        metrics=metrics,
        # Blocking mode (benchmark baseline): preparation and copy both stall the scheduler.
        host_executor=None if config.overlap_loads else InlineExecutor(),
        b_rank_major=model.lora_op.b_rank_major,
        max_registered=config.max_registered_adapters,
        load_timeout_s=config.adapter_load_timeout_s,
        pool_shares=config.adapter_pool_shares,
        huge_pages=plan.huge_pages,
    )
    model.attach_lora_buffers(lora.slot_buffers)
    if isinstance(model, Qwen3MoeModel):
        top_k = model.config.num_experts_per_tok
        model.attach_expert_buffers(lora.expert_step_buffers(max(config.max_num_batched_tokens, config.max_num_seqs),
                                                             top_k))
    return lora


def pool_pages_for(config: EngineConfig, model: CausalLM, budget: int) -> int:
    """`lora_pool_pages` for this model: the KV cache keeps room for one request of the whole context."""
    shapes, dtype = model.config.lora_shapes(), model.lora_op.slot_dtype(model.dtype)
    kv_reserve = blocks_for(model_len(config, model), config.block_size) * kv_bytes_per_block(
        model.config, config.block_size, model.dtype)
    return lora_pool_pages(config, budget, shapes, dtype, model.device, kv_reserve)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def build_kv_cache(config: EngineConfig, model: CausalLM, budget: int, lora: LoRAManager) -> KVCache:
    """The KV cache: `--kv-cache-bytes`, or what the memory `budget` leaves after the LoRA slots, up
    to what the scheduler can fill (--max-num-seqs requests of the whole context)."""
    lora_bytes = lora.slots_nbytes
    per_block = kv_bytes_per_block(model.config, config.block_size, model.dtype)
    if config.kv_cache_bytes is not None:
        num_blocks = config.kv_cache_bytes // per_block
    else:
        fillable = config.max_num_seqs * blocks_for(model_len(config, model), config.block_size)
        num_blocks = min((budget - lora_bytes) // per_block, fillable)
    if num_blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: budget {budget} B, LoRA pool {lora_bytes} B, "
            f"a KV block needs {per_block} B"
        )
    kv = KVCache(model.config, num_blocks, config.block_size, model.device, model.dtype, config.prefix_cache,
                 spare_block=config.decode_graphs_on())
    context = min(model_len(config, model), num_blocks * config.block_size)
    log.info("memory: LoRA pool %.1f MiB (%d adapters of rank %d, more of lower ranks), KV cache %.1f MiB "
             "(%d blocks of %d tokens = %d tokens); context %d tokens", lora_bytes / 2**20, lora.num_slots,
             lora.max_rank, kv.nbytes / 2**20, num_blocks, config.block_size, num_blocks * config.block_size,
             context)
    if context < model_len(config, model):
        log.warning("the KV cache holds %d tokens, less than the model's context of %d: the context advertised "
                    "(/v1/models max_model_len, GetModelInfo max_context) is %d; give more memory "
                    "(--memory-budget-bytes, --kv-cache-bytes) or a smaller --max-model-len",
                    num_blocks * config.block_size, model_len(config, model), context)
    return kv


def build_decode_graphs(config: EngineConfig, model: CausalLM, kv: KVCache, lora: LoRAManager) -> DecodeGraphs | None:
    """Captured decode steps where the config asks for them (`decode_graphs`) and the model is a
    LLaMA-family one (the step runs its layers); None: every step runs eagerly."""
    if not config.decode_graphs_on():
        return None
    if not isinstance(model, LlamaModel):
        log.info("decode graphs: off (%s is not a LLaMA-family model)", type(model).__name__)
        return None
    if isinstance(model, Qwen3MoeModel):
        log.info("decode graphs: off (an MoE layer reads its experts' row counts on the host)")
        return None
    mc = model.config
    max_context = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    buckets = tuple(size for size in DEFAULT_BUCKETS if size < config.max_num_seqs) + (config.max_num_seqs,)
    graphs = DecodeGraphs(model, kv.layers, kv.block_size, lora, max_blocks=-(-max_context // kv.block_size),
                          pad_slot=kv.pad_slot, mode=capture_mode_for(model.device), buckets=buckets,
                          non_finite=NON_FINITE)
    log.info("decode graphs: %s for batches of up to %s rows", graphs.mode, ", ".join(map(str, graphs.buckets)))
    if graphs.mode == "cuda_graph":  # at start-up, over padding rows: no capture pause while serving
        graphs.capture_all()
    return graphs


class EngineCore:
    """Synchronous engine: call from one thread only."""

    def __init__(
        self, config: EngineConfig, source: AdapterSource | None = None, metrics: MetricsSink | None = None,
        detokenize: bool = True,
    ) -> None:
        """`detokenize=False`: outputs of requests without stop strings carry `text=None`, decoded
        by the front end's stream off this thread (what the serving bridges ask for)."""
        self.config = config
        self.metrics = metrics or NullMetrics()
        # Everything the model and the runner compute with, chosen once (inference_service/platform).
        plan = Platform.for_device(config.torch_device(), config)
        # A captured decode step reads dense weights: no packing for the CPU GEMM then.
        model, self.tokenizer = load_model(config.model, plan.device, plan.dtype, config.tokenizer, config.revision,
                                           pack_weights=not config.decode_graphs_on(),
                                           weights_dtype=config.weights_dtype, compute=plan.model_compute())
        model.lora_op = plan.make_lora_op()
        # LoRA slots first, then the KV cache from what is left: adapters never starve for memory.
        budget = memory_budget(config, model.device, model.weight_bytes_saved)  # before the slots take theirs
        if config.max_lora_rank == "auto":
            pages = None if config.fixed_loras() is not None else pool_pages_for(config, model, budget)
            config = self.config = dataclasses.replace(config, max_lora_rank=resolve_max_rank(config, pages))
        self.lora = build_lora_manager(config, model, source, self.metrics, budget, plan)
        kv = build_kv_cache(config, model, budget, self.lora)
        self.plan, decode_stack = Platform.with_model(plan, model)  # once the LoRA buffers are attached
        self.plan.log()
        self.runner = ModelRunner(model, self.tokenizer, self.lora, kv,
                                  build_decode_graphs(config, model, kv, self.lora), decode_stack,
                                  c_argmax=self.plan.greedy_pick == "c")
        self.scheduler = Scheduler(config, kv, self.lora)
        log.info("LoRA slots in %s", self.lora.slot_dtype)
        mc = model.config
        # What the server advertises always fits one request: the context, within the KV cache.
        max_context = min(model_len(config, model), kv.num_blocks * kv.block_size)
        self.model_info = ModelInfo(
            name=mc.name or config.model,
            max_context=max_context,
            vocab_size=mc.vocab_size,
            max_loras=self.lora.num_slots,
            max_lora_rank=config.max_lora_rank,
            max_new_tokens_limit=min(config.max_new_tokens_limit or max_context, max_context),
            limits=config.limits,
            max_registered_adapters=config.max_registered_adapters,
            kv_cache_blocks=self.runner.kv.num_blocks,
            kv_block_size=self.runner.kv.block_size,
            lora_pool_bytes=self.lora.pages_nbytes,
            lora_page_rank=self.lora.page_rank,
            platform=tuple(self.plan.rows()),
        )
        self.outputs = OutputProcessor(self.tokenizer, self.metrics, detokenize)
        # Structured output, compiled off the step
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, max_cached_bytes=config.grammar_cache_bytes)
        self.grammars.warm_up()  # before serving: its import holds the GIL for seconds
        # Seeds for sampling requests that bring none (--seed): a restart with the same seed and the
        # same arrivals samples the same tokens; a request's own seed always wins.
        self._seeds = random.Random(config.seed)
        # Async scheduling: steps run on this one thread, in launch order, while the scheduler
        # thread plans the next (docs/engine.md, "Async scheduling").
        self._device_worker = None
        if config.async_scheduling_on():
            self._device_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="device")
            # Back from step N, the worker must start N+1 at once, not after 5 ms of the scheduler
            # thread's Python: with the default the 256-stream simulation stepped every 11.2 ms, 10.6 now.
            shorten_gil_switch_interval()
        self._in_flight: _Launch | None = None
        self._recent_steps: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)  # device seconds
        self._previous_samples: dict[str, int] = {}  # the device worker's: a pending row's input
        self._step_delay = 0.0  # a test fault's (TestFault "slow_steps"); 0 in production

    # ---- intake ----

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(self.model_info, prompt_token_ids, params)

    def add_request(self, request: Request, adapter: str | None) -> None:
        """Take a validated request in; resolves the adapter name and takes its reference."""
        if adapter:
            request.adapter_uid = self.lora.acquire(adapter, request.request_id)
        if request.generator is None and not request.params.greedy:
            request.generator = torch.Generator().manual_seed(self._seeds.getrandbits(63))
        if request.params.grammar is not None:
            request.grammar = self.grammars.compile(request.params.grammar)
        self.outputs.add(request)
        self.scheduler.add(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        self.scheduler.abort(request_id, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def step_in_flight(self) -> bool:
        """A launched step (async scheduling) not completed yet: the next `step` call completes it."""
        return self._in_flight is not None

    def plan_not_before(self) -> float | None:
        """With a step running on the device: the monotonic time before which planning the next one
        gains nothing (see PLAN_AT_FRACTION); None when the next step should be planned now."""
        launch = self._in_flight
        if launch is None or not self._recent_steps:
            return None
        # Not stamped yet: the worker is only now picking it up (`step` waited for the one before).
        started = launch.started if launch.started is not None else time.monotonic()
        shortest = min(self._recent_steps)
        wait = min(shortest * PLAN_AT_FRACTION, shortest - PLAN_SLACK_S)
        return started + wait if wait > 0 else None

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; the outputs of the step that completed. With async scheduling
        the step is launched on the device worker and the previous one (launched by the last call)
        is completed here, so the scheduler's work overlaps the device's; without, it runs here."""
        if self._step_delay:
            time.sleep(self._step_delay)
        batch = self.scheduler.schedule()
        if self._device_worker is None:
            if batch:
                results = self._contained(batch.items, lambda items: self.runner.run(ScheduledBatch(items)),
                                          lambda item: item[0].request_id)
                self.scheduler.launched(batch)
                self.scheduler.postprocess(batch, results, self.outputs.on_token)
            return self.outputs.take(self.scheduler.take_finished())
        previous, launched = self._in_flight, None
        if batch:
            rows = self.runner.plan(batch)  # if this raises, the step in flight stays there for fail_running
            self.scheduler.launched(batch)
            launched = _Launch(batch)
            launched.future = self._device_worker.submit(self._execute, rows, launched)
        self._in_flight = launched
        if previous is not None:
            results = previous.future.result()
            if previous.seconds is not None:
                self._recent_steps.append(previous.seconds)
            self.scheduler.postprocess(previous.batch, results, self.outputs.on_token)
        return self.outputs.take(self.scheduler.take_finished())

    def _execute(self, rows: list[PlannedRow], launch: _Launch) -> StepResults:
        """One launched step, on the device worker (steps run in launch order, so KV blocks and slots
        freed while a step runs are reused only by later steps, which run after it)."""
        launch.started = started = time.monotonic()
        results = self._contained(rows, lambda part: self.runner.execute(part, self._previous_samples),
                                  lambda row: row.request_id)
        self._previous_samples = {request_id: result[0] for request_id, result in results.items()}
        launch.seconds = time.monotonic() - started
        return results

    @staticmethod
    def _contained(parts: list[T], run: Callable[[list[T]], StepResults],
                   request_id: Callable[[T], str]) -> StepResults:
        """`run(parts)`; if it raises, its requests run again one at a time, so only a request that
        fails alone is ended (`FORWARD_FAILED`: INTERNAL, that is a bug) and the others go on."""
        try:
            return run(parts)
        except Exception:  # noqa: BLE001 - contained below
            if len(parts) == 1:
                log.exception("the forward pass of request %s failed", shown(request_id(parts[0])))
                return {request_id(parts[0]): (FORWARD_FAILED, None, None)}
            log.exception("a forward pass of %d requests failed; running them one at a time", len(parts))
        results: StepResults = {}
        for part in parts:
            results.update(EngineCore._contained([part], run, request_id))
        return results

    def _drop_in_flight(self) -> None:
        """Wait for the launched step and drop its tokens (after a failed step, at shutdown)."""
        if self._in_flight is not None:
            concurrent.futures.wait([self._in_flight.future])
            self._in_flight = None

    def fail_running(self, error: LoraplexError) -> list[RequestOutput]:
        """After a failed step: end every running request with `error`, and every waiting one owed
        a token by a dropped step (the other waiting ones stay)."""
        self._drop_in_flight()
        owed = [r for r in self.scheduler.waiting if r.num_pending_tokens]
        for request in [*self.scheduler.running, *owed]:
            self.scheduler.finish(request, FinishReason.ERROR, error)
        return self.outputs.take(self.scheduler.take_finished())

    # ---- adapters (the admin calls of the bridge) ----

    def load_adapter(
        self, name: str, uri: str, sha256: str | None = None, pinned: bool = False, preload: bool = False,
        on_demand: bool = False, owner: str | None = None,
    ) -> concurrent.futures.Future[AdapterVersion]:
        return self.lora.load_adapter(name, uri, sha256, pinned, preload, on_demand, owner)

    def unload_adapter(self, name: str) -> concurrent.futures.Future[None]:
        return self.lora.unload_adapter(name)

    def adapter_names(self) -> frozenset[str]:
        """The names new requests may use now."""
        return self.lora.adapter_names()

    def adapter_names_changes(self) -> int:
        """Bumped whenever `adapter_names()` changes."""
        return self.lora.adapter_names_changes

    def has_pending_work(self) -> bool:
        """Adapter loads in flight (the scheduler thread must keep polling them)."""
        return self.lora.has_pending_work()

    # ---- snapshots ----

    def stats(self) -> EngineStats:
        lora = self.lora.stats()
        waiting = {r.adapter_uid for r in self.scheduler.waiting if r.adapter_uid}
        running = {r.adapter_uid for r in self.scheduler.running if r.adapter_uid}
        return EngineStats(
            slots_total=lora.slots_total,
            slots_occupied=lora.slots_occupied,
            slots_referenced=lora.slots_referenced,
            slots_pinned=lora.slots_pinned,
            pending_load_events=lora.pending_loads,
            requests_running=len(self.scheduler.running),
            requests_waiting=dict(Counter(r.wait_reason or WaitReason.QUEUED for r in self.scheduler.waiting)),
            kv_cache_usage=self.runner.kv.usage,
            kv_blocks_used=self.runner.kv.num_used,
            kv_blocks_cached=self.runner.kv.num_cached,
            kv_blocks_total=self.runner.kv.num_blocks,
            prefix_cache_queries=self.scheduler.prefix_queries,
            prefix_cache_hits=self.scheduler.prefix_hits,
            adapter_references=lora.references,
            max_lora=lora.slots_total,
            running_lora_adapters=tuple(sorted(adapter_name(u) for u in running)),
            waiting_lora_adapters=tuple(sorted(adapter_name(u) for u in waiting - running)),
            loads_total=lora.loads_total,
            evictions_total=lora.evictions_total,
            lora_pool_bytes_total=lora.pool_bytes_total,
            lora_pool_bytes_used=lora.pool_bytes_used,
            lora_resident_by_rank=lora.resident_by_rank,
            lora_evictions_by_cause=lora.evictions_by_cause,
            lora_pool_bytes_by_owner=lora.pool_bytes_by_owner,
            preemptions_by_cause=tuple(self.scheduler.preemptions.items()),
            updated_at=time.time(),
        )

    def list_adapters(self, limit: int | None = None, after: tuple[str, int] | None = None) -> list[AdapterInfo]:
        """Adapters ordered by (name, version): the first `limit` after `after` (a page).
        O(registered) per call, never per step: it runs only for a ListAdapters."""
        return self.lora.adapters(limit, after)

    def adapter_info(self, uid: str) -> AdapterInfo | None:
        """One registered version; None once it is gone."""
        return self.lora.adapter_info(uid) if self.lora.has_version(uid) else None

    def adapter_is_current(self, name: str) -> bool:
        """Whether new requests may use `name` now: one dict lookup, atomic from any thread (the
        scheduler thread checks again at intake)."""
        return self.lora.is_current(name)

    def adapter_residency(self) -> Residency:
        """Where each adapter's weights are (O(registered): for a metrics scrape, never per step)."""
        tiers: dict[str, list[str]] = {"device": [], "host": [], "cache": []}
        for name, state, tier in self.lora.residency():
            if state.value == "LOADED":
                tiers["device"].append(name)
            elif state.value == "HOST_READY":
                tiers["host"].append(name)
            elif state.value == "REGISTERED" and tier == "cache":
                tiers["cache"].append(name)
        return Residency(*(tuple(sorted(names)) for names in tiers.values()))

    def heartbeat(self) -> None:
        """The watchdog's no-op: that it returns proves the scheduler thread runs its commands."""

    def inject_fault(self, fault: TestFault) -> None:
        """A test-only fault (see TestFault), refused unless the test flag is set (TEST_FAULT_ENV)."""
        if not test_faults_enabled():
            raise FailedPreconditionError(f"test faults are off (set {TEST_FAULT_ENV} or {TEST_STEP_DELAY_ENV})")
        if fault.kind == "slow_steps":
            self._step_delay = max(0.0, fault.seconds or 0.0)
            return
        log.error("TEST FAULT: scheduler thread %s now", "exits" if fault.kind == "die" else "hangs")
        if fault.kind == "die":
            raise SystemExit  # not an Exception: leaves the scheduler loop, the thread ends
        threading.Event().wait(fault.seconds)

    def shutdown(self) -> None:
        self._drop_in_flight()
        if self._device_worker is not None:
            self._device_worker.shutdown()
        self.grammars.shutdown()
        self.lora.shutdown()
