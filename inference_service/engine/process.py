"""The engine core in a process of its own: what `loraplex-inference` serves with.

Why a process: the front ends (gRPC, HTTP) do Python work per message (protobuf, JSON,
detokenization, the transport's own bookkeeping). On the engine's interpreter that work and the
scheduler thread take turns on one GIL, and every step stretches by it; at hundreds of streams the
front end, not the accelerator, set the pace (vLLM's EngineCore process and SGLang's scheduler
process are the same answer). docs/performance.md has the measurements.

This module is the process's lifecycle: starting the core process, its main and command reader,
stopping, reaping and reporting how it ended. What crosses the pipe is engine/pipe.py. The core
process runs a `CoreThread` over its EngineCore (detokenize=False) on its main thread and reads
commands from the pipe on another; after each step it sends ONE `pipe.Update`. This process
(`ProcessEngine`) keeps the request streams, detokenizes, replays the metric events into the real
metrics sink and mirrors the snapshot, so `stats()` and admission never wait for the core.

How the core process starts: `loraplex-inference` forks it at start-up, before the server starts
any thread or touches torch's thread pool, which is fast (the child inherits the imported modules).
Any other caller gets a spawned one (so a script that makes one needs spawn's `if __name__ ==
"__main__":` guard): a child forked after its parent ran a parallel torch op hangs in the first op
of its own (the OpenMP pool does not survive a fork). It exits when the pipe closes: a parent that
dies takes its core with it, and one that exits without `shutdown()` stops it on the way out.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref
from typing import Any, Literal

from adapter_cache.errors import LoraplexError, UnavailableError
from inference_service.engine.client import CoreCall, EngineClientBase, EngineRequest
from inference_service.engine.config import EngineConfig
from inference_service.engine.core import EngineCore
from inference_service.engine.heap import freeze_startup_objects
from inference_service.engine.in_process import CoreThread
from inference_service.engine.pipe import (
    AbortRequest,
    CallCore,
    CoreFailed,
    CoreReady,
    Outbox,
    RecordedMetrics,
    StopCore,
    ToCore,
    Update,
    replay,
)
from inference_service.engine.request import FinishReason
from inference_service.engine.streams import StreamTable
from inference_service.engine.types import EngineStats
from inference_service.metrics_sink import MetricsSink, NullMetrics

log = logging.getLogger(__name__)

StartMethod = Literal["fork", "spawn", "forkserver"]
START_TIMEOUT_S = 900.0  # loading a large checkpoint from a slow disk
ORPHAN_EXIT_S = 10.0  # a core whose front end died exits at most this long after
STOP_TIMEOUT_S = 30.0  # a core asked to stop is killed after this long
REAP_TIMEOUT_S = 5.0  # a core whose pipe closed is killed if it has not exited after this long


# ---- the core process ------------------------------------------------------------------------------------

def _core_main(conn: multiprocessing.connection.Connection, front_end: multiprocessing.connection.Connection,
               config: EngineConfig) -> None:
    # The front end owns the lifecycle: Ctrl-C and a SIGTERM to the process group reach it, it
    # drains, then stops this process; a front end that dies closes the pipe, which ends this one
    # (once the fork's copy of the front end's end is closed here).
    front_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sink = RecordedMetrics()
    try:
        core = EngineCore(config, None, sink, detokenize=False)
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which raises it
        conn.send(CoreFailed(exc))
        return
    freeze_startup_objects()
    outbox = Outbox(conn, core, sink)
    thread = CoreThread(core, outbox.add_outputs, outbox.flush)
    conn.send(CoreReady(core.model_info, core.tokenizer, thread.stats()))
    threading.Thread(target=_read_commands, args=(conn, thread, outbox), name="commands", daemon=True).start()
    try:
        thread.run()  # on this process's main thread; returns on "stop" or a closed pipe
    finally:
        outbox.close()
        core.shutdown()


def _read_commands(conn: multiprocessing.connection.Connection, thread: CoreThread, outbox: Outbox) -> None:
    try:
        while True:
            message: ToCore = conn.recv()
            match message:
                case EngineRequest():
                    thread.add_request(message)
                case AbortRequest(request_id, reason):
                    thread.abort(request_id, reason)
                case CallCore(call_id, call):
                    future = thread.run_call(call)
                    future.add_done_callback(lambda f, call_id=call_id: outbox.add_result(call_id, f))
                case StopCore():
                    break
                case _:
                    log.error("unknown message on the engine core's pipe: %s", type(message).__name__)
    except (EOFError, OSError):
        log.warning("the front end has gone: stopping the engine core")
        # A scheduler stuck in a step would keep this process alive with nobody to serve.
        deadline = threading.Timer(ORPHAN_EXIT_S, os._exit, (1,))
        deadline.daemon = True
        deadline.start()
    finally:
        thread.stop()


# ---- the front end's side ----------------------------------------------------------------------------------

def _stop_core(process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection,
               send_lock: threading.Lock, reap_lock: threading.Lock) -> None:
    """Asks the core to stop, waits for it, kills it if it does not. The core ignores SIGTERM (its
    front end decides when to stop), so multiprocessing's own exit hook, which terminates and then
    joins every daemon child, would wait forever for a core nobody stopped: this runs before it."""
    try:
        with send_lock:
            conn.send(StopCore())
    except (OSError, ValueError):
        pass  # gone already, or never got to read commands
    _reap(process, reap_lock, STOP_TIMEOUT_S, "did not stop")
    conn.close()


def _reap(process: multiprocessing.process.BaseProcess, lock: threading.Lock, timeout: float, why: str) -> None:
    """Waits for the core to exit (reaping it: no zombie), killing it after `timeout`. One waiter at
    a time: two threads in waitpid for one child can each see it running after the other reaped it."""
    with lock:
        process.join(timeout)
        if process.is_alive():
            log.error("the engine core process %s %s: killing it", process.pid, why)
            process.kill()
            process.join(5)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "an unknown status"
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


class ProcessEngine(EngineClientBase):
    """The EngineClient interface (engine/client.py: add_request, abort, admin calls, stats) over a
    core process."""

    def __init__(self, config: EngineConfig, metrics: MetricsSink | None = None,
                 start_method: StartMethod = "spawn") -> None:
        self.config = config
        self.start_method = start_method
        self._metrics = metrics or NullMetrics()
        context = multiprocessing.get_context(start_method)  # "fork" only from a fresh process (module doc)
        self._conn, child = context.Pipe(duplex=True)
        self._process = context.Process(target=_core_main, args=(child, self._conn, config),
                                        name="loraplex-engine-core", daemon=True)
        self._process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._reap_lock = threading.Lock()
        # Runs once: from shutdown(), from a start that fails, or at exit for an engine never shut
        # down (registered after multiprocessing's exit hook, so it runs before it).
        self._stop_core = weakref.finalize(self, _stop_core, self._process, self._conn, self._send_lock,
                                           self._reap_lock)
        self._stop_core.atexit = False
        atexit.register(self._stop_core)
        try:
            hello = self._hello()
        except BaseException:  # a start-up timeout, or the caller interrupted: leave no core behind
            self._process.kill()
            self.shutdown()
            raise
        if isinstance(hello, CoreFailed):
            self.shutdown()
            raise hello.error
        self.model_info, self.tokenizer, self._stats = hello.model_info, hello.tokenizer, hello.stats
        self.streams = StreamTable(self.tokenizer, config.max_queue + config.max_num_seqs, config.stream_interval)
        self._adapter_names: frozenset[str] = frozenset()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._dead = False
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        log.info("engine core process %d started", self._process.pid)

    def _hello(self) -> CoreReady | CoreFailed:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._conn.poll(0.2):
            if not self._process.is_alive() or time.monotonic() > deadline:
                raise LoraplexError(f"the engine core process did not start (exit code {self._process.exitcode})")
        return self._conn.recv()

    def start(self) -> None:
        self._reader.start()

    def shutdown(self) -> None:
        self._stop_core()
        atexit.unregister(self._stop_core)

    # ---- what EngineClientBase asks of an engine ----

    def _submit(self, request: EngineRequest) -> None:
        self._send(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        try:
            self._send(AbortRequest(request_id, reason))
        except UnavailableError:
            pass  # no core, no request to abort

    def adapter_is_current(self, name: str) -> bool:
        return name in self._adapter_names

    @property
    def alive(self) -> bool:
        return not self._dead and self._process.is_alive()

    def stats(self) -> EngineStats:
        return self._stats

    # ---- the pipe ----

    def _run(self, call: CoreCall) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(CallCore(call_id, call))
        except UnavailableError as exc:
            self._calls.pop(call_id, None)
            future.set_exception(exc)
        return future

    def _send(self, message: ToCore) -> None:
        if self._dead:
            raise UnavailableError("the engine core process has exited")
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:
            raise UnavailableError(f"the engine core process is gone ({exc})") from None

    def _read(self) -> None:
        try:
            while True:
                self._apply(self._conn.recv())
        except (EOFError, OSError):
            pass
        finally:
            self._dead = True
            gone = UnavailableError("the engine core process has exited")
            self.streams.fail_all(gone)
            for call_id in list(self._calls):
                future = self._calls.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_exception(gone)
            self._reap_and_log()

    def _reap_and_log(self) -> None:
        """The pipe has closed (the core exited, or this side can read no more from it): reap the
        process, which nothing else would do once `alive` answers from `_dead`, and say how it ended."""
        stopping = not self._stop_core.alive  # shutdown() asked it to stop
        _reap(self._process, self._reap_lock, REAP_TIMEOUT_S, "closed its pipe but is still running")
        code = self._process.exitcode
        log.log(logging.INFO if stopping and code == 0 else logging.ERROR,
                "the engine core process %d exited with %s", self._process.pid, _exit_status(code))

    def _apply(self, update: Update) -> None:
        # Names and stats first: a LoadAdapter that returns must find its adapter admissible.
        if update.adapter_names is not None:
            self._adapter_names = update.adapter_names
        if update.stats is not None:
            self._stats = update.stats
        replay(self._metrics, update.recorded_metrics)
        self.streams.deliver(update.outputs, update.deltas)
        for result in update.results:
            future = self._calls.pop(result.call_id, None)
            if future is None:
                continue
            if result.error is None:
                future.set_result(result.value)
            else:
                future.set_exception(result.error)
