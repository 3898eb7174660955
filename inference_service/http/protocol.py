"""OpenAI (and vLLM-extension) request bodies, validated by pydantic at the edge.

Only fields that map onto our sampling are accepted with non-default values; the rest of the
OpenAI schema is accepted and ignored (`user`, `metadata`) or refused with a clear message
(`n` > 1, `echo`, `suffix`, `best_of`, `tools`), never silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    n: int = 1
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float = 0.0  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension


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
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body: lora_path is a local directory or an adapter URI (file://, s3://, http(s)://)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    sha256: str | None = None  # extension (gRPC's LoadAdapter field): expected digest of the weights


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]

