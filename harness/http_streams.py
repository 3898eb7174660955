"""Streaming completions against any OpenAI-compatible server (ours, llama-server), timed on receipt.

The same client, prompts and settings for every server a bench compares: `/v1/completions` with
`stream: true`, greedy, EOS ignored, so each request yields exactly `max_tokens` tokens wherever it
runs. Each stream's send time, first and last token arrival and token count are kept; the rates
below are computed from them alike for every server.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx  # the HTTP client the openai SDK is built on


@dataclass(frozen=True)
class Stream:
    sent: float
    first: float  # the first token's arrival
    last: float
    tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        """This stream's rate after its first token (prefill excluded)."""
        return (self.tokens - 1) / (self.last - self.first)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style event stream (`data: {...}` lines; `data: [DONE]` and blank
    lines skipped)."""
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[len("data: "):])


def served_model(url: str) -> str:
    """The first model the server lists at /v1/models."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Stream:
    """One stream; a connection the server closes before answering is opened again, said on stderr (seen
    once in a bench run, on a fresh connection after a warm-up burst)."""
    for attempt in range(3):
        try:
            return await _stream_once(client, url, model, prompt, max_tokens)
        except httpx.RemoteProtocolError as e:
            if attempt == 2 or "without sending a response" not in str(e):
                raise RuntimeError(f"{url}: {e}") from e
            print(f"{url}: {e}; sent again", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


async def _stream_once(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Stream:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = 0.0
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for event in sse_events(r):
            if event.get("usage"):
                usage_tokens = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices") or ()):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    tokens = usage_tokens if usage_tokens is not None else chunks
    if tokens != max_tokens:
        raise RuntimeError(f"{url}: {tokens} tokens streamed, {max_tokens} asked for")
    return Stream(sent, first, last, tokens)


def run_streams(url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int) -> list[Stream]:
    """Every prompt streamed, `concurrency` at a time (all sent at once when it is len(prompts))."""

    async def all_streams() -> list[Stream]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            gate = asyncio.Semaphore(concurrency)

            async def one(prompt: str) -> Stream:
                async with gate:
                    return await _stream(client, url, model, prompt, max_tokens)

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(all_streams())


def single_stream_rate(streams: Sequence[Stream]) -> float:
    """The median decode rate of streams run one at a time (tokens/s)."""
    return statistics.median(s.decode_tokens_per_s for s in streams)


def aggregate_rate(streams: Sequence[Stream]) -> float:
    """Tokens/s over the whole burst, from the first send to the last token (prefill included)."""
    return sum(s.tokens for s in streams) / (max(s.last for s in streams) - min(s.sent for s in streams))
