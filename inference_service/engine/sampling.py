"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Rows fail alone: a row whose logits are not finite gets NON_FINITE, one whose sampling raises
(a bug) SAMPLING_FAILED, instead of a token; the engine ends that request only, and the other
rows of the batch (seeded ones too) are unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from inference_service.engine.request import SamplingParams, TokenLogprobs
from inference_service.kernels import greedy

log = logging.getLogger(__name__)

NON_FINITE = -1
SAMPLING_FAILED = -2
FORWARD_FAILED = -3  # set by the engine: the row's forward pass failed alone
LOGPROB_FLOOR = -9999.0  # the logprob shown for a token that could not be sampled


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           c_argmax: bool = True) -> list[int]:
    """One token per row of logits [S, V] (or a negative code, above). Each seeded row draws from
    its own generator, so a request's tokens do not depend on what else is in the batch.
    `c_argmax`: the C greedy pick where it runs (the platform plan's "greedy pick"), else torch's."""
    # max(dim).indices is argmax (the first maximum too), and about 2x faster on CPU here. The max
    # is NaN or +inf exactly when the row cannot be sampled (max propagates NaN; -inf entries are
    # harmless while the max is finite): one transfer from the device for the tokens and that mark.
    picked = greedy.argmax_rows(logits) if c_argmax else None  # the same, in one vectorised pass, on CPU
    if picked is None:
        best = logits.max(dim=-1)
        picked = best.indices, torch.isfinite(best.values)
    tokens: list[int] = torch.where(picked[1], picked[0], NON_FINITE).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if tokens[row] != NON_FINITE and not p.greedy:
            try:
                tokens[row] = _sample_row(logits[row], p, gen)
            except Exception:  # noqa: BLE001 - a bug: this row's request ends, the batch goes on
                log.exception("sampling row %d failed (%s)", row, p)
                tokens[row] = SAMPLING_FAILED
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits.float().cpu() / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p. The first token always stays, also
        # for a top_p below float32's resolution (compared as 0 there).
        drop = probs.cumsum(-1) - probs >= p.top_p
        drop[0] = False
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0:
        logits = min_p_filter(logits, p.min_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


# ---- OpenAI/vLLM parity: logits processing, min_p, logprobs ----------------------------------
# Kept apart from `sample`: a batch where no request asks for these never runs them.


class SampledRow(Protocol):
    """What processing a row's logits reads of its request (a `Request`, or the model runner's
    snapshot of one: with async scheduling the request's own lists may be a token behind)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def process_logits(logits: torch.Tensor, requests: Sequence[SampledRow],
                   eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Penalties, logit bias and min_tokens applied to the rows [S, V] whose request asks; the
    input is left as it was (a copy is made only when some row changes)."""
    rows = [row for row, r in enumerate(requests) if r.params.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        request = requests[row]
        p = request.params
        out = logits[row]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*request.prompt_token_ids, *request.output_token_ids}), device=out.device)
            scores = out[seen]
            out[seen] = torch.where(scores < 0, scores * p.repetition_penalty, scores / p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and request.output_token_ids:
            counts = torch.bincount(torch.tensor(request.output_token_ids, device=out.device),
                                    minlength=out.numel())[: out.numel()].to(out.dtype)
            out -= counts * p.frequency_penalty + (counts > 0).to(out.dtype) * p.presence_penalty
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=out.device)
            out.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=out.device, dtype=out.dtype))
        if len(request.output_token_ids) < p.min_tokens:
            banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if t < out.numel()]
            out[banned] = float("-inf")
    return logits


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Tokens whose probability is below min_p x the most likely one's get -inf (the top one stays)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The sampled token's log-probability and the top k, from one row of (processed) logits."""
    # A token a mask or min_tokens ruled out has -inf: shown as LOGPROB_FLOOR (vLLM's), as JSON has no -inf.
    logprobs = logits.float().log_softmax(-1).clamp_min(LOGPROB_FLOOR)
    top = torch.topk(logprobs, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
    return TokenLogprobs(token, float(logprobs[token]), pairs)


def step_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                  tokens: list[int]) -> list[TokenLogprobs | None]:
    """Each row's token logprobs where its request asks for them (None elsewhere)."""
    return [token_logprobs(logits[row], token, p.logprobs) if p.logprobs is not None and token >= 0 else None
            for row, (p, token) in enumerate(zip(params, tokens, strict=True))]
