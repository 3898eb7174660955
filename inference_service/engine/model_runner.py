"""ModelRunner: runs one scheduled batch through the model, its KV cache and the LoRAManager.

Thin on purpose: `plan` takes what a step needs of each request (on the scheduler thread),
`execute` packs it into tensors, runs the model and samples (on the device worker with async
scheduling); everything about adapters is the LoRAManager's, everything about admission the
Scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference_service.engine.batch import ScheduledBatch
from inference_service.engine.decode_graphs import DecodeGraphs
from inference_service.engine.grammar import accept, mask_logits
from inference_service.engine.kv_cache import KVCache
from inference_service.engine.request import Request, SamplingParams, TokenLogprobs
from inference_service.engine.sampling import NON_FINITE, process_logits, sample, step_logprobs
from inference_service.lora.manager import LoRAManager
from inference_service.lora.ops import build_lora_batch
from inference_service.models.batch import AttentionBatch, ForwardBatch, PrefillSegment
from inference_service.models.decode_stack import DecodeStack
from inference_service.models.registry import CausalLM
from inference_service.tokenizer import Tokenizer

# request id -> (token or a negative code, logits if asked, logprobs if asked), per sampled row
StepResults = dict[str, tuple[int, torch.Tensor | None, TokenLogprobs | None]]


@dataclass(slots=True)
class PlannedRow:
    """One request's part of a step, taken on the scheduler thread when the step is planned:
    `execute` reads nothing else of the request (with async scheduling the scheduler goes on
    changing it while the step runs on the device worker)."""

    request_id: str
    start: int  # first position computed
    input_ids: list[int]  # tokens [start, end); a pending row's last one is filled in by execute
    pending: bool  # the last input is the request's sample from the previous step, not filled in yet
    block_table: list[int]  # the request's table then (tables are replaced, never changed in place)
    slot: int  # the adapter's handle in the pool (-1: the base model)
    rank: int
    pages: tuple[int, ...]  # the adapter's pages in the pool (stable while the request references it)
    samples: bool  # the row reaches the request's end: a token is sampled
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # a copy, only where the params' logits processing reads the history
    matcher: object | None  # structured output: the request's grammar matcher, where the row samples

    @property
    def argmax_only(self) -> bool:
        """The row needs only its logits' first argmax (greedy, nothing else reads its logits)."""
        return self.matcher is None and self.params.argmax_only


class ModelRunner:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, lora: LoRAManager, kv: KVCache,
                 graphs: DecodeGraphs | None = None, decode_stack: DecodeStack | None = None,
                 c_argmax: bool = True) -> None:
        """The engine core builds the LoRA slots, the KV cache, the captured decode steps and the decode
        stack for the model (`engine.core.build_lora_manager`, `build_kv_cache`, `build_decode_graphs`,
        `Platform.with_model`); the runner only uses them. `decode_stack`: the fast path for steps of
        decodes alone, asked first (it declines a step it cannot run), where the platform plan has one;
        `c_argmax`: the plan's greedy pick is the C kernel (`sampling.sample`)."""
        self.model, self.tokenizer, self.lora, self.kv, self.graphs = model, tokenizer, lora, kv, graphs
        self.decode_stack, self.c_argmax = decode_stack, c_argmax
        self.device = model.device

    def run(self, batch: ScheduledBatch) -> StepResults:
        """Plan and execute one step on this thread (the engine without async scheduling)."""
        return self.execute(self.plan(batch), {})

    def plan(self, batch: ScheduledBatch) -> list[PlannedRow]:
        """The step's rows, ordered by slot (so the LoRA op usually sees contiguous, equally long
        groups, no gathers), taken on the scheduler thread: `execute` reads nothing else of a request."""
        rows = []
        for request, num_tokens in batch.items:
            start = request.num_computed_tokens
            end = start + num_tokens
            input_ids = request.token_ids(start, end)
            pending = len(input_ids) < num_tokens  # the newest token is still being sampled
            assert len(input_ids) >= num_tokens - 1, f"{request.request_id}: more than one token pending"
            samples = end == request.num_tokens
            outputs = []
            if samples and request.params.processes_logits:  # penalties read the history
                outputs = list(request.output_token_ids)
            if pending:
                input_ids.append(0)
            slot = self._slot(request)
            rank, pages = 0, ()
            if slot >= 0 and request.adapter_uid:
                rank, pages = self.lora.rank_of(request.adapter_uid), self.lora.pages_of(request.adapter_uid)
            rows.append(PlannedRow(request.request_id, start, input_ids, pending, request.block_table, slot,
                                   rank, pages, samples, request.params, request.generator, request.prompt_token_ids,
                                   outputs, request.matcher if samples else None))
        rows.sort(key=lambda row: row.slot)
        return rows

    @torch.inference_mode()
    def execute(self, rows: list[PlannedRow], previous: dict[str, int]) -> StepResults:
        """Forward one planned step; `previous` holds the tokens the step before sampled (a pending
        row's last input). Returns (next token, logits if asked, logprobs if asked) for the rows that
        reach their end. The token is negative where that row could not be sampled
        (`sampling.NON_FINITE`, `SAMPLING_FAILED`): the engine ends that request alone."""
        for row in rows:
            if row.pending:  # filled in once: a row run again after a failed pass finds it done
                # A negative code (no token was sampled) ends that request when its step is
                # postprocessed: this row's result is dropped then, any input will do.
                row.input_ids[-1] = max(previous[row.request_id], 0)
                if row.samples and row.params.processes_logits:
                    row.output_token_ids.append(row.input_ids[-1])
                row.pending = False
        captured = self._captured_decode(rows)
        if captured is not None:
            return captured
        forward, sampled = self._tensors(rows)
        # Sampling too: its reductions run on the model's threads as well (see ThreadCopyEngine).
        with self.lora.computing():
            hidden = self.hidden(forward)
            if not sampled:
                return {}
            # Rows that want only the top token (plain greedy: no logits processing, logprobs,
            # grammar or logits handed back) let the LM head pick it without writing the logits.
            picked = self.model.greedy(hidden) if all(r.argmax_only for r in sampled) else None
            if picked is not None:
                tokens: list[int] = torch.where(picked[1], picked[0], NON_FINITE).tolist()
                return {r.request_id: (t, None, None) for r, t in zip(sampled, tokens, strict=True)}
            logits = self.model.logits(hidden)
            processed = process_logits(logits, sampled, self.tokenizer.eos_token_ids)  # return_logits: raw
            matchers = [r.matcher for r in sampled]
            constrained = any(m is not None for m in matchers)
            if constrained:  # structured output: after the adapted forward pass and the logits processors
                processed = mask_logits(processed, matchers)
            params = [r.params for r in sampled]
            tokens = sample(processed, params, [r.generator for r in sampled], self.c_argmax)
            logprobs = step_logprobs(processed, params, tokens)
            if constrained:
                accept(matchers, tokens)
        return {
            r.request_id: (t, logits[i] if r.params.return_logits else None, logprobs[i])
            for i, (r, t) in enumerate(zip(sampled, tokens, strict=True))
        }

    def _captured_decode(self, rows: list[PlannedRow]) -> StepResults | None:
        """The step through its bucket's captured decode step, where it is one: every row one token
        that samples greedily with nothing else read of its logits; None otherwise."""
        graphs = self.graphs
        if graphs is None or not rows or not graphs.fits(len(rows), max(len(r.block_table) for r in rows)):
            return None
        if not all(len(r.input_ids) == 1 and r.samples and r.argmax_only for r in rows):
            return None
        with self.lora.computing():
            tokens: list[int] = graphs.run([r.input_ids[0] for r in rows], [r.start for r in rows],
                                           [r.block_table for r in rows], [(r.pages, r.rank) for r in rows]).tolist()
        return {r.request_id: (t, None, None) for r, t in zip(rows, tokens, strict=True)}

    def _tensors(self, rows: list[PlannedRow]) -> tuple[ForwardBatch, list[PlannedRow]]:
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        token_slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[PlannedRow] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        context_index: list[int] = []  # the blocks of every prefill over cached context, in order
        ranks: dict[int, int] = {}
        pages: dict[int, tuple[int, ...]] = {}
        for planned in rows:
            start, row, num_tokens = planned.start, len(input_ids), len(planned.input_ids)
            end = start + num_tokens
            input_ids.extend(planned.input_ids)
            positions.extend(range(start, end))
            table = planned.block_table
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            token_slots.extend([planned.slot] * num_tokens)
            if planned.slot >= 0:
                ranks[planned.slot], pages[planned.slot] = planned.rank, planned.pages
            if num_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefills.append(PrefillSegment(row, row + num_tokens, start, self._tensor(table)))
                if start > 0:
                    context_index.extend(table)
            if planned.samples:
                logits_rows.append(row + num_tokens - 1)
                sampled.append(planned)
        attention = AttentionBatch(slot_mapping=self._tensor(slot_mapping), prefills=prefills,
                                   context_index=self._tensor(context_index) if context_index else None)
        if decode_rows:
            attention.decode_rows = self._tensor(decode_rows)
            attention.decode_block_tables = padded_tables(decode_tables).to(self.device, non_blocking=True)
            attention.decode_lens = self._tensor(decode_lens)
        forward = ForwardBatch(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            attention=attention,
            lora=build_lora_batch(token_slots, pages, ranks, self.lora.page_rank, self.lora.zero_page, self.device),
            logits_rows=self._tensor(logits_rows),
        )
        return forward, sampled

    def hidden(self, forward: ForwardBatch) -> torch.Tensor:
        """The LM head's input for the step: the decode stack's where it takes the step, else the model's."""
        hidden = self.decode_stack.hidden(forward, self.kv.layers) if self.decode_stack is not None else None
        return hidden if hidden is not None else self.model.hidden(forward, self.kv.layers)

    def _slot(self, request: Request) -> int:
        if request.adapter_uid is None:
            return -1
        slot = self.lora.slot_of(request.adapter_uid)
        assert slot is not None, f"{request.request_id} scheduled before its adapter was loaded"
        return slot

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one int64 tensor [len(tables), longest], padded with block 0 (never read past a
    row's length). Filled row by row through numpy: a nested list through torch.tensor took 3x as long
    (32 tables of 512 blocks, an 8K context: 872 us a step against 280)."""
    out = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return torch.from_numpy(out)
