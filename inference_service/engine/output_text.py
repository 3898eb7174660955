"""A request's text, decoded off the scheduler step: by the front end's stream, or when an embedder
reads `RequestOutput.text`.

The step hands out token ids only (a request with stop strings excepted: a stop string must end it
at an exact token, so the core decodes that one, engine/output_processor.py). Decoding happens on
the consumer's side, in the request's order, with the same incremental detokenizer either way:
- `StreamText`: the front ends' streams (engine/streams.py) fill each output as it is taken;
- `DecodedOnRead`: what an EngineCore with `detokenize=True` (its default, what an embedder gets)
  returns: each output's `text` is decoded when first read, on the reading thread, after the
  request's earlier outputs. An embedder that never reads the text never pays for it; one that does
  pays it on its own thread, between or beside steps, never inside one.
"""

from __future__ import annotations

import collections
from typing import Any

from inference_service.engine.request import FinishReason, RequestOutput, SamplingParams
from inference_service.tokenizer import IncrementalDetokenizer, Tokenizer

# Finishes that flush the detokenizer's held-back tail (an incomplete character at the end): the
# output is complete. A cancelled or failed request's tail is dropped, as the core does.
_COMPLETE = (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP)


class StreamText:
    """Text deltas for outputs the core left undecoded (`RequestOutput.text is None`)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer, self._prompt, self._params = tokenizer, prompt_token_ids, params
        self._detokenizer: IncrementalDetokenizer | None = None  # made on first use: the prompt's decode
        self._output_ids: list[int] = []

    def fill(self, output: RequestOutput) -> None:
        if output.text is None:
            output.text = self.delta(output.new_token_ids, output.finished, output.finish_reason)

    def delta(self, new_token_ids: list[int], finished: bool, finish_reason: FinishReason | None) -> str:
        """The text of the request's next output (outputs in order): a complete finish flushes the
        held-back tail, a cancelled or failed one drops it."""
        if self._detokenizer is None:
            self._detokenizer = IncrementalDetokenizer(self._tokenizer, self._prompt, self._params.skip_special_tokens)
        self._output_ids += new_token_ids
        complete = finished and finish_reason in _COMPLETE
        return self._detokenizer.update(self._output_ids, final=complete) if new_token_ids or complete else ""


class DecodedOnRead(RequestOutput):
    """A RequestOutput whose `text` is decoded when first read (its request's earlier outputs
    first). Set `text` and it is plain text; equality, repr and pickling read it like any field."""

    _source: RequestText | None = None

    @property  # type: ignore[override]
    def text(self) -> str | None:
        if self._source is not None:
            self._source.settle(self)
        return self.__dict__.get("_text")

    @text.setter
    def text(self, value: str | None) -> None:
        self.__dict__["_text"] = value
        self._source = None

    def __getstate__(self) -> dict[str, Any]:
        self.text  # noqa: B018 - decoded before it leaves: the decoder stays here
        return {k: v for k, v in self.__dict__.items() if k != "_source"}


class RequestText:
    """One request's outputs whose text is not decoded yet, in order."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._text = StreamText(tokenizer, prompt_token_ids, params)
        self._pending: collections.deque[DecodedOnRead] = collections.deque()

    def output(self, **fields: Any) -> DecodedOnRead:
        """The request's next output (RequestOutput's fields but `text`), decoded when read."""
        output = DecodedOnRead(text=None, **fields)
        output._source = self
        self._pending.append(output)
        return output

    def settle(self, output: DecodedOnRead) -> None:
        """Decodes the pending outputs up to and including `output`."""
        while output._source is not None:
            earlier = self._pending.popleft()
            earlier.text = self._text.delta(earlier.new_token_ids, earlier.finished, earlier.finish_reason)
