"""Counts the JSON values of a request body in a process of its own, at a low priority.

A body's parse costs time in proportion to how many values it holds, and pydantic-core (like the
stdlib json) holds the GIL for the whole parse: 0.3-0.8 s for a 4 MB body of 2M ids, every stream
of the process stopped meanwhile, whatever thread runs it. So a body that may hold more values than
any request can use (http/body.py decides, from its commas) is counted here first, where its parse
stops nothing but this process, and the front end parses it only if the count is within bounds.

Parent side: `ValueCounter.count(raw)` (blocking; call it from a worker thread). Child side:
`python -m inference_service.frontend.http.value_count` reads 8-byte big-endian lengths and bodies on stdin
and answers one JSON line each, `{"values": n, "field": top-level key holding the most}` or
`{"error": message}`; it exits at EOF, so it ends with its parent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

from pydantic_core import from_json

from adapter_cache.errors import LoraplexError
from inference_service.frontend.http.errors import BadField

CHILD_NICE = 10  # the engine core and the front end come first


def count_values(data: Any) -> int:
    """Values in a parsed JSON document, object keys included."""
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            count += len(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count


def answer(raw: bytes) -> dict[str, Any]:
    try:
        data = from_json(raw)
    except ValueError as e:
        return {"error": str(e)}
    fields = {str(k): count_values(v) for k, v in data.items()} if isinstance(data, dict) else {}
    return {"values": count_values(data), "field": max(fields, key=fields.__getitem__, default=None)}


class ValueCounter:
    """The parent's handle on the child: started on first use, again after it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def count(self, raw: bytes) -> tuple[int, str | None]:
        """(values, the top-level field holding the most) of a JSON body; BadField if it is not JSON."""
        with self._lock:
            try:
                reply = self._exchange(raw)
            except OSError as e:  # the child died (killed, out of memory): the next call starts another
                self._stop()
                raise LoraplexError(f"the request body could not be checked: {e}") from None
        if "error" in reply:
            raise BadField(f"the request body is not valid JSON: {reply['error']}", None)
        return reply["values"], reply["field"]

    def _exchange(self, raw: bytes) -> dict[str, Any]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(len(raw).to_bytes(8, "big"))
        self._proc.stdin.write(raw)
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise OSError("the value counter exited")
        return json.loads(line)

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def main() -> None:
    os.nice(CHILD_NICE)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while len(header := stdin.read(8)) == 8:
        stdout.write(json.dumps(answer(stdin.read(int.from_bytes(header, "big")))).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()
