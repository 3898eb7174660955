"""Helpers for the adapter-cache tests and benches: tiny PEFT adapters as bytes and a real sidecar subprocess."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import save

from adapter_cache.client import AdapterCacheClient
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
          "use_dora": False, "modules_to_save": None, "bias": "none"}


def make_adapter(rank: int = 8, hidden: int = 64, layers: int = 1, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of a tiny PEFT LoRA on q_proj and v_proj."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=gen).to(dtype)
    return json.dumps({**CONFIG, "r": rank}).encode(), save(tensors)


def put_adapter(s3, bucket: str, prefix: str, config: bytes, weights: bytes) -> str:
    s3.put_object(Bucket=bucket, Key=f"{prefix}/adapter_config.json", Body=config)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/adapter_model.safetensors", Body=weights)
    return f"s3://{bucket}/{prefix}"


def write_token(path: Path, *tokens: str) -> Path:
    path.write_text("".join(f"{t}\n" for t in tokens))
    path.chmod(0o600)
    return path


class Sidecar:
    """`loraplex-cache` in a subprocess on a unix socket, with its metrics on a loopback port.

    It has an admin token (`admin_token`), which `client` sends, so tests can List and Evict.
    """

    def __init__(self, tmp: Path, allow: list[str], env: dict[str, str] | None = None,
                 capacity: int = 64 << 20, shm_dir: Path | None = None, extra: list[str] | None = None,
                 socket: Path | None = None, wrapper: list[str] | None = None) -> None:
        """`socket`: listen there (e.g. a restart on a predecessor's socket); `wrapper`: a command
        prefix the sidecar runs under (it must exec the rest, so `proc` stays the sidecar)."""
        self.tmp = tmp
        self.admin_token = secrets.token_hex(16)
        admin_file = write_token(tmp / f"admin-token-{time.monotonic_ns()}", self.admin_token)
        # A socket of its own in a short directory: a unix socket's path holds at most 107 bytes, and
        # pytest's temporary paths (a worker's directory, a long test name) can be longer than that.
        self._socket_dir = None if socket else Path(tempfile.mkdtemp(prefix="lpx-sidecar-"))
        self.socket = socket or self._socket_dir / "cache.sock"
        self.target = f"unix://{self.socket}"
        self.shm_dir = shm_dir or tmp / "shm"
        self.metrics_port = free_port()
        self.log = tmp / "sidecar.log"
        args = [*(wrapper or []), sys.executable, "-m", "adapter_cache.cli", "--listen", self.target,
                "--shm-dir", str(self.shm_dir),
                "--capacity-bytes", str(capacity), "--metrics-port", str(self.metrics_port),
                "--metrics-addr", "127.0.0.1", "--fetch-attempts", "2", "--backoff-max-seconds", "0.2",
                "--connect-timeout-seconds", "1", "--read-timeout-seconds", "5",
                "--admin-token-file", str(admin_file), *(extra or [])]
        for prefix in allow:
            args += ["--allow-prefix", prefix]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LORAPLEX_CACHE_"))}
        full_env.update(env or {})
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=fh, stderr=subprocess.STDOUT)
        self.wait_healthy()
        self.client = AdapterCacheClient(self.target, timeout_s=60, token=self.admin_token)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.target)

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.socket.exists():
                try:
                    with self.channel() as ch:
                        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"sidecar not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from the sidecar's /metrics (0 when absent)."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        return 0.0

    def kill(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


class RangeIgnoringOrigin:
    """A real HTTP server on loopback that ignores Range headers, as some origins do: every GET
    gets 200 and the object from byte 0. What it sends for a path is set by the test:

    - `files[path] = data`: the object with its Content-Length;
    - `behaviour[path]`: "close" (files[path] without a Content-Length, ended by closing),
      "endless" (zeros forever, no length), "huge" (a 1 GiB Content-Length, zeros until the
      client hangs up) or "drip" (a 1 MiB Content-Length, then one byte every 50 ms).

    `sent[path]` counts the body bytes the server managed to write (socket buffers included),
    `gets[path]` the GETs.
    """

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.behaviour: dict[str, str] = {}
        self.sent: Counter[str] = Counter()
        self.gets: Counter[str] = Counter()
        self._stop = threading.Event()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802
                origin.gets[self.path] += 1
                mode, body = origin.behaviour.get(self.path), origin.files.get(self.path)
                if mode is None and body is None:
                    self.send_error(404)
                    return
                try:
                    self.send_response(200)
                    if mode in (None, "huge", "drip"):
                        length = {None: len(body or b""), "huge": 1 << 30, "drip": 1 << 20}[mode]
                        self.send_header("Content-Length", str(length))
                    self.end_headers()
                    if mode in (None, "close"):
                        self._write(body or b"")
                    elif mode == "drip":
                        while not origin._stop.is_set():
                            self._write(b"\0")
                            time.sleep(0.05)
                    else:  # endless or huge: as fast as the client reads
                        chunk = bytes(1 << 20)
                        while not origin._stop.is_set() and (mode == "endless" or origin.sent[self.path] < 1 << 30):
                            self._write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client hung up: what a bounded reader does

            def _write(self, data: bytes) -> None:
                self.wfile.write(data)
                self.wfile.flush()
                origin.sent[self.path] += len(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def put_adapter(self, prefix: str, config: bytes, weights: bytes | None = None,
                    weights_behaviour: str | None = None) -> str:
        """An adapter at `<url>/<prefix>`; its weights are `weights` or sent as `weights_behaviour`."""
        self.files[f"/{prefix}/adapter_config.json"] = config
        if weights is not None:
            self.files[f"/{prefix}/adapter_model.safetensors"] = weights
        if weights_behaviour is not None:
            self.behaviour[f"/{prefix}/adapter_model.safetensors"] = weights_behaviour
        return f"{self.url}/{prefix}"

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
