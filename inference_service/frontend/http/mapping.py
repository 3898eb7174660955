"""OpenAI completions and chat completions → the engine's request: the prompt's token ids and
SamplingParams, checked once (intake.py). Runs off the event loop (http/body.py Offload)."""

from __future__ import annotations

from typing import Any

from adapter_cache.errors import InvalidArgumentError
from inference_service.engine.client import EngineClient
from inference_service.engine.request import SamplingParams
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.http.errors import BadField
from inference_service.frontend.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    _Sampling,
)
from inference_service.frontend.http.tools import ToolCalls
from inference_service.frontend.intake import EngineRequest, Intake
from inference_service.frontend.tool_parsers import tool_parser
from inference_service.limits import check_n
from inference_service.structured import GrammarSpec, choice_spec, json_schema_spec


class OpenAIMapping:
    """Builds the engine request of a completion or chat completion, and tokenizes for the routes in app.py."""

    def __init__(self, engine: EngineClient, base_names: tuple[str, ...], default_max_new_tokens: int | None,
                 chat_template: ChatTemplate | None, tool_call_parser: str = "auto") -> None:
        self.engine = engine
        self.base_names = base_names
        self.chat_template = chat_template
        self.tool_parser = tool_parser(tool_call_parser, chat_template.source if chat_template else None)
        self.intake = Intake(engine.model_info, engine.tokenizer, default_max_new_tokens)


    def prepare(self, body: CompletionRequest | ChatCompletionRequest, request_id: str) -> EngineRequest:
        """The engine request of a generation request (its adapter: `Admission.adapter`'s to set)."""
        field = "max_tokens"
        if isinstance(body, ChatCompletionRequest):
            prompt_ids = self.chat_prompt(body)
            if body.max_completion_tokens is not None:
                field = "max_completion_tokens"
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        else:
            prompt_ids = self.completion_prompt(body)
            max_tokens = body.max_tokens
        params = self.sampling(body, max_tokens, len(prompt_ids), field)
        return self.intake.engine_request(prompt_ids, params, None, request_id, body.n)  # the one check

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.messages is not None:
            return self.chat_prompt_ids(body.messages, body.add_generation_prompt)
        assert body.prompt is not None
        special = body.add_special_tokens
        return list(self.engine.tokenizer.encode(self._bounded(body.prompt), add_special_tokens=special))

    def detokenize(self, tokens: list[int]) -> str:
        return self.engine.tokenizer.decode(self.intake.decodable_ids(tokens))

    def tool_mode(self, body: _Sampling) -> ToolCalls | None:
        """How the answer becomes tool calls (http/tools.py); None: a text answer."""
        return ToolCalls.of(body, self.tool_parser)

    def adapter_of(self, model: str) -> str | None:
        """None for the base model; otherwise the adapter name (the engine answers NOT_FOUND)."""
        return None if model in self.base_names else model

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidArgumentError("one prompt per request (send a batch as separate requests)")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.intake.text_ids(prompt)
        if not prompt:
            raise InvalidArgumentError("prompt is empty")
        return prompt  # type: ignore[return-value]  # pydantic's own fresh list

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools:  # the template tells the model about them (as transformers' apply_chat_template)
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        return self.chat_prompt_ids(body.messages, body.add_generation_prompt, body.continue_final_message, kwargs)

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool,
                        continue_final_message: bool = False, kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.intake.chat_ids(self.chat_template, [_message_dict(m) for m in messages], add_generation_prompt,
                                    continue_final_message, use="/v1/completions", **(kwargs or {}))

    def _bounded(self, text: str) -> str:
        """Checked before tokenizing: that work grows with what the client sent (as gRPC's prompt check)."""
        return self.intake.bounded_text(text)

    def sampling(self, body: _Sampling, max_tokens: int | None, prompt_len: int,
                 field: str = "max_tokens") -> SamplingParams:
        """The request's sampling params (the fields only the OpenAI API has checked here; the rest with
        the whole request, `prepare`). `field`: the request's name for `max_tokens`, named by its errors
        (not the engine's max_new_tokens)."""
        try:
            check_n(body.n, self.engine.model_info.limits.max_n)
        except InvalidArgumentError as e:
            raise BadField(str(e), "n") from None
        best_of = getattr(body, "best_of", None)
        if best_of is not None and best_of != body.n:  # n samples are all returned: none is ranked away
            raise BadField(f"best_of must equal n ({body.n}) when given, got {best_of}: this server returns every "
                           "sample it generates and does not rank them", "best_of")
        refuse = [name for name, bad in (("echo", getattr(body, "echo", False)),
                                         ("suffix", getattr(body, "suffix", None) is not None)) if bad]
        if refuse:
            raise BadField(f"not supported: {', '.join(refuse)}", refuse[0])
        limit = self.engine.model_info.max_new_tokens_limit
        if max_tokens is not None and not 1 <= max_tokens <= limit:
            raise BadField(f"{field} must be in [1, {limit}], got {max_tokens}", field)
        max_tokens = self.intake.max_new_tokens(max_tokens, prompt_len)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,
            seed=body.seed,
            max_new_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            min_p=body.min_p,
            min_tokens=body.min_tokens,
            logit_bias=_logit_bias(body.logit_bias),
            logprobs=_logprobs(body),
            skip_special_tokens=body.skip_special_tokens,
            grammar=grammar_spec(body, self.tool_mode(body)),
        )


def grammar_spec(body: _Sampling, tools: ToolCalls | None = None) -> GrammarSpec | None:
    """The request's constraint: chat's `response_format`, vLLM's `structured_outputs` (one of them,
    one constraint in it), or the tool calls' grammar (`tool_choice` required or named); None for free
    text. A bad one is INVALID_ARGUMENT naming its field."""
    if tools is not None and tools.constrained:
        return _checked(tools.spec(body), "tools")  # type: ignore[arg-type]
    response_format = getattr(body, "response_format", None)
    structured = body.structured_outputs
    if response_format is not None and response_format.type != "text":
        if structured is not None:
            raise BadField("send either response_format or structured_outputs, not both", "structured_outputs")
        if response_format.type == "json_object":
            if response_format.json_schema is not None:
                raise BadField("response_format.json_schema needs type json_schema", "response_format.json_schema")
            return GrammarSpec("json_object", "")
        json_schema = response_format.json_schema
        if json_schema is None or json_schema.schema_ is None:
            raise BadField("response_format of type json_schema needs json_schema.schema",
                           "response_format.json_schema")
        return _checked(json_schema_spec(json_schema.schema_, bool(json_schema.strict)), "response_format.json_schema")
    if response_format is not None and response_format.json_schema is not None:
        raise BadField("response_format.json_schema needs type json_schema", "response_format.json_schema")
    if structured is None:
        return None
    given = [(name, value) for name, value in (("json", structured.json_), ("regex", structured.regex),
                                               ("choice", structured.choice), ("grammar", structured.grammar))
             if value is not None]
    if len(given) != 1:
        raise BadField("structured_outputs needs exactly one of json, regex, choice, grammar", "structured_outputs")
    name, value = given[0]
    field = f"structured_outputs.{name}"
    if name == "json":
        return _checked(json_schema_spec(value), field)
    if name == "choice":
        return _checked(choice_spec(value), field)  # type: ignore[arg-type]
    return _checked(GrammarSpec(name, value), field)  # type: ignore[arg-type]


def _checked(spec: GrammarSpec, field: str) -> GrammarSpec:
    try:
        spec.validate()
    except InvalidArgumentError as e:
        raise BadField(f"{field}: {e}", field) from None
    return spec


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    try:
        return tuple(sorted((int(token), float(value)) for token, value in (bias or {}).items()))
    except ValueError:
        raise InvalidArgumentError("logit_bias keys must be token ids") from None


def _logprobs(body: _Sampling) -> int | None:
    """Completions: `logprobs` is the top-k count; chat: `logprobs` switches on, `top_logprobs` is k."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidArgumentError("top_logprobs needs logprobs set to true")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as templates expect it: text parts joined into one string content."""
    data = message.model_dump(exclude_none=True)
    content = data.get("content")
    if isinstance(content, list):
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise InvalidArgumentError("only text content parts are supported")
        data["content"] = "\n".join(part["text"] for part in content)
    elif content is None:
        data["content"] = ""
    return data
