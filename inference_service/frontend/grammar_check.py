"""Each new constraint compiled once in a child process, bounded in CPU time, wall time and memory,
before its request is submitted: a schema, regex or grammar that is too large or too slow to compile
gets a clear INVALID_ARGUMENT (HTTP 400), and harms no other stream.

xgrammar's compile cannot be interrupted from Python, and a hostile pattern (a nested repetition
such as `((a{1,50}){1,50}){1,20}`) takes seconds and tens of MB; a thread that timed out would go on
burning a core and memory. The child is killed instead (and restarted for the next check).

No check queues behind another client's slow one while a compile process is free: a small pool of
children (`processes`, 2 by default), each compiling one spec at a time; the answer is cached by the
spec's content hash and the cache is consulted first, and the same spec checked twice at once is
compiled once (the second waits for the first's answer). Every compile ends within `cpu_s` CPU
seconds or `wall_s` seconds, so a new check waits for a process only while all of them are busy:
at most ceil(checks ahead / processes) x `wall_s`, and not at all while fewer than `processes`
checks run.

Only a refusal the spec earned is cached: an xgrammar error, the memory bound, or the CPU bound (CPU
time the compile really used). A compile that reached the wall bound with less CPU than that was
starved (a saturated machine, a stopped child): UNAVAILABLE (HTTP 503, retryable), not cached, so
the same spec is compiled again when it is retried. A child that died (killed from outside, or
crashed) is not a verdict on the spec either.

The engine core compiles an accepted spec again off its scheduler step (engine/grammar.py), knowing
it finishes.

Child side: `python -m inference_service.frontend.grammar_check` reads pickled frames on stdin
(8-byte big-endian length, then the body): first (vocab, stop token ids), then one GrammarSpec per
check, and answers each with a frame holding None (compiled) or the error's text. It exits at EOF.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

from adapter_cache.errors import InvalidArgumentError, LoraplexError, UnavailableError
from inference_service.idle_priority import run_only_on_idle_cpu
from inference_service.structured import GrammarSpec, compile_spec, grammar_vocab, tokenizer_info
from inference_service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

COMPILE_CPU_S = 5.0  # CPU seconds the child may spend on one spec (on a busy machine, wall time runs longer)
COMPILE_WALL_S = 30.0  # and wall-clock seconds, whatever the machine's load
COMPILE_MEMORY_BYTES = 512 << 20  # beyond the child's own size once started
COMPILE_PROCESSES = 2  # compile children: checks run side by side up to this many
START_TIMEOUT_S = 120.0  # importing xgrammar (torch, triton) on a busy machine
MAX_CACHED = 4096
POLL_S = 0.02


@dataclass(frozen=True)
class Verdict:
    """One check's answer: `error` None when the spec compiled; `cacheable` when it is the spec's
    own (not a starved or lost compile process)."""

    error: str | None
    cacheable: bool = True


class GrammarChecker:
    """The parent's handle: `await check(spec)` raises InvalidArgumentError for a spec that does not
    compile within the bounds, UnavailableError when its compile was starved of CPU. Checks run on
    threads of their own (never on the event loop or the HTTP worker threads), one per compile child."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cpu_s: float = COMPILE_CPU_S,
                 wall_s: float = COMPILE_WALL_S, memory_bytes: int = COMPILE_MEMORY_BYTES,
                 processes: int = COMPILE_PROCESSES) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.cpu_s, self.wall_s, self.memory_bytes = cpu_s, wall_s, memory_bytes
        self.processes = max(1, processes)
        self._pool = ThreadPoolExecutor(self.processes, thread_name_prefix="grammar-check")
        # As many children as pool threads, so a thread that runs a check always finds one idle.
        self._children = [_CompileProcess(self) for _ in range(self.processes)]
        self._idle: queue.LifoQueue[_CompileProcess] = queue.LifoQueue()
        for child in self._children:
            self._idle.put(child)
        self._lock = threading.Lock()  # the cache and the checks in flight
        self._cache: collections.OrderedDict[str, Verdict] = collections.OrderedDict()
        self._in_flight: dict[str, Future[Verdict]] = {}
        self._vocab: list[bytes] | None = None
        self._vocab_lock = threading.Lock()

    async def check(self, spec: GrammarSpec) -> None:
        """Raises unless the spec compiles within the bounds."""
        _raise(spec, await asyncio.wrap_future(self._submit(spec)))

    def check_blocking(self, spec: GrammarSpec) -> str | None:
        """None when the spec compiles within the bounds, else why not."""
        return self._submit(spec).result().error

    def _submit(self, spec: GrammarSpec) -> Future[Verdict]:
        """The spec's verdict: cached, the one in flight for the same content, or a new check."""
        key = spec.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                done: Future[Verdict] = Future()
                done.set_result(cached)
                return done
            future = self._in_flight.get(key)
            if future is None:
                future = self._in_flight[key] = self._pool.submit(self._check_now, spec, time.monotonic())
            return future

    def _check_now(self, spec: GrammarSpec, submitted: float) -> Verdict:
        child = self._idle.get_nowait()  # never empty: one child per pool thread
        verdict = Verdict("the grammar compiler is not available", cacheable=False)
        try:
            verdict = child.compile(spec, time.monotonic() - submitted)
        except Exception as e:  # noqa: BLE001 - the child did not start: this check only, not cached
            log.error("grammar check: %s", e)
        finally:
            self._idle.put(child)
            with self._lock:  # cached and out of flight at once: no second compile in between
                if verdict.cacheable:
                    self._cache[spec.key] = verdict
                    while len(self._cache) > MAX_CACHED:
                        self._cache.popitem(last=False)
                self._in_flight.pop(spec.key, None)
        return verdict

    def vocab(self) -> list[bytes]:
        with self._vocab_lock:
            if self._vocab is None:
                self._vocab = grammar_vocab(self.tokenizer, self.vocab_size)
            return self._vocab

    def close(self) -> None:
        """Kills every compile child, busy ones too (their checks then answer UNAVAILABLE)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for child in self._children:
            child.stop()


class _CompileProcess:
    """One compile child, started on first use and again after each kill; used by one thread at a time."""

    def __init__(self, checker: GrammarChecker) -> None:
        self.checker = checker
        self._proc: subprocess.Popen[bytes] | None = None
        self._base_rss = 0

    def compile(self, spec: GrammarSpec, waited_s: float) -> Verdict:
        bounds = self.checker
        proc = self._started()
        started, cpu_before = time.monotonic(), _cpu_seconds(proc.pid)
        _write(proc.stdin, spec)  # type: ignore[arg-type]
        deadline = started + bounds.wall_s
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], POLL_S)
            if ready:
                answer = _read(proc.stdout)  # type: ignore[arg-type]
                if answer is not EOFError:
                    log.info("grammar check: %s compiled in %.3f s (after %.3f s waiting for a compiler): %s",
                             spec.kind, time.monotonic() - started, waited_s, "ok" if answer is None else answer)
                    return Verdict(answer)
                self.stop()
                log.warning("grammar check: the compiler died on a %s; restarted for the next check", spec.kind)
                return Verdict("the compiler failed on it", cacheable=False)
            cpu = _cpu_seconds(proc.pid) - cpu_before
            if cpu > bounds.cpu_s:
                self.stop()
                log.warning("grammar check: %s took over %.1f CPU s (%.1f s); compiler restarted",
                            spec.kind, bounds.cpu_s, time.monotonic() - started)
                return Verdict(f"it did not compile within {bounds.cpu_s:g} CPU seconds (too large or too complex)")
            if time.monotonic() > deadline:
                self.stop()
                log.warning("grammar check: %s did not compile in %.1f s with only %.1f CPU s (starved of CPU); "
                            "compiler restarted, nothing cached", spec.kind, bounds.wall_s, cpu)
                return Verdict(f"the server had no CPU time to check it within {bounds.wall_s:g} s (busy); "
                               "retry later", cacheable=False)
            if _rss(proc.pid) - self._base_rss > bounds.memory_bytes:
                self.stop()
                log.warning("grammar check: %s took over %d MiB to compile; compiler restarted", spec.kind,
                            bounds.memory_bytes >> 20)
                mib = bounds.memory_bytes >> 20
                return Verdict(f"compiling it takes more than {mib} MiB (too large or too complex)")

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.stop()
        vocab = self.checker.vocab()
        # No preexec_fn: Python code between fork and exec in a process with gRPC's threads can crash
        # the child (seen: the child gone within milliseconds, now and then); the child lowers its own priority.
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # At once, not only in the child: its imports (torch, xgrammar) are a CPU burst of their own, and
        # a restart after a killed compile happens while other streams run.
        run_only_on_idle_cpu(proc.pid)
        self._proc = proc
        _write(proc.stdin, (vocab, tuple(self.checker.tokenizer.eos_token_ids)))  # type: ignore[arg-type]
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        answer = _read(proc.stdout) if ready else None  # type: ignore[arg-type]
        if answer != "ready":
            self.stop()
            raise RuntimeError(f"the grammar compiler process did not start ({answer!r}, exit {proc.returncode})")
        self._base_rss = _rss(proc.pid)
        return proc

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _raise(spec: GrammarSpec, verdict: Verdict) -> None:
    if verdict.error is None:
        return
    error: type[LoraplexError] = InvalidArgumentError if verdict.cacheable else UnavailableError
    raise error(f"{_what(spec)}: {verdict.error}")


_checkers: dict[tuple[int, float, float, int], GrammarChecker] = {}
_checkers_lock = threading.Lock()


def default_wall_s(cpu_s: float) -> float:
    """The wall bound that goes with a CPU bound: 6x it, at least COMPILE_WALL_S (a busy machine)."""
    return max(COMPILE_WALL_S, 6 * cpu_s)


def shared_checker(tokenizer: Tokenizer, vocab_size: int, cpu_s: float = COMPILE_CPU_S, wall_s: float = 0.0,
                   processes: int = COMPILE_PROCESSES) -> GrammarChecker:
    """One checker (one pool of compile children, one cache) per tokenizer and bounds, for both front
    ends of a server (--grammar-compile-cpu-s, --grammar-compile-wall-s, 0: default_wall_s;
    --grammar-check-processes)."""
    wall_s = wall_s or default_wall_s(cpu_s)
    with _checkers_lock:
        key = (id(tokenizer), cpu_s, wall_s, processes)
        checker = _checkers.get(key)
        if checker is None or checker.tokenizer is not tokenizer:
            checker = _checkers[key] = GrammarChecker(tokenizer, vocab_size, cpu_s, wall_s, processes=processes)
        return checker


def _what(spec: GrammarSpec) -> str:
    return {"json_schema": "the JSON schema", "json_object": "json_object", "regex": "the regex",
            "choice": "the choices", "grammar": "the grammar"}.get(spec.kind, spec.kind) + " cannot be used"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _write(pipe: IO[bytes], value: Any) -> None:
    data = pickle.dumps(value)
    pipe.write(len(data).to_bytes(8, "big") + data)
    pipe.flush()


def _read(pipe: IO[bytes]) -> Any:
    header = pipe.read(8)
    if len(header) < 8:
        return EOFError
    data = pipe.read(int.from_bytes(header, "big"))
    return pickle.loads(data)


def _child() -> None:
    run_only_on_idle_cpu()  # the engine and front end come first: a hostile compile takes only idle CPU
    import xgrammar as xgr

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    first = _read(stdin)
    if first is EOFError:
        return
    vocab, stop_ids = first
    compiler = xgr.GrammarCompiler(tokenizer_info(vocab, stop_ids), max_threads=1, cache_enabled=False)
    _write(stdout, "ready")
    while (spec := _read(stdin)) is not EOFError:
        try:
            compile_spec(compiler, spec)
            answer = None
        except Exception as e:  # noqa: BLE001 - xgrammar's errors (and RecursionError) are the answer
            answer = (" ".join(str(e).split()) or type(e).__name__)[:500]
        _write(stdout, answer)


if __name__ == "__main__":
    # Ctrl-C reaches the terminal's whole process group: the server shuts down and closes this
    # child's stdin, which ends it; a KeyboardInterrupt here would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _child()
