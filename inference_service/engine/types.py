"""What crosses the engine's boundary: the model's limits (`ModelInfo`), a stats snapshot, where
adapters are (`Residency`), the request checks any process holding a `ModelInfo` can run, and the
test-only faults. The front ends import these and `engine.client`, never the core's modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from adapter_cache.errors import InvalidArgumentError
from inference_service.engine.request import SamplingParams
from inference_service.limits import RequestLimits, check_stop
from inference_service.lora.manager import AdapterInfo

__all__ = ["TEST_FAULT_ENV", "TEST_STEP_DELAY_ENV", "AdapterInfo", "EngineStats", "ModelInfo", "Residency",
           "TestFault", "test_faults_enabled", "validate_request"]

# The test flag: test-only faults (`EngineCore.inject_fault`) are refused unless one of these is set
# in the process's environment (tests/test_kubelet_pod.py, test_server_drain.py...). With the first
# set to "die" or "hang[:SECONDS]", SIGUSR1 kills the scheduler thread or wedges it in a "step" that
# lasts that long (default: forever); the second makes every scheduler step this many seconds slower
# (a big model's pace on a toy model). inference_service/frontend/health.py arms them.
TEST_FAULT_ENV = "LORAPLEX_TEST_FAULT_SCHEDULER"
TEST_STEP_DELAY_ENV = "LORAPLEX_TEST_FAULT_STEP_DELAY_S"


def test_faults_enabled() -> bool:
    """Whether this process may arm test-only faults (see TEST_FAULT_ENV)."""
    return bool(os.environ.get(TEST_FAULT_ENV) or os.environ.get(TEST_STEP_DELAY_ENV))


@dataclass(frozen=True)
class TestFault:
    """A test-only fault for the scheduler thread: `die` ends it, `hang` wedges it for `seconds`
    (None: forever), `slow_steps` makes every later step `seconds` slower."""

    __test__ = False  # not a pytest test class

    kind: Literal["die", "hang", "slow_steps"]
    seconds: float | None = None


@dataclass(frozen=True)
class Residency:
    """Adapter names per tier, each tuple sorted by name (inference_service/frontend/residency.py exports them)."""

    device: tuple[str, ...] = ()  # LOADED: in a device slot, copy done
    host: tuple[str, ...] = ()  # HOST_READY: staged tensors in this process's host memory
    cache: tuple[str, ...] = ()  # was loaded before, evicted; bytes still in the adapter cache


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    vocab_size: int
    max_loras: int  # adapters of the largest rank the pool holds at once (fixed: --max-loras N)
    max_lora_rank: int
    max_new_tokens_limit: int
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_registered_adapters: int = 0
    kv_cache_blocks: int = 0
    kv_block_size: int = 16
    lora_pool_bytes: int = 0  # the adapter pool's pages' device bytes (taken before the KV cache was sized)
    lora_page_rank: int = 0  # rank rows per page (an adapter takes ceil(rank / this) pages)
    # The platform plan as (what, chosen) rows (inference_service/platform/plan.py)
    platform: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class EngineStats:
    slots_total: int = 0
    slots_occupied: int = 0
    slots_referenced: int = 0
    slots_pinned: int = 0
    pending_load_events: int = 0
    requests_running: int = 0
    requests_waiting: dict[str, int] = field(default_factory=dict)
    kv_cache_usage: float = 0.0
    kv_blocks_used: int = 0  # held by requests (the leak gauges count these only)
    kv_blocks_cached: int = 0  # prefix cache: keyed blocks no request holds (reusable until evicted)
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # tokens admissions looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    adapter_references: int = 0
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    loads_total: int = 0
    evictions_total: int = 0
    lora_pool_bytes_total: int = 0
    lora_pool_bytes_used: int = 0
    lora_resident_by_rank: tuple[tuple[int, int], ...] = ()
    lora_evictions_by_cause: tuple[tuple[str, int], ...] = ()
    # (tenant, bytes its resident adapters hold): at most one row per resident adapter, never per registered
    lora_pool_bytes_by_owner: tuple[tuple[str, int], ...] = ()
    preemptions_by_cause: tuple[tuple[str, int], ...] = ()  # (cause, count): request.PREEMPTION_CAUSES
    updated_at: float = 0.0  # wall-clock time of this snapshot: vllm:lora_requests_info's value


def validate_request(info: ModelInfo, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """The checks a request passes before it reaches the scheduler (no scheduler state: any thread,
    any process that has the model's `ModelInfo`)."""
    if not prompt_token_ids:
        raise InvalidArgumentError("the prompt is empty")
    if len(prompt_token_ids) >= info.max_context:
        raise InvalidArgumentError(
            f"prompt of {len(prompt_token_ids)} tokens does not fit the context of {info.max_context} tokens")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= info.vocab_size:
        raise InvalidArgumentError(f"prompt token ids must be in [0, {info.vocab_size})")
    check_stop(params.stop, len(params.stop_token_ids), info.limits)
    if any(t >= info.vocab_size for t, _ in params.logit_bias):
        raise InvalidArgumentError(f"logit_bias token ids must be in [0, {info.vocab_size})")
    params.validate(info.max_new_tokens_limit)
    if any(t >= info.vocab_size for t in params.stop_token_ids):
        raise InvalidArgumentError(f"stop_token_ids must be in [0, {info.vocab_size})")
    total = len(prompt_token_ids) + params.max_new_tokens
    # Never fits, whatever else runs: INVALID_ARGUMENT (HTTP 400), never a retryable RESOURCE_EXHAUSTED.
    # The context advertised is within the KV cache (engine.core), so this names the real limit.
    if total > info.max_context:
        raise InvalidArgumentError(
            f"prompt of {len(prompt_token_ids)} tokens + {params.max_new_tokens} new tokens "
            f"does not fit the context of {info.max_context} tokens (at most "
            f"{info.max_context - len(prompt_token_ids)} new tokens after this prompt)"
        )
    if -(-total // info.kv_block_size) > info.kv_cache_blocks:
        raise InvalidArgumentError(f"{total} tokens do not fit the KV cache of "
                                   f"{info.kv_cache_blocks * info.kv_block_size} tokens")
