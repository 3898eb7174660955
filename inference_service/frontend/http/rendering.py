"""The engine's outputs → OpenAI's responses: a whole completion or chat completion, or its
server-sent events, with logprobs, usage and tool calls in OpenAI's shapes. Each renderer reads an
`Exchange` (http/exchange.py), whose close the caller runs once, however the response ends."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HttpRequest

from inference_service.engine.request import FinishReason, RequestOutput, TokenLogprobs
from inference_service.frontend.http.errors import error_body, status_of
from inference_service.frontend.http.exchange import Exchange
from inference_service.frontend.http.tools import ToolCalls, ToolDeltas
from inference_service.frontend.intake import ENGINE_ENDED, engine_end_error
from inference_service.tokenizer import Tokenizer

OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.EOS: "stop"}


class OpenAIRendering:
    """Renders the outputs of the completions and chat completions routes in app.py."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer


    async def collect(self, gen: Exchange, http: HttpRequest) -> list[tuple[str, RequestOutput]] | None:
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

    async def sse(self, gen: Exchange, model: str, chat: bool, include_usage: bool,
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

    def completion_body(self, gen: Exchange, model: str, results: list[tuple[str, RequestOutput]]) -> dict[str, Any]:
        choices = [{"index": index, "text": text, "logprobs": self.logprobs_body(last.logprobs, chat=False),
                    "finish_reason": OPENAI_FINISH.get(last.finish_reason),  # type: ignore[arg-type]
                    "stop_reason": last.stop_reason} for index, (text, last) in enumerate(results)]
        return {"id": gen.request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": samples_usage(gen.prompt_tokens, [last for _, last in results])}

    def chat_body(self, gen: Exchange, model: str, results: list[tuple[str, RequestOutput]],
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
        raw = self.tokenizer.token_bytes
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


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
