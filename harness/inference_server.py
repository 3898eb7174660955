"""The real inference server (`loraplex-inference`) in a subprocess, for integration tests and benches.

It listens on a free loopback port with /metrics on another; `start_inference_server` returns
once grpc.health.v1 reports SERVING.

Pytest fixture (registered in tests/conftest.py):
- `inference_server_factory` (function): `start(*args, env=None)` → `InferenceServer`; every
  server started through it is stopped at the end of the test.

Standalone: `python -m harness.inference_server [server args]` starts one and prints its address.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from harness.devices import SERVER_DEVICE
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class InferenceServer:
    address: str  # host:port for grpc clients
    metrics_url: str
    proc: subprocess.Popen
    log_path: Path
    http_url: str = ""  # http://127.0.0.1:<port> when started with http=True (the OpenAI API)

    def channel(self, **kwargs) -> grpc.Channel:
        return grpc.insecure_channel(self.address, **kwargs)

    def openai(self, timeout: float = 120.0):  # -> openai.OpenAI (imported here: not every test needs it)
        """The official SDK pointed at the HTTP front end, without retries (a test sees every answer)."""
        import openai

        return openai.OpenAI(base_url=self.http_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def load_http_adapter(self, name: str, path: str | Path) -> None:
        """vLLM's /v1/load_lora_adapter, which must succeed."""
        import httpx2 as httpx

        r = httpx.post(self.http_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                       timeout=60)
        assert r.status_code == 200, r.text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def scrape(self) -> str:
        return urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()

    def samples(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """{(sample name, sorted label pairs): value} from /metrics."""
        out = {}
        for family in text_string_to_metric_families(self.scrape()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0 when absent), or the sum over label sets when labels are omitted."""
        samples = self.samples()
        key = tuple(sorted(labels.items()))
        if labels:
            return samples.get((name, key), 0.0)
        return sum(v for (n, _), v in samples.items() if n == name)

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def wait_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = 90.0,
                 credentials: grpc.ChannelCredentials | None = None, **channel_kw) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"inference server exited with {proc.returncode} before serving")
        channel = (grpc.secure_channel(address, credentials, **channel_kw) if credentials
                   else grpc.insecure_channel(address, **channel_kw))
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError as e:
            last = e
        finally:
            channel.close()
        time.sleep(0.2)
    raise TimeoutError(f"inference server at {address} not SERVING after {timeout}s: {last}")


# Every server this process started: killed, with its process group, when the test process exits. A
# fixture whose set-up fails after the server is up (an adapter load, an import) never reaches its
# stop(), and a server in a session of its own outlives pytest (seen: three idle servers left behind).
_STARTED: list[subprocess.Popen] = []


@atexit.register
def _kill_left_over_servers() -> None:
    for proc in _STARTED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def start_inference_server(
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
    timeout: float = 90.0,
    listen: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    channel_kw: dict | None = None,
    http: bool = False,
) -> InferenceServer:
    """Starts `python -m inference_service.cli --model builtin:tiny --listen 127.0.0.1:<free> --metrics-port
    <free> --http-port <free with http, else 0> *args` (the HTTP API is up once gRPC reports SERVING)."""
    port, metrics_port = free_port(), free_port()
    http_port = free_port() if http else 0
    listen = listen or f"127.0.0.1:{port}"
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="loraplex-inference-"))
    log_path = log_dir / f"inference-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # The CLI's --dtype auto picks bf16 on CPUs with native bf16; tests compare against fp32
    # references unless they pass --dtype themselves (a flag wins over this env mirror).
    full_env.setdefault("LORAPLEX_DTYPE", "float32")
    # Tests stop servers with streams possibly open: keep their drain short (the CLI default is 30 s).
    full_env.setdefault("LORAPLEX_SHUTDOWN_GRACE_S", "5")
    full_env.setdefault("LORAPLEX_DEVICE", SERVER_DEVICE)  # never "auto": a test states its device
    # --model and --http-port stated (the CLI requires a model and serves HTTP on 8000 by default), and
    # 64 new tokens for requests that name no limit (the server's default runs to the end of the
    # context: with builtin:tiny's rare EOS, ~1000 tokens a request); a test's own flags in `args` come
    # later and win (--default-max-new-tokens 0: the server's default).
    cmd = [sys.executable, "-m", "inference_service.cli", "--model", "builtin:tiny", "--listen", listen,
           "--metrics-port", str(metrics_port), "--http-port", str(http_port), "--default-max-new-tokens", "64",
           *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = InferenceServer(listen, f"http://127.0.0.1:{metrics_port}/metrics", proc, log_path,
                             f"http://127.0.0.1:{http_port}" if http else "")
    _STARTED.append(proc)
    try:
        wait_serving(listen, proc, timeout, credentials, **(channel_kw or {}))
    except Exception as e:
        server.stop()
        raise RuntimeError(f"{e}\n--- server log ---\n{server.log()[-4000:]}") from None
    return server


@pytest.fixture
def inference_server_factory(tmp_path) -> Iterator:
    started: list[InferenceServer] = []

    def start(*args: str, env: dict[str, str] | None = None, **kw) -> InferenceServer:
        server = start_inference_server(args, env=env, log_dir=tmp_path, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


if __name__ == "__main__":
    s = start_inference_server(sys.argv[1:])
    print(f"address {s.address}  metrics {s.metrics_url}  log {s.log_path}", flush=True)
    try:
        s.proc.wait()
    except KeyboardInterrupt:
        s.stop()
