"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Rows fail alone: a row whose logits are not finite gets NON_FINITE, one whose sampling raises
(a bug) SAMPLING_FAILED, instead of a token; the engine ends that request only, and the other
rows of the batch (seeded ones too) are unaffected.
"""

from __future__ import annotations

import logging

import torch

from inference_service.request import SamplingParams

log = logging.getLogger(__name__)

NON_FINITE = -1
SAMPLING_FAILED = -2


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [S, V] (or a negative code, above). Each seeded row draws from
    its own generator, so a request's tokens do not depend on what else is in the batch."""
    # max(dim).indices is argmax (the first maximum too), and about 2x faster on CPU here. The max
    # is NaN or +inf exactly when the row cannot be sampled (max propagates NaN; -inf entries are
    # harmless while the max is finite): one transfer from the device for the tokens and that mark.
    best = logits.max(dim=-1)
    tokens: list[int] = torch.where(torch.isfinite(best.values), best.indices, NON_FINITE).tolist()
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
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
