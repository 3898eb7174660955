"""Tool-call parsers on what the chat templates themselves write: the assistant turn a template renders
for a tool call is the text a model trained on it emits, so it must parse back to the same call.

The templates are the tool parts of Qwen2.5's (Hermes-style) and Llama 3.1's published chat
templates, kept to what decides the format."""

from __future__ import annotations

import json

import pytest

from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ParsedAnswer,
    ParsedCall,
    ToolTextStream,
    tool_parser,
)

QWEN = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA31 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' and tools %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\\n\\n' }}{{- 'Respond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.' }}{{- 'Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.tool_calls %}{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content "
    "+ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
NAMES = {"get_weather", "get_time"}
ARGS = {"city": "Zürich", "unit": "celsius"}


def _assistant_turn(source: str, start: str, end: str, content: str | None = None) -> str:
    """What the template renders for an assistant message calling get_weather(ARGS): the model's text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    messages = [{"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": content, "tool_calls": [call]}]
    text = ChatTemplate(source, {"bos_token": "<s>"}).render(messages, add_generation_prompt=False, tools=TOOLS)
    turn = text[text.rindex(start) + len(start):]
    return turn[: turn.index(end)]


def test_auto_picks_the_parser_the_template_writes():
    assert isinstance(tool_parser("auto", QWEN), HermesParser)
    assert isinstance(tool_parser("auto", LLAMA31), Llama3JsonParser)
    assert isinstance(tool_parser("auto", None), HermesParser)
    assert isinstance(tool_parser("llama3_json", QWEN), Llama3JsonParser)
    with pytest.raises(ValueError):
        tool_parser("mistral", QWEN)


@pytest.mark.parametrize("content", [None, "Let me look that up."])
def test_hermes_parses_what_the_qwen_template_writes(content):
    text = _assistant_turn(QWEN, "<|im_start|>assistant", "<|im_end|>", content).removeprefix("\n")
    answer = HermesParser().parse(text, NAMES)
    assert answer == ParsedAnswer(content, (ParsedCall("get_weather", json.dumps(ARGS, ensure_ascii=False)),))


def test_llama3_parses_what_the_llama_template_writes():
    text = _assistant_turn(LLAMA31, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    expected = (ParsedCall("get_weather", json.dumps(ARGS, ensure_ascii=False)),)
    parser = Llama3JsonParser()
    assert parser.parse(text, NAMES) == ParsedAnswer(None, expected)
    assert parser.parse("<|python_tag|>" + text, NAMES) == ParsedAnswer(None, expected)
    both = parser.parse(text + "; " + text.replace("get_weather", "get_time"), NAMES)
    assert [c.name for c in both.calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par"),  # cut short
    (HermesParser(), "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>"),  # no such tool
    (HermesParser(), "<tool_call>{\"name\": \"get_weather\", \"arguments\": [1]}</tool_call>"),  # not an object
    (HermesParser(), "<tool_call>{\"name\": \"get_weather\"}</tool_call> and then some prose"),
    (Llama3JsonParser(), "{\"name\": \"get_weather\", \"parameters\": {}} trailing"),
    (Llama3JsonParser(), "{\"answer\": 42}"),
    (Llama3JsonParser(), "It is sunny."),
])
def test_text_that_is_no_valid_call_stays_content(parser, text):
    assert parser.parse(text, NAMES) == ParsedAnswer(text, ())


@pytest.mark.parametrize("parser, text, content", [
    (HermesParser(), "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
     "</tool_call>", "Checking.\n"),
    (HermesParser(), "No call here, only <tool_ text.", "No call here, only <tool_ text."),
    (Llama3JsonParser(), "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", ""),
    (Llama3JsonParser(), "Sunny, {\"no\": \"call\"}", "Sunny, {\"no\": \"call\"}"),
])
def test_streamed_text_never_sends_part_of_a_call_as_content(parser, text, content):
    """Character by character: what is sent as content before the end is never part of a call, and
    content plus the calls at the end are the whole answer's parse."""
    stream, sent = ToolTextStream(parser, NAMES), ""
    for ch in text:
        sent += stream.feed(ch)
        assert "<tool_call>" not in sent and "{\"name\"" not in sent.replace("{\"no\"", "")
    end = stream.finish()
    whole = parser.parse(text, NAMES)
    assert sent + (end.content or "") == (content if whole.calls else text)
    assert end.calls == whole.calls
