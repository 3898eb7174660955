"""One request's state and sampling parameters."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import torch

from adapter_cache.errors import InvalidArgumentError, LoraplexError


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


class WaitReason(enum.StrEnum):
    """Why the scheduler last passed over a waiting request (metrics label, aging)."""

    QUEUED = "queued"  # behind a request blocked on KV memory (FCFS)
    AGING = "aging"  # an older request must get a slot first
    BATCH_FULL = "batch_full"
    ADAPTER_LOADING = "adapter_loading"
    SLOTS_FULL = "slots_full"
    KV_CACHE = "kv_cache"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Internal (tests, tooling): hand back each sampled position's logits.
    return_logits: bool = False

    def validate(self, max_new_tokens_limit: int) -> None:
        """Reject values that would make sampling undefined, with a message naming the field."""
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise InvalidArgumentError(f"sampling.{name} must be finite, got {value}")
        if self.temperature < 0:
            raise InvalidArgumentError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise InvalidArgumentError(
                f"max_new_tokens must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}"
            )
        if any(not s for s in self.stop):
            raise InvalidArgumentError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgumentError("stop_token_ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Timings:
    """Wall-clock marks (time.monotonic) of one request's life, for the API and metrics."""

    arrival: float = field(default_factory=time.monotonic)
    adapter_ready: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class RequestOutput:
    """What one scheduler step produced for one request (a delta), handed to its output queue."""

    request_id: str
    new_token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    error: LoraplexError | None = None
    timings: Timings | None = None
    logits: list[torch.Tensor] | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """One delta covering this one and the next (a consumer that fell behind sends fewer messages)."""
        logits = None if self.logits is None and later.logits is None else (self.logits or []) + (later.logits or [])
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text=self.text + later.text,
            finished=later.finished,
            finish_reason=later.finish_reason,
            prompt_tokens=later.prompt_tokens,
            generated_tokens=later.generated_tokens,
            error=later.error,
            timings=later.timings,
            logits=logits,
        )


class Request:
    """A sequence being served: prompt + generated tokens, KV progress, adapter, sampling state."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_uid: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.adapter_uid = adapter_uid
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.timings = Timings()
        self.arrival_seq = 0  # FCFS order, set by the scheduler
        self.skipped_steps = 0  # aging: steps this request was passed over while waiting
        self.finish_reason: FinishReason | None = None
        self.error: LoraplexError | None = None
        self.wait_reason: WaitReason | None = None  # why it was last passed over (metrics, aging)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two (a decode step wants one)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, adapter={self.adapter_uid!r}, status={self.status.value})"
