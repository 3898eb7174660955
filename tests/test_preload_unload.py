"""An operator's UnloadAdapter of a preloaded adapter: one truth for its state, whichever path changed
it. It is gone from ListAdapters (not LOADED at slot -1), Generate answers NOT_FOUND, /v1/models omits
it, `loraplex_preload_adapters` counts it as unloaded, readiness stays SERVING (the operator's
decision), and the preloader does not load it again until its line in the preload file changes.

Real server subprocess, real adapter files, the preload file re-read every 0.2 s."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_cache.uri_policy import UriPolicy
from harness.inference_server import InferenceServer, start_inference_server
from harness.waiting import wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.engine.config import EngineConfig
from inference_service.engine.in_process import Engine
from inference_service.frontend.preload import PreloadEntry, Preloader
from inference_service.limits import check_adapter_name

RELOADS = "loraplex_preload_reloads_total"


def _entries(root: Path, p_pinned: bool, q_pinned: bool) -> str:
    return json.dumps([
        {"name": "p", "uri": (root / "p").as_uri(), "pinned": p_pinned, "required": True},
        {"name": "q", "uri": (root / "q").as_uri(), "pinned": q_pinned},
    ])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InferenceServer]:
    for i, name in enumerate(("p", "q")):
        write_peft_adapter(tmp_path / name, rank=4, seed=40 + i)
    (tmp_path / "preload.json").write_text(_entries(tmp_path, p_pinned=True, q_pinned=False))
    s = start_inference_server(["--model", "builtin:tiny", "--max-loras", "3", "--adapter-source-allow",
                                tmp_path.as_uri() + "/", "--preload-file", str(tmp_path / "preload.json"),
                                "--preload-reload-s", "0.2"], log_dir=tmp_path, http=True)
    yield s
    s.stop()


def _states(server: InferenceServer) -> dict[str, tuple[str, int]]:
    with InferenceClient(server.address) as client:
        return {a.name: (pb.AdapterState.Name(a.state), a.slot) for a in client.list_adapters(timeout=30)}


def _models(server: InferenceServer) -> set[str]:
    with urllib.request.urlopen(server.http_url + "/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def _readiness(server: InferenceServer) -> str:
    with server.channel() as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_an_unloaded_preload_stays_unloaded_and_reads_so_everywhere(server: InferenceServer, tmp_path: Path) -> None:
    wait_until(lambda: _states(server).get("q", ("",))[0] == "ADAPTER_STATE_LOADED", "q loaded")
    assert _states(server)["p"][0] == "ADAPTER_STATE_LOADED"
    with InferenceClient(server.address) as client:
        client.unload_adapter("p", timeout=30)
        assert "p" not in _states(server)
        with pytest.raises(grpc.RpcError) as info:
            client.generate_text("Hello", adapter="p", max_new_tokens=2, timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "p" not in _models(server) and "q" in _models(server)
    assert server.value("loraplex_preload_adapters", state="unloaded") == 1
    assert server.value("loraplex_preload_adapters", state="loaded") == 1
    assert _readiness(server) == "SERVING"

    # Another entry changes: the file is applied again, and p is still not loaded back.
    reloads = server.value(RELOADS)
    (tmp_path / "preload.json").write_text(_entries(tmp_path, p_pinned=True, q_pinned=True))
    wait_until(lambda: server.value(RELOADS) > reloads, "the changed preload file applied")
    wait_until(lambda: _states(server).get("q", ("", -1))[1] >= 0 and
          server.value("loraplex_preload_adapters", state="loading") == 0, "q reloaded")
    assert "p" not in _states(server)
    assert server.value("loraplex_preload_adapters", state="unloaded") == 1

    # Its own line changes: that is the operator asking for it again.
    (tmp_path / "preload.json").write_text(_entries(tmp_path, p_pinned=False, q_pinned=True))
    wait_until(lambda: _states(server).get("p", ("",))[0] == "ADAPTER_STATE_LOADED", "p loaded again")
    assert server.value("loraplex_preload_adapters", state="unloaded") == 0
    with InferenceClient(server.address) as client:
        assert client.generate_text("Hello", adapter="p", max_new_tokens=2, timeout=30)


@pytest.fixture
def slow_server(tmp_path: Path) -> Iterator[InferenceServer]:
    """Two slots; every step 20 ms slower (the test-only hook), so long requests hold both slots."""
    for i, name in enumerate(("p", "q", "p2")):
        write_peft_adapter(tmp_path / name, rank=4, seed=50 + i)
    (tmp_path / "preload.json").write_text(_entries(tmp_path, p_pinned=False, q_pinned=False))
    s = start_inference_server(["--model", "builtin:tiny", "--max-loras", "2", "--adapter-source-allow",
                                tmp_path.as_uri() + "/", "--preload-file", str(tmp_path / "preload.json"),
                                "--preload-reload-s", "0.2"], env={"LORAPLEX_TEST_FAULT_STEP_DELAY_S": "0.02"},
                               log_dir=tmp_path)
    yield s
    s.stop()


def test_an_unload_during_a_preload_reload_is_not_undone(slow_server: InferenceServer, tmp_path: Path) -> None:
    """The preload file moves p to a new URI while both slots are held by requests (p's old version and
    q): the new version registers and waits for a slot; an UnloadAdapter then retires it. The
    preloader must take that as the operator's decision, not as a failure to retry."""
    server = slow_server
    wait_until(lambda: {n for n, (s, _) in _states(server).items() if s == "ADAPTER_STATE_LOADED"} == {"p", "q"},
          "p and q loaded")
    with InferenceClient(server.address) as client:
        info = client.model_info()
        tokens = min(info.max_new_tokens_limit, info.max_context - 16)
        holds = [client.generate("Hello", adapter=name, max_new_tokens=tokens, ignore_eos=True, timeout=120)
                 for name in ("p", "q")]
        for stream in holds:
            next(stream)
        entries = json.loads(_entries(tmp_path, p_pinned=False, q_pinned=False))
        entries[0]["uri"] = (tmp_path / "p2").as_uri()
        (tmp_path / "preload.json").write_text(json.dumps(entries))

        def versions() -> dict[int, str]:
            return {a.version: pb.AdapterState.Name(a.state) for a in client.list_adapters(timeout=30) if a.name == "p"}

        # Version 2 is current (version 1 drains under its request) and waits for a slot.
        wait_until(lambda: versions() == {1: "ADAPTER_STATE_DRAINING", 2: "ADAPTER_STATE_HOST_READY"}, "p@2 waiting")
        client.unload_adapter("p", timeout=30)
        wait_until(lambda: "preload p: adapter p was unloaded or replaced while loading" in server.log(),
              "the preloader saw the unload")
        time.sleep(2.5)  # longer than the preloader's first retry backoff (1 s): a retry would be in by now
        assert versions() == {1: "ADAPTER_STATE_DRAINING"}
        with pytest.raises(grpc.RpcError) as err:
            client.generate_text("Hello", adapter="p", max_new_tokens=2, timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert server.value("loraplex_preload_adapters", state="unloaded") == 1
        assert _readiness(server) == "SERVING"
        for stream in holds:
            stream.cancel()
        wait_until(lambda: not versions(), "p@1 drained once its request ended")


def test_a_failing_entry_stays_failed_while_it_is_retried(tmp_path: Path) -> None:
    """Every attempt after the first leaves the entry FAILED until one succeeds: an entry that went
    back to LOADING for each retry made `loraplex_preload_adapters{state="failed"}` flicker to 0 (an
    operator's alert reset; the kubelet pod test's query once landed in such a window). The states
    are read at every change the preloader reports (its `on_change`), so no window is missed; the
    engine is the real in-process one, the adapter directory really missing until it is written."""
    engine = Engine(EngineConfig(model="builtin:tiny", device="cpu", adapter_source_allow=(tmp_path.as_uri() + "/",)))
    seen: list[str] = []

    async def scenario() -> None:
        preloader: Preloader

        async def changed() -> None:
            seen.append(preloader.states()["late"])

        preloader = Preloader(engine, UriPolicy([tmp_path.as_uri() + "/"]), check_adapter_name, None,
                              [PreloadEntry("late", (tmp_path / "late").as_uri())], retry_initial_s=0.05,
                              retry_max_s=0.1, on_change=changed)
        task = asyncio.create_task(preloader.run())
        try:
            while preloader.failures_total < 3:
                await asyncio.sleep(0.01)
            write_peft_adapter(tmp_path / "late", rank=4, seed=7)  # the next retry succeeds
            while seen[-1] != "LOADED":
                await asyncio.sleep(0.01)
        finally:
            preloader.stop()
            task.cancel()

    engine.start()
    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        engine.shutdown()
    first_failure = seen.index("FAILED")
    assert "LOADING" in seen[:first_failure]  # the first attempt is LOADING
    assert set(seen[first_failure:-1]) == {"FAILED"}, seen  # retries do not flicker
    assert seen[-1] == "LOADED"
