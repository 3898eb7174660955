"""Completions and chat completions over the Engine: OpenAI request → prompt ids and
SamplingParams → engine stream → OpenAI response or SSE chunks.

Whatever ends a request (its last token, a client disconnect, an error), `Generation.close`
runs once and aborts it in the engine unless it already finished: the same exactly-once path
as the gRPC handler's `finally`. With `n` > 1 the request is n engine requests (its samples,
engine.client.add_samples), read together (engine.streams.merged) and each aborted by the close
unless it ended.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HttpRequest

from adapter_cache.errors import InvalidArgumentError
from inference_service.engine.client import EngineClient
from inference_service.engine.request import (
    CacheSalt,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TenantTag,
    TokenLogprobs,
)
from inference_service.engine.streams import RequestStream, merged
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.http.errors import BadField, error_body, status_of
from inference_service.frontend.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    _Sampling,
)
from inference_service.frontend.http.tools import ToolCalls, ToolDeltas
from inference_service.frontend.intake import ENGINE_ENDED, Intake, engine_end_error
from inference_service.frontend.tenants import Ticket
from inference_service.frontend.tool_parsers import tool_parser
from inference_service.limits import check_n
from inference_service.structured import GrammarSpec, choice_spec, json_schema_spec

log = logging.getLogger("loraplex.http")

OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.EOS: "stop"}


@dataclass
class Generation:
    """One submitted request, its n samples' engine streams, and the bookkeeping that ends each
    sample exactly once."""

    engine: EngineClient
    request_id: str  # the response's id; sample i runs in the engine as streams[i].request_id
    adapter: str | None
    prompt_tokens: int
    streams: list[RequestStream]
    started: float = field(default_factory=time.monotonic)
    status: int = 200
    closed: bool = False
    ticket: Ticket | None = None  # its hold on its tenant's quotas (frontend/tenants.py), released by close
    finished: list[bool] = field(init=False)
    reasons: list[FinishReason | None] = field(init=False)
    generated: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.streams)
        self.finished, self.reasons, self.generated = [False] * n, [None] * n, [0] * n

    @property
    def n(self) -> int:
        return len(self.streams)

    def observe(self, index: int, out: RequestOutput) -> None:
        if self.ticket is not None:
            self.ticket.running()
        self.generated[index] = out.generated_tokens or self.generated[index] + len(out.new_token_ids)
        if out.finished:
            self.finished[index], self.reasons[index] = True, out.finish_reason

    def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sample index, output) as the samples produce them, each observed."""
        return _observed(self)

    def close(self) -> None:
        """Aborts every sample that has not ended (a client gone, an error in one sample): each once."""
        if self.closed:
            return
        self.closed = True
        for index, stream in enumerate(self.streams):
            if not self.finished[index]:
                self.engine.abort(stream.request_id, reason=FinishReason.CANCELLED)
                self.reasons[index] = FinishReason.CANCELLED
                self.status = 499 if self.status == 200 else self.status
        if self.ticket is not None:
            self.ticket.release(sum(self.generated))
        reasons = sorted({r.value for r in self.reasons if r is not None})
        log.info("request %s adapter=%s finish=%s status=%d tokens=%d seconds=%.3f", self.request_id,
                 self.adapter or "-", ",".join(reasons) or "-", self.status, sum(self.generated),
                 time.monotonic() - self.started)


async def _observed(gen: Generation) -> AsyncIterator[tuple[int, RequestOutput]]:
    async with contextlib.aclosing(merged(gen.streams)) as outputs:
        async for index, out in outputs:
            gen.observe(index, out)
            yield index, out


class OpenAIGeneration:
    """Builds and runs completions / chat completions for the routes in app.py."""

    def __init__(self, engine: EngineClient, base_names: tuple[str, ...], default_max_new_tokens: int,
                 chat_template: ChatTemplate | None, tool_call_parser: str = "auto") -> None:
        self.engine = engine
        self.base_names = base_names
        self.chat_template = chat_template
        self.tool_parser = tool_parser(tool_call_parser, chat_template.source if chat_template else None)
        self.intake = Intake(engine.model_info, engine.tokenizer, default_max_new_tokens)

    # ---- request → engine (prepare, tokenize and detokenize run off the event loop: http/body.py) ----

    def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling params of a generation request."""
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
        request = self.intake.engine_request(prompt_ids, params, None)  # here, not on the loop at submit
        return request.prompt_token_ids, request.params

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
        """`field`: the request's name for `max_tokens`, named by its errors (not the engine's max_new_tokens)."""
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
        params = SamplingParams(
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
        return self.intake.sampling(params)

    def submit(self, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
               prefix: str, n: int = 1, cache_salt: CacheSalt | None = None, tenant: TenantTag | None = None,
               ticket: Ticket | None = None, priority: int = 0) -> Generation:
        """The request's n samples in the engine (n > 1: engine.client.add_samples, which shares the
        prompt's prefill and gives each sample its own seed). `cache_salt`: its prefix-cache namespace
        (frontend/cache_salt.py); `tenant` and its quota `ticket` (frontend/tenants.py), which the
        Generation releases when it closes (here, if the engine refuses the request)."""
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            if n == 1:
                streams = [self.engine.add_request(prompt_ids, params, adapter=adapter, request_id=request_id,
                                                   cache_salt=cache_salt, tenant=tenant, priority=priority)]
            else:
                streams = self.engine.add_samples(prompt_ids, params, n, adapter=adapter, request_id=request_id,
                                                  cache_salt=cache_salt, tenant=tenant, priority=priority)
        except BaseException:
            if ticket is not None:
                ticket.release(0)
            raise
        return Generation(self.engine, request_id, adapter, len(prompt_ids), streams, ticket=ticket)

    # ---- engine → response ----

    async def collect(self, gen: Generation, http: HttpRequest) -> list[tuple[str, RequestOutput]] | None:
        """Each sample's text and final output, by index, or None when the client disconnected first
        (the caller's `gen.close()` then aborts every sample). A sample the engine ended raises its
        error at once (the close aborts the others)."""

        async def run() -> list[tuple[str, RequestOutput]]:
            parts: list[list[str]] = [[] for _ in gen.streams]
            logprobs: list[list[TokenLogprobs]] = [[] for _ in gen.streams]
            lasts: list[RequestOutput | None] = [None] * gen.n
            async with contextlib.aclosing(gen.outputs()) as outputs:
                async for index, out in outputs:
                    parts[index].append(out.text)
                    logprobs[index] += out.logprobs or ()
                    if out.finished:
                        out.logprobs = logprobs[index] if out.logprobs is not None else None
                        lasts[index] = out
                        if out.finish_reason in ENGINE_ENDED:
                            raise engine_end_error(out)
            if any(last is None for last in lasts):
                raise RuntimeError("engine stream ended without a final output")
            return [("".join(p), last) for p, last in zip(parts, lasts, strict=True)]  # type: ignore[misc]

        task = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                return None
            return task.result()
        finally:
            gone.cancel()

    async def sse(self, gen: Generation, model: str, chat: bool, include_usage: bool,
                  tools: ToolCalls | None = None) -> AsyncIterator[bytes]:
        """OpenAI server-sent events: one chunk per engine delta of any sample (its `index`), then
        usage (if asked) and [DONE]. With a tool mode, each sample's text goes through its ToolDeltas
        (content, held-back call text, `tool_calls` deltas)."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, choice: dict[str, Any], usage: dict[str, Any] | None = None,
                  no_choice: bool = False) -> bytes:
            body: dict[str, Any] = {"id": gen.request_id, "object": kind, "created": created, "model": model,
                                    "choices": [] if no_choice else [{"index": index, **choice}]}
            if usage is not None:
                body["usage"] = usage
            return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

        if chat:
            for index in range(gen.n):
                yield chunk(index, {"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None})
        # text_offset counts from the start of each completion, across chunks
        offsets = [TextOffsets() for _ in gen.streams]
        tool_deltas = [ToolDeltas(tools) for _ in gen.streams] if chat and tools is not None else None
        lasts: list[RequestOutput | None] = [None] * gen.n
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for index, out in outputs:
                lasts[index] = out
                if out.finished and out.finish_reason in ENGINE_ENDED:
                    error = engine_end_error(out)
                    gen.status = status_of(error)
                    yield b"data: " + json.dumps(error_body(str(error), gen.status, error.code)).encode() + b"\n\n"
                    break
                finish = OPENAI_FINISH.get(out.finish_reason) if out.finished else None  # type: ignore[arg-type]
                if tool_deltas is not None:
                    deltas, finish = tool_deltas[index].feed(out.text or "", finish)
                    logprobs = self.logprobs_body(out.logprobs, chat, offsets[index])
                    if not deltas and (finish or logprobs):
                        deltas = [{}]  # the finish reason or the logprobs go out even with no text
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        yield chunk(index, {"delta": delta, "logprobs": logprobs if i == 0 else None,
                                            "finish_reason": finish if last else None,
                                            **({"stop_reason": out.stop_reason} if finish and last else {})})
                elif out.text or finish or out.logprobs:
                    content = {"delta": {"content": out.text}} if chat else {"text": out.text}
                    yield chunk(index, {**content, "logprobs": self.logprobs_body(out.logprobs, chat, offsets[index]),
                                        "finish_reason": finish,
                                        **({"stop_reason": out.stop_reason} if finish else {})})
        if include_usage and all(last is not None for last in lasts) and gen.status == 200:
            yield chunk(0, {}, usage=samples_usage(gen.prompt_tokens, lasts), no_choice=True)  # type: ignore[arg-type]
        yield b"data: [DONE]\n\n"

    def completion_body(self, gen: Generation, model: str, results: list[tuple[str, RequestOutput]]) -> dict[str, Any]:
        choices = [{"index": index, "text": text, "logprobs": self.logprobs_body(last.logprobs, chat=False),
                    "finish_reason": OPENAI_FINISH.get(last.finish_reason),  # type: ignore[arg-type]
                    "stop_reason": last.stop_reason} for index, (text, last) in enumerate(results)]
        return {"id": gen.request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": samples_usage(gen.prompt_tokens, [last for _, last in results])}

    def chat_body(self, gen: Generation, model: str, results: list[tuple[str, RequestOutput]],
                  tools: ToolCalls | None = None) -> dict[str, Any]:
        choices = []
        for index, (text, last) in enumerate(results):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = OPENAI_FINISH.get(last.finish_reason)  # type: ignore[arg-type]
            if tools is not None:
                message, finish = tools.message(text, finish)
            choices.append({"index": index, "message": message,
                            "logprobs": self.logprobs_body(last.logprobs, chat=True),
                            "finish_reason": finish, "stop_reason": last.stop_reason})
        return {"id": gen.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": samples_usage(gen.prompt_tokens, [last for _, last in results])}

    def logprobs_body(self, logprobs: list[TokenLogprobs] | None, chat: bool,
                      offsets: TextOffsets | None = None) -> dict[str, Any] | None:
        """OpenAI's logprobs shapes: chat's `content` list, or completions' parallel lists. Each token
        is rendered from its own bytes (token_text), so the parts of one character stay distinct."""
        if logprobs is None:
            return None
        raw = self.engine.tokenizer.token_bytes
        if chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                data = raw(token_id)
                return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}

            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs]}
        offsets = offsets or TextOffsets()
        pieces = [raw(lp.token_id) for lp in logprobs]
        return {"tokens": [token_text(b) for b in pieces], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{token_text(raw(t)): v for t, v in lp.top} for lp in logprobs],
                "text_offset": [offsets.advance(b) for b in pieces]}


def token_text(data: bytes) -> str:
    """A token as text: itself when it is whole UTF-8 characters, else vLLM's (and OpenAI's)
    `bytes:\\xe2\\x80` spelling, so that the parts of different characters do not all read U+FFFD
    (and collide as keys of completions' top_logprobs)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TextOffsets:
    """Completions' text_offset: where each token starts in the completion's text, in characters. A
    token that continues a character split across tokens starts where that character does."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def advance(self, token: bytes) -> int:
        start = self._chars
        self._chars += len(self._decoder.decode(token))
        return start


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


def samples_usage(prompt_tokens: int, lasts: list[RequestOutput]) -> dict[str, Any]:
    """Usage of a request's n samples: the prompt once, the completions summed, and the prompt's cached
    tokens once, as sample 0 (the one that prefilled it) found them; the other samples' hits on sample
    0's blocks are the n-sample sharing itself, not counted again (gRPC reports each sample's)."""
    return usage(prompt_tokens, sum(last.generated_tokens for last in lasts), lasts[0].cached_tokens)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
