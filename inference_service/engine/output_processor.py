"""Output processing on the scheduler thread: from a sampled token to a `RequestOutput`.

One place for what a client sees of a request: finish reasons (stop tokens, EOS, length, stop
strings), the stop-string hold-back, TTFT/ITL, and the final output of every request however it
ended. Only requests with stop strings are decoded here, since a stop string must end its request at
an exact token. The others' text is decoded off the scheduler thread (engine/output_text.py): with
`detokenize=False` (the serving bridges) `text` is None and the front end's stream decodes it; with
`detokenize=True` (EngineCore's default, what an embedder gets) each output decodes its text when
the embedder reads it.
The scheduler advances requests (`Scheduler.postprocess`) and asks `on_token` whether a new token
ends one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from adapter_cache.errors import FailedPreconditionError, LoraplexError
from inference_service.engine.output_text import RequestText
from inference_service.engine.request import FinishReason, Request, RequestOutput
from inference_service.engine.sampling import FORWARD_FAILED, NON_FINITE, SAMPLING_FAILED
from inference_service.limits import shown
from inference_service.lora.registry import adapter_name
from inference_service.metrics_sink import MetricsSink
from inference_service.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


def sample_error(request: Request, token: int) -> LoraplexError | None:
    """The error that ends a request whose row sampled no token (`sampling.NON_FINITE`,
    `SAMPLING_FAILED`, `FORWARD_FAILED`), or None for a real token."""
    if token == NON_FINITE:
        log.warning("request %s: non-finite logits (adapter %s); ended alone", shown(request.request_id),
                    request.adapter_uid or "-")
        if request.adapter_uid is None:
            return LoraplexError("the base model produced non-finite logits for this request")
        return FailedPreconditionError(
            f"adapter {adapter_name(request.adapter_uid)} made the model produce non-finite logits "
            "(its weights or scaling overflow this model's dtype)"
        )
    if token == SAMPLING_FAILED:
        return LoraplexError(f"internal error sampling request {request.request_id}")
    if token == FORWARD_FAILED:
        return LoraplexError(f"internal error in request {request.request_id}")
    return None


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    emitted: int = 0  # characters of the text already sent (stop strings hold a tail back)


class OutputProcessor:
    """Per-request text state and this step's outputs, in the order requests produced them."""

    def __init__(self, tokenizer: Tokenizer, metrics: MetricsSink, detokenize: bool = True) -> None:
        self.tokenizer, self.metrics = tokenizer, metrics
        self.detokenize = detokenize
        self._text: dict[str, _TextState] = {}  # requests with stop strings: decoded here
        self._on_read: dict[str, RequestText] = {}  # detokenize=True, no stop strings: decoded when read
        self._step: dict[str, RequestOutput] = {}

    def add(self, request: Request) -> None:
        if not request.params.stop:
            if self.detokenize:
                self._on_read[request.request_id] = RequestText(self.tokenizer, request.prompt_token_ids,
                                                                request.params)
            return  # decoded by whoever reads it, off this thread
        # Seeded with the prompt, so the first output token decodes as it would after it.
        self._text[request.request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens))

    def on_token(self, request: Request, logits: torch.Tensor | None, now: float) -> FinishReason | None:
        """The request's newest output token (appended already): its output delta for this step,
        and the reason it ends the request, if it does."""
        token = request.output_token_ids[-1]
        timings = request.timings
        if timings.first_token is None:
            timings.first_token = now
            self.metrics.first_token(now - timings.arrival)
        else:
            self.metrics.inter_token(now - (timings.last_token or now))
        timings.last_token = now
        p = request.params
        reason = None
        if token in p.stop_token_ids:
            reason, request.stop_reason = FinishReason.STOP, token
        elif (not p.ignore_eos or p.grammar is not None) and token in self.tokenizer.eos_token_ids:
            reason = FinishReason.EOS  # under a grammar, EOS is allowed only where the grammar is complete
        elif len(request.output_token_ids) >= p.max_new_tokens:
            reason = FinishReason.LENGTH
        text: str | None = None
        state = self._text.get(request.request_id)
        if state is not None:
            text, reason = self._text_delta(request, state, reason)
        self._step[request.request_id] = self._output(
            request,
            text,
            new_token_ids=[token],
            prompt_tokens=request.num_prompt_tokens,
            generated_tokens=len(request.output_token_ids),
            timings=timings,
            logits=[logits] if p.return_logits else None,  # type: ignore[list-item]
            logprobs=[request.step_logprobs] if p.logprobs is not None else None,  # type: ignore[list-item]
            stop_reason=request.stop_reason,
        )
        return reason

    @staticmethod
    def _text_delta(request: Request, state: _TextState,
                    reason: FinishReason | None) -> tuple[str, FinishReason | None]:
        """The newest token's text delta, and the finish reason once a stop string is found."""
        p = request.params
        detok = state.detokenizer
        previous = detok.text
        detok.update(request.output_token_ids, final=reason is not None)
        text = detok.text
        if p.stop and reason in (None, FinishReason.LENGTH):
            longest = max(len(s) for s in p.stop)
            window_start = max(0, len(previous) - longest)
            matching = len(request.output_token_ids) >= p.min_tokens  # no stop string before min_tokens
            hits = [(i, s) for s in p.stop if matching and (i := text.find(s, window_start)) >= 0]
            if hits:
                first, request.stop_reason = min(hits)
                text, reason = text[:first], FinishReason.STOP
            elif reason is None:
                # Hold back a tail that may yet become a stop string: never stream part of one.
                text = text[: max(0, len(text) - longest + 1)]
        delta = text[state.emitted :]
        state.emitted += len(delta)
        return delta, reason

    def take(self, finished: list[Request]) -> list[RequestOutput]:
        """This step's outputs: the token deltas, and a final output for each request that ended."""
        for request in finished:
            self._step[request.request_id] = self._final_output(request, self._step.get(request.request_id))
        outputs = list(self._step.values())
        self._step.clear()
        return outputs

    def _output(self, request: Request, text: str | None, **fields: object) -> RequestOutput:
        """A new output of `request`: its text decoded when read, or `text` (None: the front end's)."""
        on_read = self._on_read.get(request.request_id)
        if on_read is not None:
            return on_read.output(request_id=request.request_id, **fields)
        return RequestOutput(request_id=request.request_id, text=text, **fields)  # type: ignore[arg-type]

    def _final_output(self, request: Request, output: RequestOutput | None) -> RequestOutput:
        if output is None:
            output = self._output(
                request,
                "",
                new_token_ids=[],
                prompt_tokens=request.num_prompt_tokens,
                generated_tokens=len(request.output_token_ids),
                timings=request.timings,
            )
        request.timings.finished = time.monotonic()
        output.finished, output.finish_reason, output.error = True, request.finish_reason, request.error
        output.cached_tokens = max(request.num_cached_tokens, 0)
        self._text.pop(request.request_id, None)
        self._on_read.pop(request.request_id, None)
        self.metrics.tokens(request.num_prompt_tokens, len(request.output_token_ids))
        reason = request.finish_reason.value if request.finish_reason else "error"
        self.metrics.request_finished(reason, adapter_name(request.adapter_uid) if request.adapter_uid else None)
        log.debug(  # the server logs each outcome with its status code
            "request %s adapter=%s finished: %s, %d prompt + %d generated tokens%s",
            request.request_id, request.adapter_uid, reason, request.num_prompt_tokens,
            len(request.output_token_ids), f" ({request.error})" if request.error else "",
        )
        return output
