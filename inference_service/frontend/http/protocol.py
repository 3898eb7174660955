"""OpenAI (and vLLM-extension) request bodies, validated by pydantic at the edge.

No field is silently dropped: a field these models do not declare is refused with a 400 that names
it (`extra="forbid"`: vLLM's `guided_json`, a typo...). Declared fields either map onto our
sampling (structured output: `response_format`, `structured_outputs`), are refused unless at their
default (`echo`, `suffix`, `best_of` other than `n`), or are OpenAI's fields that
cannot change the output and are accepted and ignored (IGNORED_FIELDS, listed in docs/http.md).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inference_service.engine.request import MAX_LOGIT_BIAS

# OpenAI's optional fields that do not change what is generated: accepted, and ignored.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "prompt_cache_options")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: it only pads OpenAI's own chunks


class JsonSchema(_Strict):
    """OpenAI's response_format.json_schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None  # documentation for the model; not part of the constraint
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)


class _Sampling(_Strict):
    """Fields common to completions and chat completions."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # gRPC's uint64
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1  # samples, 1 to --max-n: n engine requests sharing the prompt's prefill (admission.py)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # token id (as a string, OpenAI's shape) -> bias; the count bounded while parsing
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float = 0.0  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    structured_outputs: StructuredOutputs | None = None  # vLLM extension
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)  # vLLM extension: lower first
    # IGNORED_FIELDS
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None  # the top-k alternatives per token (k <= 20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read more (name, tool_calls, ...)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM extension
    continue_final_message: bool = False  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension
    # Tools (http/tools.py): "required" or a named function constrain the output to calls whose arguments
    # follow the function's schema; "auto" (the default with tools) parses calls out of the model's text.
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None  # for the chat template (the model reads it); not a constraint
    parameters: dict[str, Any] | None = None  # a JSON schema; none: an object with any properties
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body: lora_path is a local directory or an adapter URI (file://, s3://, http(s)://)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    sha256: str | None = None  # extension (gRPC's LoadAdapter field): expected digest of the weights
    shared: bool = False  # extension, admins only: visible to every tenant (gRPC's LoadAdapter field)
    tenant: str = ""  # extension, admins only: load into this tenant's namespace (gRPC's LoadAdapter field)


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

