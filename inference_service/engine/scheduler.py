"""Continuous batching with adapter-aware admission.

Each step: drain finished adapter loads, keep running requests going (decode or the next
prefill chunk, preempting the newest by recompute when KV blocks run out), then admit waiting
requests by priority (lower first; FCFS among equals, and all are 0 unless a client asks). A
request whose adapter is not LOADED triggers its load and is skipped, so it never blocks the line;
once a request has been passed over `aging_steps` times and still cannot get a slot, later
requests stop overtaking it, so slots drain and nothing starves.

A request's n samples (`Request.group`) share its prompt's prefill: the first sample added leads,
and with the prefix cache on the others wait (WaitReason.SAMPLES) until the leader's prompt blocks
are cached (its first token: the step that completed its prompt keyed them) or the leader ended,
then hit those blocks and compute only the prompt's tail. With the prefix cache off, or a prompt
shorter than one block past its last token, they are not held and prefill separately.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from inference_service.engine.batch import ScheduledBatch
from inference_service.engine.config import EngineConfig
from inference_service.engine.grammar import new_matcher
from inference_service.engine.kv_cache import KVCache
from inference_service.engine.model_runner import StepResults
from inference_service.engine.output_processor import sample_error
from inference_service.engine.prefix_cache import CacheNamespace, extend_hashes
from inference_service.engine.request import FinishReason, Request, RequestStatus, WaitReason
from inference_service.limits import shown
from inference_service.lora.manager import LoRAManager

log = logging.getLogger(__name__)


# Called for each new token: its output is made and whether it ends the request is decided there.
OnToken = Callable[[Request, torch.Tensor | None, float], FinishReason | None]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCache, lora: LoRAManager) -> None:
        self.config, self.kv, self.lora = config, kv, lora
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.finished_this_step: list[Request] = []
        self.num_preemptions = 0
        # Prefix cache, in tokens: what admissions looked up and what they found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # n samples: group id -> the sample whose prefill the others wait for, until it is cached
        # (an entry lives no longer than its leader: O(active requests)).
        self.leaders: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        request.arrival_seq = next(self._arrivals)
        self.requests[request.request_id] = request
        self._enqueue(request)
        if (request.group is not None and self.kv.prefix_caching and request.group not in self.leaders
                and request.num_prompt_tokens > self.kv.block_size):  # at least one full block to share
            self.leaders[request.group] = request

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue by priority (lower first, vLLM's semantics), after every waiting
        request of the same or a lower value: FCFS among equals. With every priority equal (the
        default) this is an append; otherwise it walks back only past the requests it overtakes.
        Aging still holds: a request past the aging barrier waits for the aged one's slot whatever
        its priority, so no adapter starves."""
        waiting = self.waiting
        at = len(waiting)
        while at and waiting[at - 1].priority > request.priority:
            at -= 1
        if at == len(waiting):
            waiting.append(request)
        else:
            waiting.insert(at, request)

    def _held(self, request: Request) -> bool:
        """Whether a sample waits for its leader's prompt blocks: until the leader has its first
        token (the step that completed its prompt cached the blocks) or has ended, whatever ended it."""
        leader = self.leaders.get(request.group) if request.group is not None else None
        if leader is None or leader is request:
            return False
        if leader.finished or leader.output_token_ids:
            del self.leaders[request.group]  # type: ignore[arg-type]
            return False
        return True

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> Request | None:
        """Idempotent: a request that already finished (or never existed) is left alone."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        self.finish(request, reason)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: FinishReason, error: LoraplexError | None = None) -> None:
        """The one exit of every request: frees its KV blocks and its adapter reference once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.error = reason, error
        if request.group is not None and self.leaders.get(request.group) is request:
            del self.leaders[request.group]  # its samples go on without it (or are ended by their caller)
        self.kv.release(request.block_table)
        request.block_table = []
        if request.adapter_uid is not None:
            self.lora.release(request.adapter_uid, request.request_id)
        del self.requests[request.request_id]
        self.finished_this_step.append(request)

    def launched(self, batch: ScheduledBatch) -> None:
        """A planned step has been handed to the device: its tokens count as computed, and each row
        that reaches its request's end owes one pending token until `postprocess` appends it (with
        async scheduling the next step is planned before that, so it must count them)."""
        now = time.monotonic()
        for request, num_tokens in batch.items:
            request.num_computed_tokens += num_tokens
            batch.tables.append(request.block_table)
            batch.ends.append(request.num_computed_tokens)
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            if request.num_computed_tokens == request.num_tokens:
                request.num_pending_tokens += 1

    def postprocess(self, batch: ScheduledBatch, sampled: StepResults, on_token: OnToken) -> None:
        """The one place a request gets its new token after a step, and its finish when `on_token`
        (output processing) says the token ends it. Failures are contained to one request: a row
        that sampled no token (non-finite logits, a failed forward pass or sampling) or whose output
        processing raises ends that request alone, and the batch goes on. A request that ended
        while its step ran (cancelled, or finished by the step before) drops the row's token."""
        now = time.monotonic()
        for (request, _), table, end in zip(batch.items, batch.tables, batch.ends, strict=True):
            result = sampled.get(request.request_id)
            if result is None:
                if not request.finished:
                    self._cache_blocks(request, table, end)
                continue  # a prefill chunk short of the prompt's end
            request.num_pending_tokens -= 1
            if request.finished:
                continue
            token, logits, request.step_logprobs = result
            error = sample_error(request, token)
            if error is not None:
                self.finish(request, FinishReason.ERROR, error)
                continue
            self._cache_blocks(request, table, end)
            request.output_token_ids.append(token)
            try:
                reason = on_token(request, logits, now)
            except Exception:  # noqa: BLE001 - a bug in stop matching or detokenizing: this request only
                log.exception("request %s failed after token %d", shown(request.request_id), token)
                self.finish(request, FinishReason.ERROR,
                            LoraplexError(f"internal error in request {request.request_id}"))
                continue
            if reason is not None:
                self.finish(request, reason)

    def take_finished(self) -> list[Request]:
        """The requests that ended since the last call (each exactly once)."""
        finished, self.finished_this_step = self.finished_this_step, []
        return finished

    def schedule(self) -> ScheduledBatch:
        self._fail_waiters(self.lora.drain().failed)
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        self._schedule_waiting(batch, budget)
        self.lora.touch({r.adapter_uid for r, _ in batch.items if r.adapter_uid is not None})
        return batch

    def _fail_waiters(self, failed: dict[str, LoraplexError]) -> None:
        for request in [r for r in self.waiting if r.adapter_uid in failed]:
            self.finish(request, FinishReason.ERROR, failed[request.adapter_uid])  # type: ignore[index]

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        scheduled: set[int] = set()
        block_size = self.kv.block_size
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_pending_tokens and len(request.output_token_ids) + request.num_pending_tokens \
                    >= request.params.max_new_tokens:
                continue  # its in-flight step samples its last token (async scheduling)
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_tokens
            if target > len(request.block_table) * block_size:  # most decode steps fit their last block
                while not self.kv.can_grow(request.block_table, target):
                    victim = next((r for r in reversed(self.running) if id(r) not in scheduled), None)
                    self._preempt(victim)
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    continue
                request.block_table = self.kv.grown(request.block_table, target)
            batch.items.append((request, num_tokens))
            scheduled.add(id(request))
            budget -= num_tokens
        return budget

    def _preempt(self, request: Request | None) -> None:
        """Recompute preemption: drop the KV blocks; the request re-prefills prompt + output later."""
        assert request is not None, "nothing left to preempt"
        self.running.remove(request)
        self.kv.release(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        log.info("preempted %s (KV cache full); it will recompute", request.request_id)

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        barrier = self._aging_barrier()
        needed = {r.adapter_uid for r in self.running if r.adapter_uid}
        needed |= {
            r.adapter_uid for r in self.waiting if r.adapter_uid and (barrier is None or r.arrival_seq <= barrier)
        }
        admitted: list[Request] = []
        failed: list[tuple[Request, LoraplexError]] = []
        blocked = False
        tenant_running = self._tenant_running()
        for request in self.waiting:
            reason = None
            if request.matcher is None and request.grammar is not None and not self._grammar_ready(request, failed):
                reason = WaitReason.GRAMMAR  # compiling off the step; the line goes on without it
            elif self._held(request):
                reason = WaitReason.SAMPLES  # the line goes on without it
            elif blocked:
                reason = WaitReason.QUEUED
            elif barrier is not None and request.arrival_seq > barrier and request.adapter_uid is not None:
                reason = WaitReason.AGING  # an older request must get a slot first
            elif len(self.running) + len(admitted) >= self.config.max_num_seqs or budget == 0:
                reason = WaitReason.BATCH_FULL
            elif self._tenant_full(request, tenant_running):
                reason = WaitReason.TENANT_LIMIT  # the line goes on without it
            elif request.adapter_uid is not None and self.lora.slot_of(request.adapter_uid) is None:
                got_slot = self.lora.ensure_loading(request.adapter_uid, needed)
                reason = WaitReason.ADAPTER_LOADING if got_slot else WaitReason.SLOTS_FULL
            else:
                if request.timings.adapter_ready is None:
                    request.timings.adapter_ready = time.monotonic()
                num_tokens = self._admit_kv(request, budget)
                if num_tokens:
                    if request.tenant is not None and request.tenant.max_running is not None:
                        tenant_running[request.tenant.name] = tenant_running.get(request.tenant.name, 0) + 1
                    admitted.append(request)
                    batch.items.append((request, num_tokens))
                    budget -= num_tokens
                    continue
                reason = WaitReason.KV_CACHE
                blocked = True  # FCFS for memory: no overtaking on KV, or long prompts would starve
            request.skipped_steps += 1
            request.wait_reason = reason
        for request in admitted:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for request, error in failed:
            self.finish(request, FinishReason.ERROR, error)

    def _tenant_running(self) -> dict[str, int]:
        """Running requests per tenant, for the tenants that have a max_running (O(running))."""
        counts: dict[str, int] = {}
        for request in self.running:
            tenant = request.tenant
            if tenant is not None and tenant.max_running is not None:
                counts[tenant.name] = counts.get(tenant.name, 0) + 1
        return counts

    @staticmethod
    def _tenant_full(request: Request, tenant_running: dict[str, int]) -> bool:
        tenant = request.tenant
        return (tenant is not None and tenant.max_running is not None
                and tenant_running.get(tenant.name, 0) >= tenant.max_running)

    @staticmethod
    def _grammar_ready(request: Request, failed: list[tuple[Request, LoraplexError]]) -> bool:
        """Whether the request's grammar is compiled (its matcher made now); a compile that failed
        ends the request (the front ends compiled it once already, so that is rare)."""
        future = request.grammar
        assert future is not None
        if not future.done():
            return False
        try:
            request.matcher = new_matcher(future.result())
        except Exception as e:  # noqa: BLE001 - a grammar xgrammar refuses: this request only
            failed.append((request, InvalidArgumentError(f"the constraint does not compile: {e}")))
            return False
        return True

    def _admit_kv(self, request: Request, budget: int) -> int:
        """Blocks for a waiting request's first step: the longest cached prefix of its tokens (never
        its last token: a step must compute something, and it never writes a shared block), then new
        blocks for the rest of what the budget allows. Returns the step's tokens (0: no room)."""
        assert not request.block_table and not request.num_computed_tokens, "waiting requests hold no KV"
        hits: list[int] = []
        if self.kv.prefix_caching:
            known = min(request.num_tokens - 1, len(request.prompt_token_ids) + len(request.output_token_ids))
            hashes = extend_hashes(request, self._namespace(request).root(), self.kv.block_size, known)
            hits = self.kv.pool.lookup(hashes)
        cached = len(hits) * self.kv.block_size
        num_tokens = min(request.num_tokens - cached, budget)
        if not self.kv.pool.can_take(hits, self.kv.blocks_needed(cached + num_tokens) - len(hits)):
            return 0
        if self.kv.prefix_caching:
            self.kv.pool.take(hits)
            request.block_table, request.num_computed_tokens = hits, cached
            self.prefix_queries += request.num_tokens
            self.prefix_hits += cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(cached, request.num_prompt_tokens)
        request.block_table = self.kv.grown(request.block_table, request.num_computed_tokens + num_tokens)
        return num_tokens

    def _namespace(self, request: Request) -> CacheNamespace:
        weights = self.lora.weights_identity(request.adapter_uid) if request.adapter_uid else ("base",)
        return CacheNamespace(weights, request.cache_salt)

    def _cache_blocks(self, request: Request, table: list[int], end: int) -> None:
        """After a step completed: key the request's full blocks up to `end` (positions it computed),
        so later prompts (the next turn of a conversation too) hit them. Only blocks the request
        still holds in the same place of its table (a preempted request's old blocks are gone)."""
        if not self.kv.prefix_caching or request.cache_root is None:
            return
        current = request.block_table
        full = min(end // self.kv.block_size, len(table), len(current))
        hashes = extend_hashes(request, request.cache_root, self.kv.block_size, full * self.kv.block_size)
        for i in range(full):
            if current[i] != table[i]:
                break
            self.kv.pool.cache(table[i], hashes[i])

    def _aging_barrier(self) -> int | None:
        """Arrival number of the oldest waiting request that has aged out and cannot get a slot."""
        for request in self.waiting:
            if request.skipped_steps < self.config.aging_steps or request.adapter_uid is None:
                continue
            if request.wait_reason is WaitReason.SLOTS_FULL:
                return request.arrival_seq
        return None
