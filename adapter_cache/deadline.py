"""The overall deadline of one adapter fetch (--fetch-deadline-seconds), enforced on sockets."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from inference_service.errors import UnavailableError


class FetchDeadlineError(UnavailableError):
    """A fetch ran past --fetch-deadline-seconds (a slow or stalled origin); not retried here."""


class Deadline:
    """The overall time one fetch may take, enforced on its connections.

    A socket timeout cannot stop an origin that drips a byte at a time, and a read into a large
    buffer only returns once the buffer is full; so when the time is up a timer shuts down every
    connection the fetch is reading from, which ends those reads at once.
    """

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        return self._at - time.monotonic()

    def check(self) -> None:
        if self._expired or self.remaining() <= 0:
            raise FetchDeadlineError(
                f"{self.what}: not fetched within {self.seconds:g}s (--fetch-deadline-seconds); "
                "the origin is too slow or stalled"
            )

    @contextmanager
    def watch(self, fileno: int) -> Iterator[None]:
        """Cut the connection behind `fileno` if the deadline passes while it is read.

        The descriptor is duplicated for the duration, so the timer can never shut down a
        socket whose number was reused after the response was closed.
        """
        sock = socket.socket(fileno=os.dup(fileno))
        with self._lock:
            self._socks.add(sock)
        try:
            self.check()
            yield
        finally:
            with self._lock:
                self._socks.discard(sock)
            sock.close()

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by the peer
                pass


def watch_response(deadline: Deadline | None, resp: object) -> AbstractContextManager[None]:
    """`deadline.watch` on an HTTP response's socket (a no-op without a deadline)."""
    return deadline.watch(resp.fileno()) if deadline is not None else nullcontext()  # type: ignore[attr-defined]


def deadline_timeout(limit_s: float, deadline: Deadline | None) -> float:
    """A per-request socket timeout that does not outlast the deadline."""
    return limit_s if deadline is None else max(0.01, min(limit_s, deadline.remaining()))
