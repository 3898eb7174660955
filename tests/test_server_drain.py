"""Shutdown and watchdog health on a plain `loraplex-inference` subprocess (no pod, no root).

tests/test_kubelet_pod.py checks the same behaviour through the rendered pod, but needs root,
helm and Prometheus; these run on any machine, so a regression cannot hide behind its skip:
- SIGTERM with a stream in flight: readiness NOT_SERVING first (liveness stays SERVING), new RPCs
  still served for --drain-delay-s, refused after it, the stream finishes, the process exits 0;
- a stream longer than --shutdown-grace-s is cut when the grace runs out, logged and counted;
- a scheduler step that does not end (the test-only fault hook) turns readiness and liveness
  NOT_SERVING once --watchdog-stall-s passes, and SERVING again once the step is over.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.inference_server import start_inference_server
from harness.waiting import wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _health(address: str, service: str = "", timeout: float = 1.0) -> str:
    """The status name, or the RPC's code name when the check itself fails (UNAVAILABLE: refused)."""
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _new_generate(address: str) -> str:
    """A new Generate on a new channel: "OK" when it streamed its 2 tokens, else its code name."""
    try:
        with InferenceClient(address) as client:
            out = list(client.generate("a new request", max_new_tokens=2, ignore_eos=True, timeout=30))
    except grpc.RpcError as e:
        return e.code().name
    assert out[-1].usage.generated_tokens == 2
    return "OK"


def test_sigterm_drains_a_stream_in_flight(tmp_path: Path) -> None:
    """Every scheduler step slowed by 20 ms (the test-only hook), so a 600-token stream lasts at
    least 12 s: well past the 4 s drain delay, well inside the 60 s grace."""
    drain_delay, grace, tokens = 4.0, 60.0, 600
    server = start_inference_server(["--shutdown-grace-s", str(grace), "--drain-delay-s", str(drain_delay)],
                                    env={"LORAPLEX_TEST_FAULT_STEP_DELAY_S": "0.02"}, log_dir=tmp_path)
    health_log: list[tuple[float, str]] = []
    stop_polling = threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            status = _health(server.address)
            health_log.append((time.monotonic(), status))  # when the answer came
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    try:
        with InferenceClient(server.address) as client:
            stream = client.generate("a long answer", max_new_tokens=tokens, ignore_eos=True, timeout=120)
            first = next(stream)
            sigterm = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            poller.start()
            # Readiness must flip while new calls are still served, that is within the drain delay.
            wait_until(lambda: any(s == "NOT_SERVING" for _, s in health_log), "readiness NOT_SERVING",
                       timeout=drain_delay)
            not_serving = next(t for t, s in health_log if s == "NOT_SERVING")
            # Draining: liveness stays SERVING (no restart) and a new call is still served (it can
            # only be before the refusals below begin: the order is asserted after the stream).
            assert _health(server.address, "liveness") == "SERVING"
            assert _new_generate(server.address) == "OK"
            served = time.monotonic()
            wait_until(lambda: _new_generate(server.address) == "UNAVAILABLE", "new RPCs refused")
            refused = time.monotonic()
            rest = list(stream)
            stream_end = time.monotonic()
        stop_polling.set()
        poller.join()
        assert first.token_ids and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in [first, *rest]) == tokens  # the stream was not cut
        assert refused - sigterm >= drain_delay, "new RPCs were refused before --drain-delay-s"
        assert sigterm < not_serving < served < refused < stream_end, "the stream ended before new RPCs were refused"
        assert all(t > not_serving for t, s in health_log if s == "UNAVAILABLE"), health_log
        assert server.proc.wait(30) == 0
        log = server.log()
        assert "drained in" in log and "cancelled" not in log.split("draining:")[-1], log[-2000:]
    finally:
        stop_polling.set()
        if poller.is_alive():
            poller.join()
        server.stop(timeout=5)


def test_streams_left_at_the_end_of_the_grace_are_cancelled_and_counted(tmp_path: Path) -> None:
    """A stream longer than --shutdown-grace-s is cut when the grace runs out (not before), and
    the cut is logged and counted."""
    server = start_inference_server(["--shutdown-grace-s", "1.5", "--drain-delay-s", "0.5"],
                                    env={"LORAPLEX_TEST_FAULT_STEP_DELAY_S": "0.02"}, log_dir=tmp_path)
    try:
        with InferenceClient(server.address) as client:
            stream = client.generate("a long answer", max_new_tokens=600, ignore_eos=True, timeout=60)
            tokens = len(next(stream).token_ids)
            server.proc.send_signal(signal.SIGTERM)
            sigterm = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                for message in stream:
                    tokens += len(message.token_ids)
            cut = time.monotonic() - sigterm
        # Cut by the drain, not ended by length (600 tokens) nor by the client's deadline
        # (DEADLINE_EXCEEDED), and not before the grace (a slow host only makes `cut` longer).
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), info.value
        assert tokens < 600 and cut >= 1.3, (tokens, cut)
        assert server.proc.wait(30) == 0
        assert "drain: 1 request(s) still running after 1.5s were cancelled" in server.log()
    finally:
        server.stop(timeout=5)


def test_stuck_scheduler_step_turns_health_not_serving(tmp_path: Path) -> None:
    """A step that does not end (the hook wedges the scheduler thread for 6 s) → NOT_SERVING for
    readiness and liveness once --watchdog-stall-s passes, and SERVING again once the step is over."""
    server = start_inference_server(["--watchdog-stall-s", "2"], env={"LORAPLEX_TEST_FAULT_SCHEDULER": "hang:6"},
                                    log_dir=tmp_path)
    try:
        assert _health(server.address, "liveness") == "SERVING"
        server.proc.send_signal(signal.SIGUSR1)
        started = time.monotonic()
        # Seen NOT_SERVING at all means seen within the 6 s step: once it ends the heartbeat comes
        # back and health is SERVING again (asserted below), so the step's length bounds this wait.
        wait_until(lambda: _health(server.address, "liveness") == "NOT_SERVING", "liveness NOT_SERVING")
        # Not before --watchdog-stall-s: the heartbeat in flight may have been sent up to a watchdog
        # interval (0.5 s) before the hang (a slow host only makes this later).
        assert time.monotonic() - started >= 1.0
        assert _health(server.address, "") == "NOT_SERVING"
        assert "has not finished a step" in server.log() and "(limit 2s, --watchdog-stall-s)" in server.log()
        wait_until(lambda: _health(server.address, "") == "SERVING", "recovered after the step")
        assert time.monotonic() - started >= 3.5  # not before the 6 s step ended
        with InferenceClient(server.address) as client:
            out = list(client.generate("still alive", max_new_tokens=2, ignore_eos=True, timeout=30))
            assert out[-1].usage.generated_tokens == 2
    finally:
        server.stop(timeout=5)
