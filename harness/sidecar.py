"""Helpers for the adapter-cache tests and benches: tiny PEFT adapters as bytes and a real sidecar subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
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


class Sidecar:
    """`loraplex-cache` in a subprocess on a unix socket, with its metrics on a loopback port."""

    def __init__(self, tmp: Path, allow: list[str], env: dict[str, str] | None = None,
                 capacity: int = 64 << 20, shm_dir: Path | None = None, extra: list[str] | None = None,
                 socket: Path | None = None, wrapper: list[str] | None = None) -> None:
        """`socket`: listen there (e.g. a restart on a predecessor's socket); `wrapper`: a command
        prefix the sidecar runs under (it must exec the rest, so `proc` stays the sidecar)."""
        self.tmp = tmp
        self.socket = socket or tmp / f"cache-{os.getpid()}-{time.monotonic_ns()}.sock"
        self.target = f"unix://{self.socket}"
        self.shm_dir = shm_dir or tmp / "shm"
        self.metrics_port = free_port()
        self.log = tmp / "sidecar.log"
        args = [*(wrapper or []), sys.executable, "-m", "adapter_cache.cli", "--listen", self.target,
                "--shm-dir", str(self.shm_dir),
                "--capacity-bytes", str(capacity), "--metrics-port", str(self.metrics_port),
                "--metrics-addr", "127.0.0.1", "--fetch-attempts", "2", "--backoff-max-seconds", "0.2",
                "--connect-timeout-seconds", "1", "--read-timeout-seconds", "5", *(extra or [])]
        for prefix in allow:
            args += ["--allow-prefix", prefix]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "LORAPLEX_CACHE_"))}
        full_env.update(env or {})
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=full_env, stdout=fh, stderr=subprocess.STDOUT)
        self.wait_healthy()
        self.client = AdapterCacheClient(self.target, timeout_s=60)

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
