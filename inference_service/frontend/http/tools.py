"""Chat tool calls: what a request's `tools` and `tool_choice` ask of its answer, and that answer in
OpenAI's shape, whole or streamed as `tool_calls` deltas.

Three modes (docs/http.md, "Tools"):
- a named function (`tool_choice: {"type": "function", ...}`): the answer is that function's arguments,
  generated under their JSON schema (the structured-output grammar), so it is always a valid call;
- `required`: a JSON list of `{name, parameters}` over the tools, under a grammar too;
- `auto` (the default with tools): the model answers freely and the chat template's tool-call syntax
  is parsed out of its text (frontend/tool_parsers.py); text that is no valid call stays content.
`none`: a text answer (the template still shows the model the tools, as vLLM does).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from inference_service.frontend.http.errors import BadField
from inference_service.frontend.http.protocol import ChatCompletionRequest, FunctionDefinition, _Sampling
from inference_service.frontend.tool_parsers import ParsedAnswer, ParsedCall, ToolCallParser, ToolTextStream
from inference_service.structured import GrammarSpec, json_schema_spec


@dataclass(frozen=True)
class ToolCalls:
    """A chat request's tool mode: `named` (its function), `required`, or `parser` (auto)."""

    named: str | None = None
    parser: ToolCallParser | None = None  # auto: calls parsed out of free text
    tools: frozenset[str] = frozenset()

    @property
    def constrained(self) -> bool:
        """The answer is generated under the calls' grammar (named or required)."""
        return self.parser is None

    @staticmethod
    def of(body: _Sampling, parser: ToolCallParser) -> ToolCalls | None:
        """The request's tool mode; None for a text answer. A bad combination is a 400 naming its field."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise BadField("tool_choice needs tools", "tool_choice")
            return None
        names = frozenset(t.function.name for t in body.tools)
        if choice == "none":
            return None
        if choice is None or choice == "auto":
            return ToolCalls(parser=parser, tools=names)
        if body.response_format is not None and body.response_format.type != "text" or body.structured_outputs:
            raise BadField("tool_choice 'required' or a named function cannot be combined with response_format "
                           "or structured_outputs", "tool_choice")
        if choice == "required":
            return ToolCalls(tools=names)
        if choice.function.name not in names:
            raise BadField(f"tool_choice names {choice.function.name!r}, which is not in tools",
                           "tool_choice.function.name")
        return ToolCalls(named=choice.function.name, tools=names)

    def spec(self, body: ChatCompletionRequest) -> GrammarSpec | None:
        """The grammar a constrained mode generates under (None for auto)."""
        if not self.constrained:
            return None
        functions = {t.function.name: t.function for t in body.tools or ()}
        if self.named is not None:
            function = functions[self.named]
            return json_schema_spec(_parameters(function), bool(function.strict))
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(f)}}
                 for name, f in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return json_schema_spec(schema, all(f.strict for f in functions.values()))

    def answer(self, text: str) -> ParsedAnswer:
        """A complete answer's content and calls."""
        if self.named is not None:
            return ParsedAnswer(None, (ParsedCall(self.named, text),))
        if self.parser is None:
            return ParsedAnswer(None, tuple(ParsedCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                                            for c in json.loads(text)))
        return self.parser.parse(text, self.tools)

    def finish_reason(self, answer: ParsedAnswer) -> str:
        """OpenAI's: a named function ends with "stop", other calls with "tool_calls"."""
        return "tool_calls" if answer.calls and self.named is None else "stop"

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer's message and finish reason. An answer cut short (length) is left as text."""
        if finish != "stop":
            return {"role": "assistant", "content": text}, finish
        answer = self.answer(text)
        if not answer.calls:
            return {"role": "assistant", "content": answer.content}, finish
        calls = [_call_body(call) for call in answer.calls]
        return {"role": "assistant", "content": answer.content, "tool_calls": calls}, self.finish_reason(answer)


@dataclass
class ToolDeltas:
    """One streamed choice's deltas under its tool mode: a named function's arguments stream as they
    come; `required` and `auto` answers are sent as calls once they end (auto streams its content)."""

    mode: ToolCalls
    _text: str = ""
    _stream: ToolTextStream | None = field(default=None, init=False)
    _named_id: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.mode.parser is not None:
            self._stream = ToolTextStream(self.mode.parser, self.mode.tools)

    def feed(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas to send for this piece of the answer, and the finish reason (on the last piece)."""
        deltas: list[dict[str, Any]] = []
        if self.mode.named is not None:
            if self._named_id is None:
                self._named_id = _call_id()
                deltas.append({"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                               "function": {"name": self.mode.named, "arguments": ""}}]})
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas, finish
        if self._stream is not None:
            if content := self._stream.feed(text):
                deltas.append({"content": content})
            if finish is None:
                return deltas, None
            answer = self._stream.finish() if finish == "stop" else ParsedAnswer(self._stream.finish_as_text(), ())
        else:
            self._text += text
            if finish is None:
                return deltas, None
            answer = self.mode.answer(self._text) if finish == "stop" else ParsedAnswer(self._text or None, ())
        if answer.content:
            deltas.append({"content": answer.content})
        if answer.calls:
            deltas.append({"tool_calls": [{"index": i, **_call_body(call)} for i, call in enumerate(answer.calls)]})
            finish = self.mode.finish_reason(answer)
        return deltas, finish


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_body(call: ParsedCall) -> dict[str, Any]:
    return {"id": _call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
