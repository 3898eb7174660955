"""One request's state and sampling parameters."""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from adapter_cache.errors import InvalidArgumentError, LoraplexError
from inference_service.structured import GrammarSpec

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
MAX_REPETITION_PENALTY = 10.0


# Who may share a request's prefix-cached KV: typed (kind, value) pairs from the trusted side of a
# front end (frontend/cache_salt.py), never from a request field; None: one namespace per weights.
CacheSalt = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class TenantTag:
    """The tenant a request belongs to, named by the front end from its trusted side (its credential,
    mTLS identity or an operator-declared header: frontend/tenants.py), never by a request field."""

    name: str
    weight: float = 1.0
    max_running: int | None = None  # the scheduler runs at most this many of the tenant's requests at once


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


# Why a running request was preempted by recompute (the scheduler's; the preemptions metric's label).
PREEMPTION_CAUSES = ("kv_cache", "priority", "fair_share")


class WaitReason(enum.StrEnum):
    """Why the scheduler last passed over a waiting request (metrics label, aging)."""

    QUEUED = "queued"  # behind a request blocked on KV memory (FCFS)
    AGING = "aging"  # an older request must get a slot first
    BATCH_FULL = "batch_full"
    ADAPTER_LOADING = "adapter_loading"
    SLOTS_FULL = "slots_full"
    KV_CACHE = "kv_cache"
    GRAMMAR = "grammar"  # its constraint is being compiled (off the scheduler step)
    SAMPLES = "samples"  # one of n samples, waiting for the first sample's prompt blocks to be cached
    TENANT_LIMIT = "tenant_limit"  # its tenant runs its max_running requests already (others go on)
    PREEMPTED = "preempted"  # preempted by recompute (PREEMPTION_CAUSES), not considered again yet


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of a request with `n` samples (n == 1: the request's own)."""
    return request_id if n == 1 else f"{request_id}.{index}"


def sample_seed(seed: int | None, index: int) -> int | None:
    """Sample `index`'s seed, derived from the request's: sample 0 keeps it (n == 1 with the same seed
    samples the same tokens), the others get their own streams, reproducible from (seed, index).
    None stays None: the engine then draws an independent seed for each sample."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"loraplex-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Temperatures below this sample greedily: dividing logits by a smaller one overflows float32 (to
# inf, then NaN probabilities), and the distribution is already all but one-hot at 1e-5.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy;
    top_k 0 and top_p 1 mean off."""

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
    # OpenAI/vLLM parity (applied by sampling.process_logits; all off by default).
    repetition_penalty: float = 1.0  # HF: over prompt + output tokens, >1 discourages repeats
    frequency_penalty: float = 0.0  # OpenAI: minus count x this, over output tokens
    presence_penalty: float = 0.0  # OpenAI: minus this once a token occurred in the output
    min_p: float = 0.0  # drop tokens below min_p x the top probability (after temperature)
    min_tokens: int = 0  # no EOS / stop token before this many generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k (k <= 20)
    skip_special_tokens: bool = True  # in the streamed text
    # Structured output: the sampled tokens follow this grammar (a token mask per step); EOS ends
    # the request once the grammar is complete, even with ignore_eos.
    grammar: GrammarSpec | None = None

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
        self._validate_parity()

    def _validate_parity(self) -> None:
        """Bounds of the OpenAI-parity fields (the ones vLLM and OpenAI document)."""
        for name, low, high in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0),
                                ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not (math.isfinite(value) and low <= value <= high):
                raise InvalidArgumentError(f"sampling.{name} must be in [{low}, {high}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidArgumentError(
                f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidArgumentError(f"min_tokens must be in [0, max_new_tokens], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgumentError(f"logit_bias has more than {MAX_LOGIT_BIAS} entries")
        for token, bias in self.logit_bias:
            if token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100):
                raise InvalidArgumentError(f"logit_bias needs ids >= 0, biases in [-100, 100]: {token}: {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgumentError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.grammar is not None:
            self.grammar.validate()
            if self.min_tokens:  # EOS banned where the grammar allows only EOS: no token left
                raise InvalidArgumentError("min_tokens cannot be combined with structured output")

    @functools.cached_property
    def processes_logits(self) -> bool:
        """True when process_logits has work for this request (the common case skips it). Cached:
        the scheduler asks for every row of every step, and the params never change."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @functools.cached_property
    def argmax_only(self) -> bool:
        """Greedy, and nothing reads the logits besides the pick (no processing, logprobs, grammar
        or logits handed back): the LM head may pick the token without writing the logits."""
        return (self.greedy and not self.processes_logits and self.logprobs is None and not self.return_logits
                and self.grammar is None)


@dataclass
class Timings:
    """Wall-clock marks (time.monotonic) of one request's life, for the API and metrics."""

    arrival: float = field(default_factory=time.monotonic)
    adapter_ready: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the k most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one scheduler step produced for one request (a delta), handed to its output queue."""

    request_id: str
    new_token_ids: list[int]
    text: str | None = ""  # None: not decoded by the core; the front end's stream decodes it
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (set on the final output)
    error: LoraplexError | None = None
    timings: Timings | None = None
    logits: list[torch.Tensor] | None = None
    # With params.logprobs: per new token, its logprob and the top-k (token id, logprob) pairs.
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the request

    def absorb(self, later: RequestOutput) -> None:
        """Take the next delta of the same request into this one, in place (a consumer that fell
        behind gets one message; in place, so a stream that is never read costs O(tokens))."""
        self.absorb_tokens(later.new_token_ids, later.text, later.generated_tokens)
        if later.logits is not None:
            self.logits = (self.logits or []) + later.logits
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finished, self.finish_reason, self.error = later.finished, later.finish_reason, later.error
        self.prompt_tokens = later.prompt_tokens or self.prompt_tokens
        self.cached_tokens = later.cached_tokens or self.cached_tokens
        self.timings = later.timings or self.timings
        self.stop_reason = later.stop_reason

    def absorb_tokens(self, token_ids: list[int], text: str | None, generated_tokens: int) -> None:
        """The token part of `absorb`: a later delta's tokens, text and count (0: unknown)."""
        self.new_token_ids += token_ids
        if self.text is not None and text is not None:
            self.text += text
        self.generated_tokens = generated_tokens or self.generated_tokens


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
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or being written by a launched step)
        # Sampled by a launched step, not yet appended to output_token_ids (async scheduling has up to two)
        self.num_pending_tokens = 0
        self.block_table: list[int] = []
        # Prefix cache: the operator's sharing salt (set from the trusted side, never by the client
        # alone), the key chain of this request's full blocks and the root it started from
        # (engine.prefix_cache), and the prompt tokens its first admission found cached (-1: not yet).
        self.cache_salt: CacheSalt | None = None
        self.tenant: TenantTag | None = None  # None: a caller that names no tenant (tests, benches)
        self.priority = 0  # waiting-queue order: lower first, then arrival (Scheduler.add)
        self.charged_tokens = 0  # positions charged to its tenant's fair-share counter (never twice)
        self.cache_root: bytes | None = None
        self.block_hashes: list[bytes] = []
        # How many leading blocks of block_table have been offered to the pool under block_hashes
        # (Scheduler._cache_blocks goes on from there; 0 again when either is replaced).
        self.keyed_blocks = 0
        self.num_cached_tokens = -1
        self.timings = Timings()
        self.arrival_seq = 0  # FCFS order, set by the scheduler
        self.skipped_steps = 0  # aging: steps this request was passed over while waiting
        self.finish_reason: FinishReason | None = None
        self.error: LoraplexError | None = None
        self.wait_reason: WaitReason | None = None  # why it was last passed over (metrics, aging)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.step_logprobs: TokenLogprobs | None = None  # the newest token's, when params.logprobs asks
        # Structured output: the compile (engine/grammar.py), then the matcher, which only the step
        # that samples this request touches (the device worker's, in launch order).
        self.grammar: Future[Any] | None = None
        self.matcher: Any = None
        self.stop_reason: str | int | None = None
        # One of a request's n samples (n > 1): the id the samples share. The scheduler admits the
        # first one and holds the others until its prompt blocks are in the prefix cache.
        self.group: str | None = None

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two (a decode step wants one);
        shorter where the range reaches a pending token."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def num_tokens(self) -> int:
        """Prompt + output, counting sampled tokens not appended yet (what the scheduler plans with)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, adapter={self.adapter_uid!r}, status={self.status.value})"
