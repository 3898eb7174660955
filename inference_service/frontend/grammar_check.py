"""Each new constraint compiled once in a child process, bounded in time and memory, before its request
is submitted: a schema, regex or grammar that is too large or too slow to compile gets a clear
INVALID_ARGUMENT (HTTP 400) within COMPILE_TIMEOUT_S, and harms no other stream.

xgrammar's compile cannot be interrupted from Python, and a hostile pattern (a nested repetition
such as `((a{1,50}){1,50}){1,20}`) takes seconds and tens of MB; a thread that timed out would go on
burning a core and memory. The child is killed instead (and restarted on the next check). The
result, ok or the error, is cached by the spec's content hash, so a spec is compiled here once; the
engine core compiles it again off its scheduler step (engine/grammar.py), knowing it finishes.

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
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from adapter_cache.errors import InvalidArgumentError
from inference_service.idle_priority import run_only_on_idle_cpu
from inference_service.structured import GrammarSpec, compile_spec, grammar_vocab, tokenizer_info
from inference_service.tokenizer import Tokenizer

log = logging.getLogger(__name__)

COMPILE_CPU_S = 5.0  # CPU seconds the child may spend on one spec (on a busy machine, wall time runs longer)
COMPILE_WALL_S = 30.0  # and wall-clock seconds, whatever the machine's load
COMPILE_MEMORY_BYTES = 512 << 20  # beyond the child's own size once started
START_TIMEOUT_S = 120.0  # importing xgrammar (torch, triton) on a busy machine
MAX_CACHED = 4096
POLL_S = 0.02


class GrammarChecker:
    """The parent's handle: `await check(spec)` raises InvalidArgumentError for a spec that does not
    compile within the bounds. Checks run one at a time on a thread of their own (never on the
    event loop or the HTTP worker threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cpu_s: float = COMPILE_CPU_S,
                 wall_s: float = COMPILE_WALL_S, memory_bytes: int = COMPILE_MEMORY_BYTES) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.cpu_s, self.wall_s, self.memory_bytes = cpu_s, wall_s, memory_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._proc: subprocess.Popen[bytes] | None = None
        self._base_rss = 0
        self._vocab: list[bytes] | None = None

    async def check(self, spec: GrammarSpec) -> None:
        """Raises InvalidArgumentError unless the spec compiles within the bounds."""
        error = self._cache.get(spec.key, False)
        if error is False:
            error = await asyncio.get_running_loop().run_in_executor(self._pool, self.check_blocking, spec)
        if error is not None:
            raise InvalidArgumentError(f"{_what(spec)}: {error}")

    def check_blocking(self, spec: GrammarSpec) -> str | None:
        """None when the spec compiles within the bounds, else why not (cached either way)."""
        with self._lock:
            key = spec.key
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            error = self._compile(spec)
            self._cache[key] = error
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            return error

    def _compile(self, spec: GrammarSpec) -> str | None:
        proc = self._started()
        started, cpu_before = time.monotonic(), _cpu_seconds(proc.pid)
        _write(proc.stdin, spec)  # type: ignore[arg-type]
        deadline = started + self.wall_s
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], POLL_S)
            if ready:
                answer = _read(proc.stdout)  # type: ignore[arg-type]
                if answer is not EOFError:
                    log.info("grammar check: %s compiled in %.3f s: %s", spec.kind, time.monotonic() - started,
                             "ok" if answer is None else answer)
                    return answer  # type: ignore[return-value]
                self._stop()
                return "the compiler failed on it"
            cpu = _cpu_seconds(proc.pid) - cpu_before
            if cpu > self.cpu_s or time.monotonic() > deadline:
                self._stop()
                log.warning("grammar check: %s did not compile in %.1f s (%.1f CPU s); compiler restarted",
                            spec.kind, time.monotonic() - started, cpu)
                limit = f"{self.cpu_s:g} CPU seconds" if cpu > self.cpu_s else f"{self.wall_s:g} s"
                return f"it did not compile within {limit} (too large or too complex)"
            if _rss(proc.pid) - self._base_rss > self.memory_bytes:
                self._stop()
                log.warning("grammar check: %s took over %d MiB to compile; compiler restarted", spec.kind,
                            self.memory_bytes >> 20)
                return f"compiling it takes more than {self.memory_bytes >> 20} MiB (too large or too complex)"

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._vocab is None:
            self._vocab = grammar_vocab(self.tokenizer, self.vocab_size)
        # No preexec_fn: Python code between fork and exec in a process with gRPC's threads can crash
        # the child (seen: the child gone within milliseconds, now and then); the child lowers its own priority.
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # At once, not only in the child: its imports (torch, xgrammar) are a CPU burst of their own, and
        # a restart after a killed compile happens while other streams run.
        run_only_on_idle_cpu(proc.pid)
        self._proc = proc
        _write(proc.stdin, (self._vocab, tuple(self.tokenizer.eos_token_ids)))  # type: ignore[arg-type]
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        answer = _read(proc.stdout) if ready else None  # type: ignore[arg-type]
        if answer != "ready":
            self._stop()
            raise RuntimeError(f"the grammar compiler process did not start ({answer!r}, exit {proc.returncode})")
        self._base_rss = _rss(proc.pid)
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        with self._lock:
            self._stop()
        self._pool.shutdown(wait=False)


_checkers: dict[tuple[int, float], GrammarChecker] = {}
_checkers_lock = threading.Lock()


def shared_checker(tokenizer: Tokenizer, vocab_size: int, cpu_s: float = COMPILE_CPU_S) -> GrammarChecker:
    """One checker (one child process, one cache) per tokenizer and bound, for both front ends of a
    server (--grammar-compile-cpu-s; the wall bound 6x that, at least COMPILE_WALL_S)."""
    with _checkers_lock:
        key = (id(tokenizer), cpu_s)
        checker = _checkers.get(key)
        if checker is None or checker.tokenizer is not tokenizer:
            checker = _checkers[key] = GrammarChecker(tokenizer, vocab_size, cpu_s, max(COMPILE_WALL_S, 6 * cpu_s))
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
