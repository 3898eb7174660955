"""In-flight host→slot loads and their completion events.

LOADING ⇔ a pending load exists here. `drain` collects every completed load, whether or not a
request still wants that adapter, and must run before any status or capacity decision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from adapter_cache.adapter_format import LoadTier
from inference_service.device import CopyEngine, CopyHandle
from inference_service.kernels.copy import CopyJob


@dataclass
class PendingLoad:
    uid: str
    slot: int
    handle: CopyHandle
    started: float
    tier: LoadTier


@dataclass
class CompletedLoad:
    load: PendingLoad
    seconds: float
    error: BaseException | None


class OverlapLoader:
    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.pending: dict[str, PendingLoad] = {}

    def start(self, uid: str, slot: int, copy: CopyJob, tier: LoadTier, started: float) -> None:
        assert uid not in self.pending, f"{uid} already loading"
        self.pending[uid] = PendingLoad(uid, slot, self.engine.submit(copy), started, tier)

    def is_loading(self, uid: str) -> bool:
        return uid in self.pending

    def drain(self) -> list[CompletedLoad]:
        done = [p for p in self.pending.values() if p.handle.done()]
        return [self._complete(p) for p in done]

    def wait(self, uid: str) -> CompletedLoad:
        """Block until one load finishes (unloading an adapter whose copy is in flight)."""
        return self._complete(self.pending[uid])

    def _complete(self, load: PendingLoad) -> CompletedLoad:
        del self.pending[load.uid]
        try:
            load.handle.before_use()
            error = None
        except Exception as exc:  # noqa: BLE001 - reported per adapter by the manager
            error = exc
        return CompletedLoad(load, time.monotonic() - load.started, error)
