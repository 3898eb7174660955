"""Driving an EngineCore synchronously in tests: load adapters, run requests to completion."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.request import Request, RequestOutput, SamplingParams


def make_core(max_loras: int = 2, **config: object) -> EngineCore:
    """builtin:tiny on the CPU (unless `device` says otherwise) with a few rank-8 slots and a small KV cache."""
    config.setdefault("device", "cpu")
    config.setdefault("kv_cache_bytes", 4 << 20)
    return EngineCore(EngineConfig(model="builtin:tiny", max_loras=max_loras, max_lora_rank=8,  # type: ignore[arg-type]
                                   **config))


def load_adapters(core: EngineCore, adapters: dict[str, Path], timeout: float = 60.0, **kwargs: object) -> None:
    futures = [core.lora.load_adapter(name, str(path), **kwargs) for name, path in adapters.items()]
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        assert time.monotonic() < deadline, "adapters did not load in time"
        core.lora.drain()
        time.sleep(0.001)
    for f in futures:
        f.result()


def run_to_completion(core: EngineCore, timeout: float = 120.0) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    deadline = time.monotonic() + timeout
    while core.has_work():
        assert time.monotonic() < deadline, "requests did not finish in time"
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def generate(core: EngineCore, prompts: dict[str, tuple[list[int], str | None]], params: SamplingParams
             ) -> dict[str, list[int]]:
    """Run several requests in one engine; returns generated token ids per request id."""
    for rid, (tokens, adapter) in prompts.items():
        core.add_request(Request(rid, tokens, params), adapter)
    outputs = run_to_completion(core)
    return {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}


def greedy_logits(core: EngineCore, adapters: dict[str, Path], prompts: list[tuple[str, list[int], str | None]],
                  new_tokens: int) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """Per request through `core` (which it shuts down): its logits at prefill and each decode step
    (on the CPU) and its tokens, greedy with EOS ignored; no KV block or adapter reference left."""
    load_adapters(core, adapters)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, return_logits=True)
    for rid, tokens, adapter in prompts:
        core.add_request(Request(rid, tokens, params), adapter)
    outputs = run_to_completion(core)
    assert core.runner.kv.num_used == 0 and core.lora.stats().references == 0
    core.shutdown()
    return {rid: (torch.stack([x.cpu() for o in outs for x in (o.logits or [])]),
                  [t for o in outs for t in o.new_token_ids]) for rid, outs in outputs.items()}
