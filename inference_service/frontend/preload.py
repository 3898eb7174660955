"""Adapters named in --preload-file, loaded in the background.

A failing entry never stops the server: it shows as FAILED (LOADING while an attempt runs) in
ListAdapters and in `loraplex_preload_adapters{state}`, and is retried with capped exponential
backoff. Entries with `required: true` gate readiness until they are in. The file is read again every
`reload_s` (a Kubernetes ConfigMap mount is updated in place), so added, changed and removed entries
reach a running server without a restart.

Once an entry is in, it is an ordinary registered adapter and the engine alone says what state it is
in. An operator's UnloadAdapter of it (or one during a reload of it) wins: the entry reads UNLOADED,
is not listed, no longer gates readiness, and is not loaded again until its line in the file changes
(or the server restarts).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adapter_cache.errors import LoraplexError
from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.lora.registry import UnloadedWhileLoadingError

log = logging.getLogger("loraplex.preload")
STATES = ("LOADING", "LOADED", "FAILED", "UNLOADED")
_KEYS = {"name": str, "uri": str, "pinned": bool, "required": bool, "sha256": str}


@dataclass(frozen=True)
class PreloadEntry:
    name: str
    uri: str
    pinned: bool = False
    required: bool = False
    sha256: str | None = None


def parse_preload(text: str, path: str) -> list[PreloadEntry]:
    """A YAML or JSON list (or {adapters: [...]}) of {name, uri, pinned, required, sha256}."""
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if isinstance(data, dict) and "adapters" in data:
        data = data["adapters"]
    data = data or []
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of {{name, uri, pinned, required}} entries")
    entries, names = [], set()
    for i, e in enumerate(data):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("uri"), str):
            raise ValueError(f"{path}: entry {i} needs string 'name' and 'uri'")
        bad = [k for k, v in e.items() if k not in _KEYS or (v is not None and not isinstance(v, _KEYS[k]))]
        if bad:
            raise ValueError(f"{path}: entry {i} ({e['name']}): unknown or mistyped keys {bad}")
        if e["name"] in names:
            raise ValueError(f"{path}: adapter {e['name']!r} is listed twice")
        names.add(e["name"])
        entries.append(PreloadEntry(e["name"], e["uri"], bool(e.get("pinned")), bool(e.get("required")),
                                    (e.get("sha256") or "").lower() or None))
    return entries


def read_preload_file(path: str) -> list[PreloadEntry]:
    return parse_preload(Path(path).read_text(encoding="utf-8"), path)


@dataclass
class _Slot:
    """What only the preloader knows about an entry; its state once in comes from the engine."""

    entry: PreloadEntry
    task: asyncio.Task
    failed: bool = False  # an attempt failed and none has succeeded since (a retry may be running)
    error: str = ""
    attempts: int = 0
    settled: bool = False  # done: loaded, or an operator unloaded or replaced it while it loaded


class Preloader:
    """Loads every entry (retrying failures); `on_change` runs after every change of what it knows
    (health recomputes)."""

    def __init__(self, engine: EngineClient, policy: UriPolicy, check_name: Callable[[str], object],
                 path: str | None, entries: list[PreloadEntry], reload_s: float = 10.0,
                 retry_initial_s: float = 1.0, retry_max_s: float = 60.0,
                 on_change: Callable[[], Any] | None = None, fixed: Sequence[PreloadEntry] = ()) -> None:
        """`entries`: the start's list, `fixed` among them (--lora-modules) kept whatever the file says."""
        self._engine, self._policy, self._check_name = engine, policy, check_name
        self._path, self._initial, self._reload_s = path, entries, reload_s
        self._retry = (retry_initial_s, retry_max_s)
        self._on_change = on_change
        self._fixed = list(fixed)
        self._slots: dict[str, _Slot] = {}
        self.failures_total = 0
        self.reloads_total = 0

    # ---- views ----
    @property
    def required_ready(self) -> bool:
        return all(s.settled for s in self._slots.values() if s.entry.required)

    def state(self, name: str) -> str:
        """LOADING / FAILED until the entry is in; then LOADED while the engine serves the name, and
        UNLOADED once an operator unloaded it (the engine's name set is the one truth for that)."""
        slot = self._slots[name]
        if slot.settled:
            return "LOADED" if self._engine.adapter_is_current(name) else "UNLOADED"
        return "FAILED" if slot.failed else "LOADING"

    def states(self) -> dict[str, str]:
        return {name: self.state(name) for name in self._slots}

    def unregistered(self, registered: set[str]) -> list[tuple[PreloadEntry, str]]:
        """(entry, state) of entries still loading or failing that the engine does not list; an entry
        an operator unloaded is not listed (the engine has no such adapter)."""
        return [(s.entry, state) for name, s in sorted(self._slots.items())
                if name not in registered and (state := self.state(name)) in ("LOADING", "FAILED")]

    def collector(self) -> Any:
        preloader = self

        class _Collector:
            def collect(self):  # noqa: ANN202 - prometheus_client collector protocol
                g = GaugeMetricFamily("loraplex_preload_adapters", "preload entries by state", labels=["state"])
                counts = {s: 0 for s in STATES}
                for state in preloader.states().values():
                    counts[state] += 1
                for state, n in counts.items():
                    g.add_metric([state.lower()], n)
                yield g
                yield CounterMetricFamily("loraplex_preload_failures", "failed preload attempts (each retried)",
                                          value=preloader.failures_total)
                yield CounterMetricFamily("loraplex_preload_reloads", "preload file changes applied",
                                          value=preloader.reloads_total)

        return _Collector()

    # ---- running ----
    async def run(self) -> None:
        """Starts every entry, then re-reads the file until cancelled."""
        self._apply(self._initial)
        await self._changed()
        if not self._path or self._reload_s <= 0:
            await asyncio.Event().wait()
        current = self._initial
        while True:
            await asyncio.sleep(self._reload_s)
            try:
                entries = self._fixed + await asyncio.to_thread(read_preload_file, self._path)
            except (OSError, ValueError) as e:
                log.error("preload file %s unreadable, keeping the previous list: %s", self._path, e)
                continue
            if entries != current:
                log.info("preload file %s changed: %d entries", self._path, len(entries))
                self.reloads_total += 1
                current = entries
                await self._unload_removed(entries)
                self._apply(entries)
                await self._changed()

    def stop(self) -> None:
        for slot in self._slots.values():
            slot.task.cancel()

    def _apply(self, entries: list[PreloadEntry]) -> None:
        for entry in entries:
            slot = self._slots.get(entry.name)
            if slot is not None and slot.entry == entry:
                continue
            if slot is not None:
                slot.task.cancel()
            self._slots[entry.name] = _Slot(entry, asyncio.create_task(self._keep_loaded(entry)))

    async def _unload_removed(self, entries: list[PreloadEntry]) -> None:
        keep = {e.name for e in entries}
        for name in [n for n in self._slots if n not in keep]:
            state = self.state(name)
            slot = self._slots.pop(name)
            slot.task.cancel()
            if state == "LOADED":
                try:
                    await asyncio.wrap_future(self._engine.unload_adapter(name))
                    log.info("preload entry %s removed: adapter unloaded", name)
                except LoraplexError as e:
                    log.warning("preload entry %s removed; unloading it failed: %s", name, e)

    async def _keep_loaded(self, entry: PreloadEntry) -> None:
        """Loads one entry, retrying with capped exponential backoff (jittered) until it is in."""
        initial, cap = self._retry
        try:
            self._check_name(entry.name)
            uri = self._policy.check(entry.uri)
        except LoraplexError as e:  # a configuration error: retrying cannot fix it
            await self._set(entry.name, failed=True, error=f"{e} (not retried: fix the preload file)")
            self.failures_total += 1
            return
        while True:
            slot = self._slots[entry.name]
            slot.attempts += 1
            if slot.attempts == 1:
                # A retry leaves a failed entry FAILED until an attempt succeeds: a gauge that
                # flickered to LOADING for every attempt would reset an operator's alert each time.
                await self._set(entry.name, failed=False)
            try:
                await asyncio.wrap_future(self._engine.load_adapter(
                    entry.name, uri, sha256=entry.sha256, pinned=entry.pinned, preload=True))
            except UnloadedWhileLoadingError as e:  # an operator's UnloadAdapter (or newer version) wins
                log.warning("preload %s: %s; not loading it again until its entry changes", entry.name, e)
                await self._set(entry.name, settled=True)
                return
            except Exception as e:  # noqa: BLE001 - whatever it is, the server goes on and retries
                self.failures_total += 1
                delay = min(cap, initial * 2 ** (slot.attempts - 1)) * random.uniform(0.8, 1.0)
                await self._set(entry.name, failed=True, error=f"{e}")
                log.warning("preload %s from %s failed (attempt %d, %s); retrying in %.1fs", entry.name,
                            entry.uri, slot.attempts, getattr(e, "code", type(e).__name__), delay)
                await asyncio.sleep(delay)
                continue
            await self._set(entry.name, settled=True)
            log.info("preloaded adapter %s from %s (attempt %d)", entry.name, entry.uri, slot.attempts)
            return

    async def _set(self, name: str, failed: bool = False, error: str = "", settled: bool = False) -> None:
        slot = self._slots.get(name)
        if slot is None:
            return
        slot.failed, slot.error, slot.settled = failed, error, settled
        await self._changed()

    async def _changed(self) -> None:
        if self._on_change is not None:
            await self._on_change()
