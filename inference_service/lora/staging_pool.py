"""Host-preparation workers that one hung source cannot hold.

Each task (fetch + validate one adapter, or release a sidecar lease) runs on a thread of its own,
at most `workers` at a time; the rest queue. Tasks carry a source key (the URI's scheme and host or
bucket), and a task whose source has nothing running may start beyond `workers` (up to twice it):
so a stuck origin holding every worker does not hold up the others' loads, while loads from one
source run `workers` wide as before. A task still running at its deadline is abandoned: its
future fails with UNAVAILABLE (retryable) and it no longer counts against `workers`, so the queue
moves on while its thread is left to finish, or hang, alone. Abandoned threads are bounded too:
past `max_abandoned`, new tasks fail at once rather than pile up threads.

Queued tasks wait in one queue per source, so starting the next costs O(sources queued), never
O(tasks queued): a burst of registrations queues thousands, and the scheduler thread submits them
and calls `expire` every step.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapter_cache.errors import UnavailableError
from inference_service.device import background_worker_thread

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Task:
    fn: Callable[[], Any]
    future: concurrent.futures.Future
    on_orphan: Callable[[Any], None] | None
    key: str
    seq: int  # arrival order: the oldest startable task starts first
    deadline: float = 0.0
    abandoned: bool = False


class StagingPool:
    def __init__(self, workers: int, timeout_s: float, max_abandoned: int | None = None) -> None:
        if workers < 1:
            raise ValueError("host_load_workers must be at least 1")
        self.workers, self.timeout_s = workers, timeout_s
        self.max_abandoned = max_abandoned if max_abandoned is not None else 4 * workers
        self._lock = threading.Lock()
        self._queues: dict[str, deque[_Task]] = {}  # source key → its queued tasks, oldest first
        self._arrivals = itertools.count()
        self._running: set[_Task] = set()
        self._abandoned = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any, key: str = "",
               on_orphan: Callable[[Any], None] | None = None) -> concurrent.futures.Future:
        """`key`: the task's source; `on_orphan` gets the result of a task that completes after it
        was abandoned (e.g. to release what it holds)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        task = _Task(lambda: fn(*args), future, on_orphan, key, next(self._arrivals))
        with self._lock:
            if self._closed:
                raise RuntimeError("the staging pool is shut down")
            if self._abandoned >= self.max_abandoned:
                future.set_exception(UnavailableError(
                    f"{self._abandoned} adapter preparations are stuck past their deadline; try again later"))
                return future
            self._queues.setdefault(key, deque()).append(task)
            self._start_queued()
        return future

    def expire(self, now: float | None = None) -> None:
        """Abandon tasks past their deadline (the manager calls this every scheduler step; O(workers))."""
        now = time.monotonic() if now is None else now
        with self._lock:
            overdue = [t for t in self._running if now >= t.deadline]
            for task in overdue:
                self._running.discard(task)
                task.abandoned = True
                self._abandoned += 1
            self._start_queued()
        for task in overdue:
            log.warning("an adapter preparation overran its %.1f s deadline; abandoned", self.timeout_s)
            _settle(task.future, error=UnavailableError(
                f"preparing the adapter took longer than {self.timeout_s:g} s (--adapter-load-timeout-s)"))

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        with self._lock:
            self._closed = True
            queued = [task for tasks in self._queues.values() for task in tasks]
            self._queues = {}
        if cancel_futures:
            for task in queued:
                task.future.cancel()

    def _start_queued(self) -> None:
        """Under the lock: start queued tasks, oldest first, while places are free (or the task's
        source has none running and the pool is under twice its size). A source's tasks can all
        start or none can, so the oldest startable task is the head of some source's queue."""
        held = Counter(t.key for t in self._running)
        while self._queues and (running := len(self._running)) < 2 * self.workers:
            heads = [tasks[0] for key, tasks in self._queues.items() if running < self.workers or not held[key]]
            if not heads:
                return
            task = min(heads, key=lambda t: t.seq)
            tasks = self._queues[task.key]
            tasks.popleft()
            if not tasks:
                del self._queues[task.key]
            if not task.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            task.deadline = time.monotonic() + self.timeout_s
            self._running.add(task)
            held[task.key] += 1
            threading.Thread(target=self._run, args=(task,), name="lora-host", daemon=True).start()

    def _run(self, task: _Task) -> None:
        background_worker_thread()
        try:
            result, error = task.fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the future's owner
            result, error = None, exc
        with self._lock:
            orphan = task.abandoned
            if orphan:
                self._abandoned -= 1
            else:
                self._running.discard(task)
                self._start_queued()
        if orphan:
            if error is None and task.on_orphan is not None:
                try:
                    task.on_orphan(result)
                except Exception as exc:  # noqa: BLE001 - a daemon thread: log, never raise
                    log.warning("releasing an abandoned adapter preparation failed: %s", exc)
            return
        _settle(task.future, result, error)


def _settle(future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # settled by `expire` first
