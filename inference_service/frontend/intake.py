"""One intake: what both front ends (gRPC: grpc_server.py, HTTP: http/) check of a request before it
reaches the engine, and how either API's request becomes the engine's (`EngineRequest`).

Every check raises a LoraplexError subclass (adapter_cache/errors.py), whose `code` is a gRPC
status name: server.py answers `grpc.StatusCode[code]`, http/errors.py maps it to an HTTP status
in its one table, so a bad input means the same on both front ends. Sizes are checked before the
work that grows with them (tokenizing, decoding); the mapped request is then checked once, whole,
against the model (`engine_request`: stop conditions, sampling knobs, context). The engine checks it
once more where it leaves the caller (engine.client.checked_request, over the same function), for
the embedders that call it directly: once per boundary.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.request import FinishReason, RequestOutput, SamplingParams
from inference_service.engine.types import ModelInfo, validate_request
from inference_service.limits import adapter_name, check_n, check_request_id
from inference_service.structured import MAX_CHOICES, GrammarSpec, choice_spec, json_schema_spec
from inference_service.tokenizer import Tokenizer

if TYPE_CHECKING:
    from inference_service.api import inference_pb2 as pb
    from inference_service.frontend.chat_template import ChatTemplate

SHA256_HEX_CHARS = 64
# Requests the engine ended, not the client or the model: each front end answers with an error.
ENGINE_ENDED = (FinishReason.CANCELLED, FinishReason.DEADLINE, FinishReason.ERROR)
_ENGINE_END_CODES = {FinishReason.DEADLINE: "DEADLINE_EXCEEDED", FinishReason.CANCELLED: "CANCELLED"}


# ---- adapters: names and digests ---------------------------------------------------------------------------

def optional_adapter(name: str | None) -> str | None:
    """A request's adapter: None (or "") for the base model, else a checked name."""
    return adapter_name(name) if name else None


def sha256_digest(value: str | None) -> str | None:
    """The expected digest of an adapter's weights: None when not given, else 64 lowercase hex."""
    digest = (value or "").lower() or None
    if digest is not None and (len(digest) != SHA256_HEX_CHARS or any(c not in "0123456789abcdef" for c in digest)):
        raise InvalidArgumentError(f"sha256 must be {SHA256_HEX_CHARS} hex characters")
    return digest


@dataclass(frozen=True)
class AdapterLoad:
    """A checked LoadAdapter (gRPC) or /v1/load_lora_adapter (HTTP)."""

    name: str
    uri: str  # allowed by the URI policy
    sha256: str | None


def adapter_load(name: str, uri: str, sha256: str | None, policy: UriPolicy) -> AdapterLoad:
    """The name, then the URI against the allow-list (PERMISSION_DENIED), then the digest."""
    name = adapter_name(name)
    return AdapterLoad(name, policy.check(uri), sha256_digest(sha256))


# ---- generation ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineRequest:
    """What `EngineClient.add_request` takes, checked."""

    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None
    request_id: str | None = None  # None: the engine names it
    n: int = 1  # samples (engine.client.add_samples when above 1)


class Intake:
    """The checks that need the model: its limits, its context and vocabulary, its tokenizer.
    Safe from any thread (no state of its own)."""

    def __init__(self, model_info: ModelInfo, tokenizer: Tokenizer, default_max_new_tokens: int | None) -> None:
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.default_max_new_tokens = default_max_new_tokens

    # ---- pieces both APIs use ----

    def request_id(self, given: str | None) -> str:
        """The client's request id, checked, or a fresh one."""
        request_id = given or uuid.uuid4().hex
        check_request_id(request_id, self.model_info.limits.max_request_id_length)
        return request_id

    def bounded_text(self, text: str, what: str = "prompt") -> str:
        """`text`, checked against --max-prompt-chars before anything tokenizes it."""
        limit = self.model_info.limits.max_prompt_chars
        if len(text) > limit:
            raise InvalidArgumentError(f"{what} is longer than {limit} characters (--max-prompt-chars)")
        return text

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's text, bounded and tokenized (empty: INVALID_ARGUMENT)."""
        if not text:
            raise InvalidArgumentError("prompt is empty")
        return list(self.tokenizer.encode(self.bounded_text(text), add_special_tokens=add_special_tokens))

    def chat_ids(self, template: ChatTemplate | None, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 continue_final_message: bool = False, use: str = "a text prompt", **kwargs: Any) -> list[int]:
        """A conversation rendered by the chat template, bounded and tokenized: one rendering for both
        APIs. The template writes the special tokens (BOS) itself, as transformers' apply_chat_template.
        `use`: what a client of a model without a template should send instead."""
        if template is None:
            raise InvalidArgumentError(
                f"model {self.model_info.name!r} has no chat template (none in its checkpoint): start the server "
                f"with --chat-template FILE, or use {use}")
        text = template.render(messages, add_generation_prompt, continue_final_message, **kwargs)
        return list(self.tokenizer.encode(self.bounded_text(text), add_special_tokens=False))

    def given_ids(self, ids: Sequence[int]) -> list[int]:
        """A prompt given as token ids: counted against the context before it is walked or copied."""
        info = self.model_info
        if len(ids) >= info.max_context:
            raise InvalidArgumentError(
                f"prompt of {len(ids)} tokens does not fit the context of {info.max_context} tokens")
        if ids and (min(ids) < 0 or max(ids) >= info.vocab_size):
            raise InvalidArgumentError(f"prompt token ids must be in [0, {info.vocab_size})")
        if not ids:
            raise InvalidArgumentError("prompt is empty")
        return list(ids)

    def decodable_ids(self, ids: Sequence[int]) -> list[int]:
        """Token ids to detokenize: at most a context's worth (counted first), each in the vocabulary."""
        info = self.model_info
        if len(ids) > info.max_context:
            raise InvalidArgumentError(f"at most {info.max_context} token ids (the model's context), got {len(ids)}")
        if ids and (min(ids) < 0 or max(ids) >= info.vocab_size):
            raise InvalidArgumentError(f"token ids must be in [0, {info.vocab_size})")
        return list(ids)

    def max_new_tokens(self, asked: int | None, prompt_len: int) -> int:
        """What the client asked for, or the server's default: without --default-max-new-tokens the
        rest of the context after the prompt (OpenAI's and vLLM's behaviour), within the limit."""
        if asked is not None:
            return asked
        info = self.model_info
        room = max(1, info.max_context - prompt_len)
        default = room if self.default_max_new_tokens is None else self.default_max_new_tokens
        return max(1, min(default, info.max_new_tokens_limit, room))

    def engine_request(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                       request_id: str | None = None, n: int = 1) -> EngineRequest:
        """The whole request checked once against the model: its stop conditions (counts first), every
        sampling knob in its range, the prompt and its new tokens within the context and vocabulary.
        What the engine would refuse, refused here, where the caller's thread does the work.
        `adapter`: a checked name (optional_adapter)."""
        validate_request(self.model_info, prompt_token_ids, params)
        return EngineRequest(prompt_token_ids, params, adapter, request_id, n)

    # ---- the gRPC API ----

    def from_grpc(self, request: pb.GenerateRequest, request_id: str | None = None,
                  chat_template: ChatTemplate | None = None) -> EngineRequest:
        """loraplex.v1 GenerateRequest → EngineRequest (the adapter may still need resolving);
        `request_id`: the one the caller logs under when the request names none; `chat_template`: the
        server's, for a prompt given as messages."""
        request_id = self.request_id(request.request_id or request_id)
        adapter = optional_adapter(request.adapter)
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgumentError("prompt is required (text, token_ids or messages)")
        if which == "text":
            prompt_ids = self.text_ids(request.text)
        elif which == "token_ids":
            prompt_ids = self.given_ids(request.token_ids.ids)
        else:
            prompt_ids = self.grpc_chat_ids(request.messages, chat_template)
        s = request.sampling
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            max_new_tokens=self.max_new_tokens(request.max_new_tokens if request.HasField("max_new_tokens") else None,
                                               len(prompt_ids)),
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            min_p=s.min_p,
            min_tokens=request.min_tokens,
            logit_bias=tuple(sorted(s.logit_bias.items())),
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            skip_special_tokens=request.skip_special_tokens if request.HasField("skip_special_tokens") else True,
            grammar=grpc_grammar(s),
        )
        n = request.n if request.HasField("n") else 1
        check_n(n, self.model_info.limits.max_n)
        return self.engine_request(prompt_ids, params, adapter, request_id, n)

    def grpc_chat_ids(self, chat: pb.ChatMessages, template: ChatTemplate | None) -> list[int]:
        if not chat.messages:
            raise InvalidArgumentError("messages is empty")
        messages = [{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                    for m in chat.messages]
        add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        return self.chat_ids(template, messages, add_generation_prompt, chat.continue_final_message,
                             use="a text prompt")


def grpc_grammar(s: pb.SamplingParams) -> GrammarSpec | None:
    """SamplingParams' `constraint` oneof as a GrammarSpec (bounds checked by SamplingParams.validate)."""
    which = s.WhichOneof("constraint")
    if which is None:
        if s.strict:
            raise InvalidArgumentError("sampling.strict needs sampling.json_schema")
        return None
    if s.strict and which != "json_schema":
        raise InvalidArgumentError("sampling.strict needs sampling.json_schema")
    if which == "json_schema":
        return json_schema_spec(s.json_schema, s.strict)
    if which == "json_object":
        if not s.json_object:
            raise InvalidArgumentError("sampling.json_object, when set, must be true")
        return GrammarSpec("json_object", "")
    if which == "choice":
        if len(s.choice.choices) > MAX_CHOICES:  # counted before copying them
            raise InvalidArgumentError(f"sampling.choice has more than {MAX_CHOICES} entries")
        return choice_spec(list(s.choice.choices))
    return GrammarSpec(which, getattr(s, which))


# ---- the way out: a request the engine ended ------------------------------------------------------------

def engine_end_error(out: RequestOutput) -> LoraplexError:
    """The error both front ends answer a request the engine ended with (ENGINE_ENDED): a deadline
    or a cancel by its reason; otherwise the LoraplexError the engine handed (e.g. the adapter failed
    to load: INVALID_ARGUMENT, UNAVAILABLE); anything else is a bug (INTERNAL), not shown to clients."""
    code = _ENGINE_END_CODES.get(out.finish_reason)  # type: ignore[arg-type]
    if code is None and isinstance(out.error, LoraplexError):
        return out.error
    reason = out.finish_reason.value if out.finish_reason else "error"
    error = LoraplexError(str(out.error) if isinstance(out.error, LoraplexError) else f"request {reason}")
    error.code = code or "INTERNAL"
    return error


__all__ = ["ENGINE_ENDED", "AdapterLoad", "EngineRequest", "Intake", "adapter_load", "adapter_name",
           "engine_end_error", "optional_adapter", "sha256_digest"]
