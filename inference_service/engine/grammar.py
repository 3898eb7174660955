"""Structured output in the engine core: grammars compiled off the scheduler step, cached by content,
and each constrained row's logits masked before it is sampled.

The scheduler admits a constrained request once its compile is done (WaitReason.GRAMMAR meanwhile;
the line moves on without it). xgrammar's compile releases the GIL, so a slow one costs other streams
no step. The front ends have compiled each new spec once already, in a child process bounded in time
and memory (frontend/grammar_check.py), so what reaches this compiler is known to finish.
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from inference_service.device import background_worker_thread
from inference_service.engine.sampling import SAMPLING_FAILED
from inference_service.structured import GrammarSpec, compile_spec, grammar_vocab, tokenizer_info
from inference_service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_CACHED = 256  # compiled grammars kept (by content hash)
# and their bytes: with a real vocabulary (49k tokens) one schema just under the checker's CPU bound
# compiles to 33-140 MB, so a count alone bounds nothing.
MAX_CACHED_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles specs on a thread of its own, one at a time, single-flight and cached by content.

    The cache holds at most `max_cached` grammars and `max_cached_bytes` of them, each measured
    once compiled (xgrammar's `memory_size_bytes`), least recently used out first; a grammar larger
    than the whole bound is not kept. A request still running holds its own grammar besides: what
    leaves the cache is freed when its last request ends."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = MAX_CACHED,
                 max_cached_bytes: int = MAX_CACHED_BYTES) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.max_cached, self.max_cached_bytes = max_cached, max_cached_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # built by warm_up (xgrammar's import takes seconds)
        self._cache: collections.OrderedDict[str, Future[Any]] = collections.OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes of each cached grammar compiled so far
        self._lock = threading.Lock()  # the cache: the scheduler thread and the compile thread's callback

    def compile(self, spec: GrammarSpec) -> Future[Any]:
        """The compiled grammar's future (scheduler thread)."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                # One torch thread and a lower CPU priority, as the adapter loaders: the model's threads first.
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile",
                                                initializer=background_worker_thread)
            future: Future[Any] = Future()
            self._cache[key] = future
            self._evict()
            work = self._pool.submit(self._compile_into, key, spec, future)
        work.add_done_callback(lambda w: future.cancel() if w.cancelled() else None)  # shut down before it ran
        return future

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def cached_keys(self) -> list[str]:
        with self._lock:
            return list(self._cache)

    def _compile_into(self, key: str, spec: GrammarSpec, future: Future[Any]) -> None:
        """On the compile thread. The grammar is measured and the cache kept within its bounds before
        `future` resolves, so whoever waits on it sees the cache as it stays (measured in a done
        callback instead, a waiter woken first saw a grammar over the bound still cached). A failed
        compile holds no bytes."""
        if not future.set_running_or_notify_cancel():
            return
        try:
            compiled = self._compile(spec)
        except BaseException as error:  # noqa: BLE001 - the request's own error (a schema xgrammar refuses)
            future.set_exception(error)
            return
        try:
            self._measured(key, future, int(compiled.memory_size_bytes))
        finally:  # the request gets its grammar even if measuring it failed
            future.set_result(compiled)

    def _measured(self, key: str, future: Future[Any], size: int) -> None:
        """A compile ended: its grammar's size counts against the bound."""
        with self._lock:
            if self._cache.get(key) is not future:
                return
            if size > self.max_cached_bytes:  # alone over the bound: not kept, and nothing else goes for it
                del self._cache[key]
                return
            self._sizes[key] = size
            self._evict()

    def _evict(self) -> None:
        """Least recently used out until both bounds hold (requests that hold a future keep it)."""
        while self._cache and (len(self._cache) > self.max_cached
                               or sum(self._sizes.values()) > self.max_cached_bytes):
            key, _ = self._cache.popitem(last=False)
            self._sizes.pop(key, None)

    def warm_up(self) -> None:
        """Import xgrammar and index the vocabulary now (the engine's start): both hold the GIL for
        seconds (xgrammar's import ~1.7 s, the vocabulary a Python loop over every token), which,
        done at the first constrained request, stalled every stream of the engine meanwhile (a
        victim's run 2.7x its slowest alone: tests/test_structured_http.py)."""
        if self._compiler is None:
            import xgrammar as xgr

            info = tokenizer_info(grammar_vocab(self.tokenizer, self.vocab_size), self.tokenizer.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    @property
    def warm(self) -> bool:
        return self._compiler is not None

    def _compile(self, spec: GrammarSpec) -> Any:
        self.warm_up()  # done at start already; a no-op then
        return compile_spec(self._compiler, spec)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


_BITS = torch.arange(32, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """`logits` [S, V] with each row whose matcher is not None masked to the tokens its grammar
    allows next (a copy; the other rows as they were). A terminated matcher (its request ended with
    the step before; this row's token is dropped) leaves its row alone."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        matchers[i].fill_next_token_bitmask(bitmask, j)
    # Unpacked with one vectorized op, masked row by row in place (xgrammar's CPU kernel took 2.7 ms
    # for 16 rows of 32,000 here; this ~0.8 ms).
    refused = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, :vocab].logical_not().to(logits.device)
    masked = logits.clone()
    for j, i in enumerate(rows):
        masked[i].masked_fill_(refused[j], float("-inf"))
    return masked


def accept(matchers: list[Any], tokens: list[int]) -> None:
    """Each constrained row's sampled token into its matcher (the last thing a step does to a row,
    so a step run again after a failure never accepts twice); a token the grammar refuses (a bug:
    the mask allowed it) ends that request alone."""
    for i, matcher in enumerate(matchers):
        if matcher is None or tokens[i] < 0 or matcher.is_terminated():
            continue
        try:
            accepted = matcher.accept_token(tokens[i])
        except Exception:  # noqa: BLE001 - a bug in the matcher: this request only
            log.exception("grammar matcher failed on token %d", tokens[i])
            accepted = False
        if not accepted:
            log.error("token %d was sampled under a grammar that refuses it", tokens[i])
            tokens[i] = SAMPLING_FAILED
