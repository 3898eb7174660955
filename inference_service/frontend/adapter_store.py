"""The adapters loaded through the API, kept in `--state-dir` so they survive a restart.

One small JSON file (`adapters.json`), rewritten whole and atomically (a temporary file in the same
directory, fsync, rename, fsync of the directory) after every successful load or unload, so a crash
leaves the old or the new list, never a torn one. A file and not the sidecar: the sidecar caches
bytes by URI and may evict them at will, while this is a list of who registered which name from
where, a few hundred bytes per adapter, that must outlive both processes (mount the directory from a
volume that outlives the pod to keep it across pods). At start-up the entries are registered again,
with their owners, before the server reports ready; their weights load on first use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

FILE_NAME = "adapters.json"
MAX_ENTRIES = 100_000  # a file larger than any registry is not ours


@dataclass(frozen=True)
class Registration:
    """One adapter as the API registered it: its engine name, owner (None: shared) and source."""

    engine_name: str
    owner: str | None
    uri: str
    sha256: str | None = None
    pinned: bool = False


class RegistrationStore:
    """`state_dir/adapters.json`: engine name → Registration (event-loop thread only)."""

    def __init__(self, state_dir: str) -> None:
        os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, FILE_NAME)
        self._entries: dict[str, Registration] = {r.engine_name: r for r in self._read()}

    def entries(self) -> list[Registration]:
        return list(self._entries.values())

    def put(self, registration: Registration) -> None:
        self._entries[registration.engine_name] = registration
        self._write()

    def remove(self, engine_name: str) -> None:
        if self._entries.pop(engine_name, None) is not None:
            self._write()

    def _read(self) -> list[Registration]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return []
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}: not JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("adapters"), list) \
                or len(data["adapters"]) > MAX_ENTRIES:
            raise ValueError(f"{self.path}: expected {{adapters: [...]}} written by loraplex")
        out = []
        for entry in data["adapters"]:
            try:
                out.append(Registration(str(entry["engine_name"]), entry.get("owner"), str(entry["uri"]),
                                        entry.get("sha256"), bool(entry.get("pinned", False))))
            except (KeyError, TypeError) as e:
                raise ValueError(f"{self.path}: malformed entry ({e})") from None
        return out

    def _write(self) -> None:
        directory = os.path.dirname(self.path)
        payload = json.dumps({"adapters": [asdict(r) for r in self._entries.values()]}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=".adapters-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

