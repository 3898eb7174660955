"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Rows fail alone: a row whose logits are not all finite, or whose sampling raises, gets no token
(None) and the engine ends that request only; the other rows of the batch are unaffected.
"""

from __future__ import annotations

import logging

import torch

from inference_service.request import SamplingParams

log = logging.getLogger(__name__)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int | None]:
    """One token per row of logits [S, V], None for a row that cannot be sampled. Each seeded row
    draws from its own generator, so a request's tokens do not depend on what else is in the batch."""
    # max(dim).indices is argmax (the first maximum too), and about 2x faster on CPU here. The max
    # is NaN or +inf exactly when the row cannot be sampled (max propagates NaN; -inf entries are
    # harmless while the max is finite): -1 marks those rows, one transfer from the device for both.
    best = logits.max(dim=-1)
    tokens: list[int | None] = torch.where(torch.isfinite(best.values), best.indices, -1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if tokens[row] == -1:
            tokens[row] = None
        elif not p.greedy:
            try:
                tokens[row] = _sample_row(logits[row], p, gen)
            except RuntimeError as exc:  # e.g. torch.multinomial on a degenerate distribution
                log.warning("sampling row %d failed: %s", row, exc)
                tokens[row] = None
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits.float().cpu() / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
