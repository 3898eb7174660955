"""What grpc.health.v1 reports, from one place: readiness, liveness and the scheduler watchdog.

Two answers, for the two kubelet probes:
- readiness (service "" and "loraplex.v1.Inference"): SERVING once required preloads are in, while
  the engine makes progress and the server is not draining. Takes the pod out of its Service.
- liveness (service "liveness"): SERVING while the scheduler thread is alive and makes progress.
  NOT_SERVING makes the kubelet restart the container, so draining leaves it SERVING.

The watcher always checks that the engine is alive (its scheduler thread, or its core process):
a dead engine serves nothing, whatever the watchdog's setting. With `stall_s` > 0 it also proves
progress end to end: it hands the scheduler thread a no-op between steps and expects it back
within `stall_s`; an unanswered heartbeat is a stuck engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from inference_service.engine.client import EngineClient
from inference_service.engine.types import TEST_FAULT_ENV, TEST_STEP_DELAY_ENV, TestFault

log = logging.getLogger("loraplex.health")

LIVENESS_SERVICE = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Test-only fault hooks (tests/test_kubelet_pod.py), never set in production: TEST_FAULT_ENV set to
# "die" or "hang[:SECONDS]" makes SIGUSR1 kill the scheduler thread or wedge it in a "step" that lasts
# that long (default: forever); TEST_STEP_DELAY_ENV makes every scheduler step this many seconds
# slower (a big model's pace on a toy model). Either is also the test flag that lets the engine arm
# a fault at all (EngineClient.install_fault, engine.types.test_faults_enabled).
ALIVE_POLL_S = 1.0  # how often the watcher looks at the engine (more often with a short stall limit)


class HealthReporter:
    """Derives both health answers from three facts and pushes changes to the health servicer."""

    def __init__(self, servicer: health.aio.HealthServicer, readiness_services: tuple[str, ...]) -> None:
        self._servicer = servicer
        self._readiness_services = readiness_services
        self.preloads_ready = False
        self.engine_problem: str | None = None
        self.draining = False
        self.drain_cancelled = 0  # requests still running when the shutdown grace ran out
        self._shown: tuple[bool, bool] | None = None
        self._lock = asyncio.Lock()  # the watchdog, the preloader and the drain all update

    @property
    def ready(self) -> bool:
        return self.preloads_ready and self.engine_problem is None and not self.draining

    @property
    def live(self) -> bool:
        return self.engine_problem is None

    async def update(self) -> None:
        async with self._lock:
            now = (self.ready, self.live)
            if now == self._shown:
                return
            for name in self._readiness_services:
                await self._servicer.set(name, SERVING if now[0] else NOT_SERVING)
            await self._servicer.set(LIVENESS_SERVICE, SERVING if now[1] else NOT_SERVING)
            log.log(logging.INFO if now[1] else logging.ERROR, "health: readiness %s, liveness %s (%s)",
                    _word(now[0]), _word(now[1]), self._why())
            self._shown = now

    def _why(self) -> str:
        if self.engine_problem:
            return self.engine_problem
        if self.draining:
            return "draining"
        return "ready" if self.preloads_ready else "waiting for required preloads"

    def collector(self) -> Any:
        reporter = self

        class _Collector:
            def collect(self):  # noqa: ANN202 - prometheus_client collector protocol
                g = GaugeMetricFamily("loraplex_health_serving",
                                      "1 while grpc.health.v1 reports SERVING for this probe", labels=["probe"])
                g.add_metric(["readiness"], float(reporter.ready))
                g.add_metric(["liveness"], float(reporter.live))
                yield g
                yield CounterMetricFamily("loraplex_drain_cancelled_requests",
                                          "requests cancelled because the shutdown grace ran out",
                                          value=reporter.drain_cancelled)

        return _Collector()


async def start_health_listener(servicer: health.aio.HealthServicer, address: str) -> grpc.aio.Server:
    """grpc.health.v1 alone, in plaintext, on `address` (HOST:PORT), from the same servicer as the
    serving port. The kubelet's gRPC probe speaks no TLS: with TLS on the serving port, a probe here
    still asks readiness (required preloads in) and liveness (the watchdog), where a TCP connect to
    the serving port passes as soon as it listens. Nothing but health is served on it."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"could not bind --health-listen {address}")
    await server.start()
    log.info("grpc.health.v1 (plaintext, health only) listening on %s", address)
    return server


def _word(serving: bool) -> str:
    return "SERVING" if serving else "NOT_SERVING"


async def watch_engine(engine: EngineClient, reporter: HealthReporter, stall_s: float) -> None:
    """Runs until cancelled: marks the engine dead, or stuck when `stall_s` > 0 (and healthy again
    if a slow step ends). `stall_s` 0 turns off only the stall check, never the liveness one."""
    interval = min(ALIVE_POLL_S, stall_s / 4) if stall_s > 0 else ALIVE_POLL_S
    beat: concurrent.futures.Future[None] | None = None
    sent = 0.0
    while True:
        if not engine.alive:
            reporter.engine_problem = "the scheduler thread has died (or the engine core process has exited)"
        elif stall_s > 0:
            if beat is not None and not beat.done():
                waited = time.monotonic() - sent
                if waited > stall_s:
                    reporter.engine_problem = f"the scheduler has not finished a step for {waited:.0f}s " \
                                              f"(limit {stall_s:g}s, --watchdog-stall-s)"
            else:
                if beat is not None:
                    reporter.engine_problem = None  # the last heartbeat came back: the loop moves
                beat, sent = engine.heartbeat(), time.monotonic()
        await reporter.update()
        await asyncio.sleep(interval)


def install_test_fault(engine: EngineClient) -> None:
    """Arms the test-only faults named by the LORAPLEX_TEST_FAULT_* variables (see above), through
    the engine's test seam (EngineClient.install_fault)."""
    delay = float(os.environ.get(TEST_STEP_DELAY_ENV) or 0)
    if delay > 0:
        log.warning("TEST FAULT ARMED: every scheduler step %.3fs slower", delay)
        engine.install_fault(TestFault("slow_steps", delay))
    kind = os.environ.get(TEST_FAULT_ENV)
    if not kind:
        return
    kind, _, seconds = kind.partition(":")
    if kind not in ("die", "hang") or (seconds and (kind == "die" or not seconds.replace(".", "", 1).isdigit())):
        raise ValueError(f"{TEST_FAULT_ENV}={os.environ[TEST_FAULT_ENV]!r}: expected 'die', 'hang' or 'hang:SECONDS'")
    fault = TestFault("die" if kind == "die" else "hang", float(seconds) if seconds else None)
    log.warning("TEST FAULT ARMED: SIGUSR1 makes the scheduler thread %s", kind)
    signal.signal(signal.SIGUSR1, lambda *_: engine.install_fault(fault))
