"""Tool calls in a model's free text (OpenAI's tool_choice `auto`), one parser per chat-template family.

A model trained for tools writes its calls in its template's own syntax; the server turns that text
into OpenAI `tool_calls` (vLLM's `--tool-call-parser`). Two families:
- `hermes` (Qwen, Hermes, SmolLM3 and other ChatML-style templates):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional content.
- `llama3_json` (Llama 3.x): the whole answer is `{"name": ..., "parameters": {...}}` (or `arguments`),
  optionally after `<|python_tag|>`, several joined by `;`.
Text that is not a valid call (not JSON, no such tool, arguments not an object) stays content, as vLLM
returns it: the client sees what the model wrote. `ToolTextStream` applies a parser to a streamed
answer: content is sent as it comes, except text that may be the start of a call, which is held until
the answer ends and is then sent as calls or, if it is no valid call, as content.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

PARSERS = ("auto", "hermes", "llama3_json")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    calls: tuple[ParsedCall, ...]


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str, tools: Collection[str]) -> ParsedAnswer:
        """The answer's content and calls; no calls (the whole text as content) unless all are valid."""
        ...

    def content_end(self, text: str) -> int:
        """How much of a partial answer is surely content: a streamed answer sends that much now."""
        ...


def _call(value: Any, tools: Collection[str], *argument_keys: str) -> ParsedCall | None:
    """A parsed JSON value as a call of one of `tools`, or None if it is not one."""
    if not isinstance(value, dict) or value.get("name") not in tools:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = value[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _as_content(text: str) -> ParsedAnswer:
    return ParsedAnswer(text, ())


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that begins `marker` (it may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Collection[str]) -> ParsedAnswer:
        start = text.find(self.START)
        if start < 0:
            return _as_content(text)
        calls, at, decoder = [], start, json.JSONDecoder()
        while at >= 0:
            body_start = at + len(self.START)
            end = text.find(self.END, body_start)
            body = text[body_start: end if end >= 0 else len(text)].strip()  # unclosed: cut at the end
            try:
                value, used = decoder.raw_decode(body)
            except ValueError:
                return _as_content(text)
            call = _call(value, tools, "arguments", "parameters")
            if call is None or body[used:].strip():
                return _as_content(text)
            calls.append(call)
            if end < 0:
                break
            rest = text[end + len(self.END):]
            at = text.find(self.START, end)
            if at < 0 and rest.strip():
                return _as_content(text)  # prose after the calls: not the template's form of a call
        content = text[:start].strip()
        return ParsedAnswer(content or None, tuple(calls))

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _held_prefix(text, self.START)


class Llama3JsonParser:
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, tools: Collection[str]) -> ParsedAnswer:
        body = text.strip()
        body = body.removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return _as_content(text)
        calls, at, decoder = [], 0, json.JSONDecoder()
        while True:
            try:
                value, at = decoder.raw_decode(body, at)
            except ValueError:
                return _as_content(text)
            call = _call(value, tools, "parameters", "arguments")
            if call is None:
                return _as_content(text)
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                return ParsedAnswer(None, tuple(calls))
            if not rest.startswith(";"):
                return _as_content(text)
            at = len(body) - len(rest) + 1
            while at < len(body) and body[at].isspace():
                at += 1

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if body.startswith(("{", self.PYTHON_TAG)) or self.PYTHON_TAG.startswith(body):
            return 0  # a call may be starting: the whole answer is held until it ends
        return len(text)


def tool_parser(name: str, template_source: str | None) -> ToolCallParser:
    """The parser `--tool-call-parser` names; `auto`: the one the chat template's own text calls for
    (a template that writes `<|python_tag|>` or asks for `"parameters"` is Llama 3's), else hermes."""
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name != "auto":
        raise ValueError(f"unknown tool call parser {name!r} (one of {', '.join(PARSERS)})")
    source = template_source or ""
    if HermesParser.START not in source and (Llama3JsonParser.PYTHON_TAG in source or '"parameters"' in source):
        return Llama3JsonParser()
    return HermesParser()


class ToolTextStream:
    """A streamed answer under a parser: `feed` each text delta and send the content it returns;
    `finish` gives the rest of the content and the calls once the answer has ended."""

    def __init__(self, parser: ToolCallParser, tools: Collection[str]) -> None:
        self._parser, self._tools = parser, tools
        self._text = ""
        self._sent = 0  # characters of the text sent as content

    def feed(self, delta: str) -> str:
        self._text += delta
        end = self._parser.content_end(self._text)
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent: end], end
        return out

    def finish_as_text(self) -> str | None:
        """The text not sent yet, as content (an answer cut short is no call)."""
        return self._text[self._sent:] or None

    def finish(self) -> ParsedAnswer:
        """The content not sent yet (None if none) and the calls."""
        answer = self._parser.parse(self._text, self._tools)
        if not answer.calls:
            return ParsedAnswer(self._text[self._sent:] or None, ())
        # Content sent so far is all that came before the first call (content_end stops there).
        return ParsedAnswer(answer.content if self._sent == 0 else None, answer.calls)
