"""The serving process: the gRPC front end (which carries the health service) and the front ends
served beside it (the HTTP API), started together, ready together, drained together.

Neither front end knows the other: each is built from the same `ServerConfig` and engine, and this
module alone starts them, runs what they share (preloads, the engine watchdog, the plaintext health
listener) and stops them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from adapter_cache.uri_policy import UriPolicy
from inference_service.engine.client import EngineClient
from inference_service.frontend.chat_template import ChatTemplate
from inference_service.frontend.config import ServerConfig
from inference_service.frontend.grpc_server import SERVICE_NAME, GrpcMetrics, RunningServer, build_server
from inference_service.frontend.health import HealthReporter, install_test_fault, start_health_listener, watch_engine
from inference_service.frontend.intake import adapter_name
from inference_service.frontend.preload import Preloader

log = logging.getLogger("loraplex.server")


class FrontEnd(Protocol):
    """A front end served beside gRPC (the HTTP API): it starts once gRPC listens, reports the
    same readiness, and drains with it (see `drain`)."""

    async def start(self, ready: Callable[[], bool]) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


async def serve(engine: EngineClient, config: ServerConfig, metrics: GrpcMetrics | None = None,
                stop: asyncio.Event | None = None, collectors: Any = None, front_ends: Sequence[FrontEnd] = (),
                chat_template: ChatTemplate | None = None) -> None:
    """Serves until `stop` is set (or the task is cancelled), then drains (see ServerConfig).

    Health: the liveness service is SERVING from the start; readiness once the required preloads
    are in. Other preloads load (and retry) in the background. `collectors`: a prometheus registry
    to register the health and preload metrics on."""
    running = await build_server(engine, config, metrics, serving=False, chat_template=chat_template)
    await config.adapters.restore(engine)  # the tenants' adapters of the last run, before readiness
    reporter = HealthReporter(running.health, ("", SERVICE_NAME))
    try:  # before the preloads can make readiness SERVING: a ready server serves on every port
        for front_end in front_ends:
            await front_end.start(lambda: reporter.ready)
    except BaseException:
        await running.server.stop(0)
        raise
    health_only = await start_health_listener(running.health, config.health_listen) if config.health_listen else None
    preloader = Preloader(engine, UriPolicy(config.adapter_source_allow), adapter_name, config.preload_file,
                          config.preload + config.lora_modules, config.preload_reload_s,
                          on_change=lambda: _preloads_changed(reporter, preloader), fixed=config.lora_modules)
    running.servicer.preloader = preloader
    await reporter.update()  # liveness SERVING, readiness NOT_SERVING until the preloads say otherwise
    if collectors is not None:
        collectors.register(reporter.collector())
        collectors.register(preloader.collector())
    install_test_fault(engine)
    # The watcher runs whatever --watchdog-stall-s says: 0 turns off the stall check, not the
    # check that the engine is alive at all.
    tasks = [asyncio.create_task(preloader.run()),
             asyncio.create_task(watch_engine(engine, reporter, config.watchdog_stall_s))]
    shown = config.listen
    if not config.listen.startswith("unix"):
        shown = f"{config.listen.rsplit(':', 1)[0]}:{running.port}"
    log.info("loraplex.v1.Inference listening on %s%s", shown, " (TLS)" if config.tls_cert else "")
    print(f"LISTENING {shown}", flush=True)
    try:
        if stop is None:
            await running.server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        await drain(running, reporter, engine, config, front_ends)
        preloader.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if health_only is not None:  # last: the probes saw readiness NOT_SERVING through the drain
            await health_only.stop(None)


async def _preloads_changed(reporter: HealthReporter, preloader: Preloader) -> None:
    reporter.preloads_ready = preloader.required_ready
    await reporter.update()


async def drain(running: RunningServer, reporter: HealthReporter, engine: EngineClient, config: ServerConfig,
                front_ends: Sequence[FrontEnd] = ()) -> None:
    """Readiness NOT_SERVING first (on every front end); after drain_delay_s new requests are
    refused on every port at once; in-flight ones finish within what is left of shutdown_grace_s;
    the rest are cancelled and counted."""
    started = time.monotonic()
    reporter.draining = True
    await reporter.update()
    log.info("draining: NOT_SERVING now, new RPCs refused in %.1fs, in-flight ones have %.1fs",
             config.drain_delay_s, config.shutdown_grace_s)
    await asyncio.sleep(max(0.0, min(config.drain_delay_s, config.shutdown_grace_s)))
    left = max(0.0, config.shutdown_grace_s - (time.monotonic() - started))
    stopping = asyncio.ensure_future(asyncio.gather(running.server.stop(left),
                                                    *(front_end.stop(left) for front_end in front_ends)))
    done, _ = await asyncio.wait({stopping}, timeout=max(0.0, left - 0.1))
    cancelled = 0
    if not done:
        stats = engine.stats()
        cancelled = stats.requests_running + sum(stats.requests_waiting.values())
    await stopping
    if cancelled:
        reporter.drain_cancelled += cancelled
        log.warning("drain: %d request(s) still running after %.1fs were cancelled", cancelled,
                    config.shutdown_grace_s)
    log.info("drained in %.1fs", time.monotonic() - started)
