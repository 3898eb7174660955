"""Stage throughput: a 256 MiB+ adapter through the sidecar (parallel ranged GETs, per-part
checksum, validation, shm write) vs boto3's own parallel download of the same object into a file in
the same tmpfs (`download_file` with `TransferConfig(max_concurrency=--concurrency,
multipart_chunksize=--part-bytes)`: as many ranged GETs of the same size at once as the sidecar
makes), same run, same S3 server. For reference also boto3 single-stream (`get_object().read()`
and `download_file` without threads), and one Stage with a pinned sha256 (verified while the parts
arrive). Then a cold Generate's time to first token, broken down
(fetch+stage in the sidecar, slot load, prefill), through a real inference server on
builtin:tiny with `--cache-address` pointing at the same sidecar.

    .venv/bin/python -m bench.stage_throughput                     # starts Ceph via harness/ceph.py
    .venv/bin/python -m bench.stage_throughput --endpoint http://127.0.0.1:7480 --access-key K --secret-key S

Last line: `RESULT stage_vs_boto3_parallel_bytes_per_s=<ratio>` (target >= 1.0: staging, with its
checks, at least as fast as boto3's plain parallel download).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import boto3
import torch
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from safetensors.torch import save

from adapter_cache.cli import parse_bytes
from adapter_cache.client import AdapterCacheClient
from harness.bench import ROOT, print_result
from harness.ceph import start_ceph
from harness.inference_server import start_inference_server
from harness.ports import free_port
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter


def metric_sum(url: str, name: str) -> float:
    """Sum of one sample name over its label sets in a Prometheus text page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


def cold_generate_breakdown(s3, bucket: str, sock: Path, sidecar_metrics: str, tmp: Path, admin_token: str) -> None:
    """TTFT of a Generate whose adapter is in neither a slot nor the sidecar's cache, split into
    fetch+stage (the sidecar's Stage of a miss), slot load (host->slot copy, from the server's
    histogram), prefill (TTFT of the same request on the loaded adapter) and the rest."""
    local = write_peft_adapter(tmp / "tiny-adapter", rank=16, seed=1)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(local / f), bucket, f"a/tiny/{f}")
    server = start_inference_server(
        ["--model", "builtin:tiny", "--max-loras", "2", "--cache-address", f"unix://{sock}",
         "--adapter-source-allow", f"s3://{bucket}/", "--log-level", "WARNING"], log_dir=tmp)
    try:
        with InferenceClient(server.address) as c, AdapterCacheClient(f"unix://{sock}",
                                                                         token=admin_token) as cache:
            uri = f"s3://{bucket}/a/tiny"
            c.load_adapter("tiny", uri)  # registered; not in a slot
            deadline = time.monotonic() + 30
            while any(e.leases for e in cache.list()):  # its Stage lease is released off the scheduler thread
                assert time.monotonic() < deadline, "the server did not release its lease"
                time.sleep(0.01)
            assert uri in cache.evict()  # and not in the sidecar's cache: the next Generate fetches it

            def ttft() -> float:
                *_, last = c.generate("The quick brown fox jumps over the lazy dog", adapter="tiny",
                                      max_new_tokens=1, ignore_eos=True)
                return last.timings.time_to_first_token_seconds

            stage0 = metric_sum(sidecar_metrics, "loraplex_cache_stage_seconds_sum")
            load0 = metric_sum(server.metrics_url, "loraplex_lora_load_seconds_sum")
            misses0 = metric_sum(sidecar_metrics, "loraplex_cache_misses_total")
            cold = ttft()
            assert metric_sum(sidecar_metrics, "loraplex_cache_misses_total") == misses0 + 1
            stage = metric_sum(sidecar_metrics, "loraplex_cache_stage_seconds_sum") - stage0
            load = metric_sum(server.metrics_url, "loraplex_lora_load_seconds_sum") - load0
            prefill = min(ttft() for _ in range(5))  # the same request on the loaded adapter
        other = cold - stage - load - prefill
        size = (local / "adapter_model.safetensors").stat().st_size
        print(f"cold Generate TTFT breakdown ({size} bytes adapter, builtin:tiny): fetch+stage {stage * 1e3:.1f} ms, "
              f"slot load {load * 1e3:.1f} ms, prefill {prefill * 1e3:.1f} ms, rest (Stage RPC, map, validate, "
              f"scheduler steps) {other * 1e3:.1f} ms; cold TTFT {cold * 1e3:.1f} ms", flush=True)
    finally:
        server.stop()


def make_weights(size_mib: int, hidden: int = 4096, rank: int = 64) -> tuple[bytes, bytes]:
    """A PEFT LoRA on q,k,v,o of as many layers as it takes to reach `size_mib` (F32)."""
    per_layer = 4 * 2 * rank * hidden * 4
    layers = -(-size_mib * (1 << 20) // per_layer)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for module in ("q_proj", "k_proj", "v_proj", "o_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=gen) * 0.01
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": False,
              "modules_to_save": None, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    return json.dumps(config).encode(), save(tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", help="existing S3 endpoint (default: start Ceph radosgw)")
    ap.add_argument("--access-key")
    ap.add_argument("--secret-key")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--part-bytes", default="8MiB")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="best of N for each side")
    args = ap.parse_args()

    ceph = None
    if args.endpoint:
        endpoint, access, secret = args.endpoint, args.access_key, args.secret_key
    else:
        print("starting Ceph radosgw ...", flush=True)
        ceph = start_ceph(memstore_bytes=max(3 << 30, 4 * args.size_mib << 20))
        endpoint, access, secret = ceph.endpoint_url, ceph.access_key, ceph.secret_key
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access,
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
    # The shm dir is tmpfs in production (an emptyDir with medium Memory): /dev/shm here too.
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    sidecar = None
    try:
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        s3.create_bucket(Bucket=bucket)
        config, weights = make_weights(args.size_mib)
        size = len(weights)
        s3.put_object(Bucket=bucket, Key="a/big/adapter_config.json", Body=config)
        s3.upload_fileobj(__import__("io").BytesIO(weights), bucket, "a/big/adapter_model.safetensors")
        del weights
        print(f"object: {size} bytes ({size / (1 << 20):.0f} MiB)", flush=True)

        sock = tmp / "cache.sock"
        metrics_port = free_port()
        admin_token = secrets.token_hex(16)  # List and Evict are admin calls
        (tmp / "admin-token").write_text(admin_token)
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "adapter_cache.cli", "--listen", f"unix://{sock}", "--shm-dir", str(tmp / "shm"),
             "--capacity-bytes", str(2 * size), "--max-adapter-bytes", str(2 * size), "--allow-prefix",
             f"s3://{bucket}/a/", "--part-bytes", args.part_bytes, "--fetch-concurrency", str(args.concurrency),
             "--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1", "--log-level", "WARNING",
             "--admin-token-file", str(tmp / "admin-token")],
            cwd=ROOT, env=env,
        )
        client = AdapterCacheClient(f"unix://{sock}", timeout_s=600, token=admin_token)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.list()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

        boto_best = file_best = parallel_best = stage_best = 0.0
        single_stream = TransferConfig(multipart_threshold=2 * size, use_threads=False)
        part_bytes = parse_bytes(args.part_bytes)
        parallel = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes,
                                  max_concurrency=args.concurrency, use_threads=True)
        for r in range(args.rounds):
            # The baseline: boto3's own parallel ranged download, into the same tmpfs.
            target = tmp / "boto3-parallel"
            t0 = time.perf_counter()
            s3.download_file(bucket, "a/big/adapter_model.safetensors", str(target), Config=parallel)
            dt = time.perf_counter() - t0
            assert target.stat().st_size == size
            target.unlink()
            parallel_best = max(parallel_best, size / dt)
            print(f"round {r}: boto3 download_file, {args.concurrency} parallel ranged GETs of {args.part_bytes}, "
                  f"to {tmp}: {size / dt / 1e6:8.1f} MB/s ({dt:.2f} s)", flush=True)

            # For reference: the same single stream written to a file in the same tmpfs (where
            # staging puts it too), so both sides pay for the pages the bytes land in.
            target = tmp / "boto3-download"
            t0 = time.perf_counter()
            s3.download_file(bucket, "a/big/adapter_model.safetensors", str(target), Config=single_stream)
            dt = time.perf_counter() - t0
            assert target.stat().st_size == size
            target.unlink()
            file_best = max(file_best, size / dt)
            print(f"round {r}: boto3 single-stream download_file to {tmp}: {size / dt / 1e6:8.1f} MB/s ({dt:.2f} s)",
                  flush=True)

            t0 = time.perf_counter()
            body = s3.get_object(Bucket=bucket, Key="a/big/adapter_model.safetensors")["Body"].read()
            dt = time.perf_counter() - t0
            assert len(body) == size
            del body
            boto_best = max(boto_best, size / dt)
            print(f"round {r}: boto3 single-stream get_object().read(): {size / dt / 1e6:8.1f} MB/s ({dt:.2f} s)",
                  flush=True)

            t0 = time.perf_counter()
            staged = client.stage(f"s3://{bucket}/a/big")
            dt = time.perf_counter() - t0
            assert not staged.cache_hit and staged.size_bytes == size
            stage_best = max(stage_best, size / dt)
            print(f"round {r}: sidecar Stage (ranged x{args.concurrency}, checksum, validate, shm): "
                  f"{size / dt / 1e6:8.1f} MB/s ({dt:.2f} s)", flush=True)
            client.release(staged.lease_id)
            client.evict()
        digest = hashlib.sha256(s3.get_object(Bucket=bucket, Key="a/big/adapter_model.safetensors")["Body"].read())
        t0 = time.perf_counter()
        staged = client.stage(f"s3://{bucket}/a/big", sha256=digest.hexdigest())
        dt = time.perf_counter() - t0
        assert not staged.cache_hit and staged.sha256 == digest.hexdigest()
        print(f"sidecar Stage with a pinned sha256: {size / dt / 1e6:8.1f} MB/s ({dt:.2f} s)", flush=True)
        client.release(staged.lease_id)
        client.evict()
        cold_generate_breakdown(s3, bucket, sock, f"http://127.0.0.1:{metrics_port}/metrics", tmp, admin_token)
        print(f"stage_bytes_per_s={stage_best:.0f} boto3_parallel_bytes_per_s={parallel_best:.0f} "
              f"boto3_single_stream_bytes_per_s={boto_best:.0f} boto3_file_download_bytes_per_s={file_best:.0f}")
        print(f"stage vs boto3 single-stream (for reference): get_object().read() {stage_best / boto_best:.3f}, "
              f"download to a tmpfs file {stage_best / file_best:.3f}")
        print_result("stage_vs_boto3_parallel_bytes_per_s", stage_best / parallel_best)
    finally:
        if sidecar is not None:
            sidecar.terminate()
            sidecar.wait(timeout=30)
        if ceph is not None:
            ceph.stop()
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


if __name__ == "__main__":
    main()
