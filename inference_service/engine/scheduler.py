"""Continuous batching with adapter-aware, tenant-fair admission.

Each step: drain finished adapter loads, keep running requests going (decode or the next
prefill chunk, preempting by recompute when KV blocks run out: the lowest priority, then the
newest), then admit waiting requests by priority (lower first, vLLM's semantics; all are 0 unless
a client asks), then by their tenant's fair-share counter (engine.fair_share: the tenant that got
the least service first), then FCFS. A request whose adapter is not LOADED triggers its load and is
skipped, so it never blocks the line; once a request has been passed over `aging_steps` times and
still cannot get a slot, later requests stop overtaking it, so slots drain and nothing starves.

When no seat (`max_num_seqs`) or KV memory is free, a waiting request that could run now preempts
a running one: for a seat it is paused (it keeps its KV blocks and resumes where it stopped; paused
requests' blocks are the first dropped when memory runs short), for memory it recomputes later.
The victim is first one of lower priority (the lowest, then the newest); else, under
fair share and at equal priority, the newest of the tenant holding the most seats per weight,
provided that tenant holds more seats per weight than the waiting one's would after admission and
has had at least as much service (its counter). The first rule lets urgent work in at once; the
second gives a light tenant a seat within one step beside a tenant that fills the batch, and never
moves a seat between tenants already at equal shares, so preemptions cannot ping-pong.

A request's n samples (`Request.group`) share its prompt's prefill: the first sample added leads,
and with the prefix cache on the others wait (WaitReason.SAMPLES) until the leader's prompt blocks
are cached (its first token: the step that completed its prompt keyed them) or the leader ended,
then hit those blocks and compute only the prompt's tail. With the prefix cache off, or a prompt
shorter than one block past its last token, they are not held and prefill separately.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator

import torch

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from inference_service.engine.batch import ScheduledBatch
from inference_service.engine.config import EngineConfig
from inference_service.engine.fair_share import ANONYMOUS, FairShare
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
        self.preemptions: Counter[str] = Counter()  # by cause (request.PREEMPTION_CAUSES)
        self.fair = FairShare(decode_weight=config.fair_share_decode_weight, enabled=config.fair_share)
        # Prefix cache, in tokens: what admissions looked up and what they found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        # n samples: group id -> the sample whose prefill the others wait for, until it is cached
        # (an entry lives no longer than its leader: O(active requests)).
        self.leaders: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        request.arrival_seq = next(self._arrivals)
        self.requests[request.request_id] = request
        self.fair.joined(tenant_of(request))
        self._enqueue(request)
        if (request.group is not None and self.kv.prefix_caching and request.group not in self.leaders
                and request.num_prompt_tokens > self.kv.block_size):  # at least one full block to share
            self.leaders[request.group] = request

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue at its place by priority (lower first, vLLM's semantics), then
        arrival: FCFS among equals. A new request walks back only past those it overtakes (with
        every priority equal, the default, this is an append); a preempted one goes back to its
        place by its original arrival. Aging still holds: a request past the aging barrier waits for
        the aged one's slot whatever its priority, so no adapter starves."""
        waiting, place = self.waiting, (request.priority, request.arrival_seq)
        at = len(waiting)
        while at and (waiting[at - 1].priority, waiting[at - 1].arrival_seq) > place:
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
        self.fair.left(tenant_of(request))
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
            start = request.num_computed_tokens
            request.num_computed_tokens += num_tokens
            self.fair.charge(tenant_of(request), self._cost(request, start, request.num_computed_tokens))
            request.charged_tokens = max(request.charged_tokens, request.num_computed_tokens)
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
            if _ends_in_flight(request):
                continue  # its in-flight step samples its last token (async scheduling)
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_tokens
            if target > len(request.block_table) * block_size:  # most decode steps fit their last block
                while not self.kv.can_grow(request.block_table, target):
                    if self._drop_paused_kv():
                        continue  # a paused request's blocks first: it was not running anyway
                    # The lowest priority first, then the newest (running is in admission order);
                    # this request itself when it is that one.
                    victim = max(((r.priority, i, r) for i, r in enumerate(self.running) if id(r) not in scheduled),
                                 key=lambda c: c[:2], default=(0, 0, None))[2]
                    self._preempt(victim, "kv_cache")
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    continue
                request.block_table = self.kv.grown(request.block_table, target)
            batch.items.append((request, num_tokens))
            scheduled.add(id(request))
            budget -= num_tokens
        return budget

    def _preempt(self, request: Request | None, cause: str, keep_kv: bool = False) -> None:
        """Take a running request out of the batch, back into the waiting queue at its place by
        priority and arrival. `keep_kv` (a preemption for a seat): it is paused, keeps its KV blocks
        and resumes where it stopped, unless memory runs short first (`_drop_paused_kv`). Otherwise
        (for memory) recompute: its blocks are dropped (the full ones stay prefix-cached, so the
        recompute mostly hits them) and it re-prefills prompt + output later. Its adapter reference
        stays either way: it is still live, and `finish` releases that once."""
        assert request is not None, "nothing left to preempt"
        self.running.remove(request)
        if not keep_kv:
            self._drop_kv(request)
        request.status = RequestStatus.WAITING
        request.wait_reason = WaitReason.PREEMPTED  # until the next pass considers it (this one may not)
        self._enqueue(request)
        self.num_preemptions += 1
        self.preemptions[cause] += 1
        log.info("preempted %s of tenant %r (%s); it %s", shown(request.request_id), tenant_of(request), cause,
                 "keeps its KV blocks and resumes" if keep_kv else "will recompute")

    def _drop_kv(self, request: Request) -> None:
        self.kv.release(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0
        request.keyed_blocks = 0

    def _drop_paused_kv(self, keep: Collection[Request] = ()) -> bool:
        """Free the blocks of one paused request (the lowest priority, then the newest), which will
        recompute; False when no paused request holds any. `keep`: waiting requests that are not
        paused (the one being admitted, and those this pass admitted: still in the waiting queue,
        holding the blocks of their planned step). O(waiting), on memory pressure only."""
        kept = {id(r) for r in keep}
        paused = [r for r in self.waiting if r.block_table and id(r) not in kept]
        if not paused:
            return False
        victim = max(paused, key=lambda r: (r.priority, r.arrival_seq))
        self._drop_kv(victim)
        log.info("dropped the KV blocks of paused %s (memory); it will recompute", shown(victim.request_id))
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        barred = self._aging_barrier()
        needed = {r.adapter_uid for r in self.running if r.adapter_uid}
        needed |= {r.adapter_uid for r in self.waiting if r.adapter_uid and not barred(r)}
        admission = _Admission(batch, budget, Counter(tenant_of(r) for r in self.running), self.fair)
        failed: list[tuple[Request, LoraplexError]] = []
        blocked = False
        for request in self._admission_order(admission):
            if request.matcher is None and request.grammar is not None and not self._grammar_ready(request, failed):
                reason = WaitReason.GRAMMAR  # compiling off the step; the line goes on without it
            elif self._held(request):
                reason = WaitReason.SAMPLES  # the line goes on without it
            elif blocked:
                reason = WaitReason.QUEUED
            elif barred(request):
                reason = WaitReason.AGING  # an older request must get a slot first
            elif admission.budget == 0:
                reason = WaitReason.BATCH_FULL
            elif self._tenant_full(request, admission.seats):
                reason = WaitReason.TENANT_LIMIT  # the line goes on without it
            else:
                reason = self._try_admit(request, admission, needed)
                if reason is None:
                    continue
                blocked = reason is WaitReason.KV_CACHE  # FCFS for memory: no overtaking on KV, or long prompts starve
            request.skipped_steps += 1
            request.wait_reason = reason
        for request in admission.admitted:
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for request, error in failed:
            self.finish(request, FinishReason.ERROR, error)

    def _try_admit(self, request: Request, admission: _Admission, needed: set[str]) -> WaitReason | None:
        """Admit `request` into this step if a seat, its adapter and KV memory are there, preempting
        for a seat or for memory where the preemption rules allow (see the module's docstring).
        None: admitted; else why it waits."""
        victim: tuple[Request, str] | None = None
        if len(self.running) + len(admission.admitted) >= self.config.max_num_seqs:
            victim = self._victim(request, admission)
            if victim is None:
                return WaitReason.BATCH_FULL
        if request.adapter_uid is not None and self.lora.slot_of(request.adapter_uid) is None:
            # Preempt only once it could run: meanwhile its adapter loads beside the full batch.
            got_slot = self.lora.ensure_loading(request.adapter_uid, needed)
            return WaitReason.ADAPTER_LOADING if got_slot else WaitReason.SLOTS_FULL
        if victim is not None:
            self._preempt_planned(admission, *victim, keep_kv=True)
        if request.timings.adapter_ready is None:
            request.timings.adapter_ready = time.monotonic()
        num_tokens = self._resume(request, admission.budget) if request.block_table else 0
        while not num_tokens and not (num_tokens := self._admit_kv(request, admission.budget)):
            if self._drop_paused_kv(keep=(request, *admission.admitted)):
                continue
            victim = self._victim(request, admission)
            if victim is None:
                return WaitReason.KV_CACHE
            self._preempt_planned(admission, *victim)
        tenant = tenant_of(request)
        admission.admitted.append(request)
        admission.batch.items.append((request, num_tokens))
        admission.budget -= num_tokens
        admission.seats[tenant] += 1
        start = request.num_computed_tokens
        admission.tentative[tenant] = admission.tentative.get(tenant, 0.0) + self._cost(request, start,
                                                                                       start + num_tokens)
        return None

    def _resume(self, request: Request, budget: int) -> int:
        """A paused request's tokens this step, its blocks grown for them; 0 when memory is short,
        having dropped its blocks (it recomputes like a new request)."""
        num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
        target = request.num_computed_tokens + num_tokens
        if num_tokens and self.kv.can_grow(request.block_table, target):
            request.block_table = self.kv.grown(request.block_table, target)
            return num_tokens
        self._drop_kv(request)
        return 0

    def _preempt_planned(self, admission: _Admission, victim: Request, cause: str, keep_kv: bool = False) -> None:
        """Preempt a running request this step may have planned: its row leaves the step first."""
        for i, (request, num_tokens) in enumerate(admission.batch.items):
            if request is victim:
                del admission.batch.items[i]
                admission.budget += num_tokens
                break
        self._preempt(victim, cause, keep_kv)
        admission.seats[tenant_of(victim)] -= 1
        admission.no_victim.clear()

    def _victim(self, request: Request, admission: _Admission) -> tuple[Request, str] | None:
        """The running request `request` may preempt, and why (None: none). Memoized per (tenant,
        priority) until the next preemption: a backlog of one tenant costs O(running) a step, not
        O(running) per waiting request."""
        tenant = tenant_of(request)
        key = (tenant, request.priority)
        if key in admission.no_victim:
            return None
        candidates = [r for r in self.running if not _ends_in_flight(r)]
        lower = [r for r in candidates if r.priority > request.priority]
        if lower:
            return max(lower, key=lambda r: (r.priority, r.arrival_seq)), "priority"
        best: Request | None = None
        if self.fair.enabled:
            mine = admission.service(tenant)
            my_share = (admission.seats[tenant] + 1) / weight_of(request)
            best_rank: tuple[float, int] = (0.0, 0)
            for r in candidates:
                other = tenant_of(r)
                if other == tenant or r.priority != request.priority:
                    continue
                share = admission.seats[other] / weight_of(r)
                if share <= my_share or admission.service(other) < mine:
                    continue
                if best is None or (share, r.arrival_seq) > best_rank:
                    best, best_rank = r, (share, r.arrival_seq)
        if best is None:
            admission.no_victim.add(key)
            return None
        return best, "fair_share"

    def _admission_order(self, admission: _Admission) -> Iterator[Request]:
        """Waiting requests in the order admission considers them: priority, then the tenant's
        service (its fair-share counter with what this pass admitted for it, read as the caller
        goes), then arrival. A snapshot: requests preempted during the pass wait for the next."""
        if not self.fair.enabled or len(self.fair.live) <= 1:
            yield from list(self.waiting)  # one tenant (or fair share off): priority, then arrival
            return
        queues: dict[str, deque[Request]] = {}
        for request in self.waiting:  # each tenant's queue keeps the waiting queue's order
            queues.setdefault(tenant_of(request), deque()).append(request)

        def head(tenant: str) -> tuple[int, float, int, str]:
            first = queues[tenant][0]
            return first.priority, admission.service(tenant), first.arrival_seq, tenant

        heap = [head(tenant) for tenant in queues]
        heapq.heapify(heap)
        while heap:
            tenant = heapq.heappop(heap)[3]
            yield queues[tenant].popleft()
            if queues[tenant]:
                heapq.heappush(heap, head(tenant))

    def _cost(self, request: Request, start: int, end: int) -> float:
        """Fair-share cost of computing positions [start, end): positions computed before (a
        recompute after preemption) and prefix-cache hits (never computed) are free."""
        start = max(start, request.charged_tokens)
        if end <= start:
            return 0.0
        prefill = max(0, min(end, request.num_prompt_tokens) - start)
        return self.fair.cost(prefill, end - start - prefill, weight_of(request))

    @staticmethod
    def _tenant_full(request: Request, seats: Counter[str]) -> bool:
        tenant = request.tenant
        return tenant is not None and tenant.max_running is not None and seats[tenant.name] >= tenant.max_running

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
        still holds in the same place of its table (a preempted request's old blocks are gone).
        Blocks keyed by an earlier step are not offered again: a decode step keys at most one new
        block, where going over the whole table cost O(context) a request and step."""
        if not self.kv.prefix_caching or request.cache_root is None:
            return
        current = request.block_table
        full = min(end // self.kv.block_size, len(table), len(current))
        hashes = extend_hashes(request, request.cache_root, self.kv.block_size, full * self.kv.block_size)
        for i in range(request.keyed_blocks, full):
            if current[i] != table[i]:
                break
            self.kv.pool.cache(table[i], hashes[i])
            request.keyed_blocks = i + 1

    def _aging_barrier(self) -> Callable[[Request], bool]:
        """Which requests wait behind the oldest waiting request that has aged out and cannot get a
        slot: later ones with an adapter whose pool pages it could take (with per-tenant pool shares,
        not those of a tenant within its share, which it could never evict: lora/pool_shares.py)."""
        for aged in self.waiting:
            if aged.skipped_steps < self.config.aging_steps or aged.adapter_uid is None:
                continue
            if aged.wait_reason is WaitReason.SLOTS_FULL:
                seq, competes = aged.arrival_seq, self.lora.held_back_by(aged.adapter_uid)
                return lambda r: r.adapter_uid is not None and r.arrival_seq > seq and competes(r.adapter_uid)
        return lambda r: False


class _Admission:
    """One pass of admission: the step being filled and what the pass changed so far."""

    def __init__(self, batch: ScheduledBatch, budget: int, seats: Counter[str], fair: FairShare) -> None:
        self.batch, self.budget, self.fair = batch, budget, fair
        self.seats = seats  # running requests per tenant, with this pass's admissions and preemptions
        self.admitted: list[Request] = []
        self.tentative: dict[str, float] = {}  # fair-share cost of this pass's admissions, per tenant
        self.no_victim: set[tuple[str, int]] = set()  # (tenant, priority) that found none since a preemption

    def service(self, tenant: str) -> float:
        """The tenant's fair-share counter with what this pass admitted for it."""
        return self.fair.counter(tenant) + self.tentative.get(tenant, 0.0)


def tenant_of(request: Request) -> str:
    return request.tenant.name if request.tenant is not None else ANONYMOUS


def weight_of(request: Request) -> float:
    return request.tenant.weight if request.tenant is not None else 1.0


def _ends_in_flight(request: Request) -> bool:
    """Its in-flight step samples its last token (async scheduling): nothing left to run or to preempt."""
    return bool(request.num_pending_tokens) and \
        len(request.output_token_ids) + request.num_pending_tokens >= request.params.max_new_tokens
