"""The adapter-cache sidecar end to end: a real `loraplex-cache` subprocess, a real gRPC client,
and a real S3 server (Ceph radosgw, harness/ceph.py)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from safetensors.torch import load

from adapter_cache.client import AdapterCacheClient
from adapter_cache.errors import (
    InvalidArgumentError,
    LoraplexError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
)
from harness.ports import free_port
from harness.sidecar import Sidecar, make_adapter, put_adapter

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def sidecar_factory(tmp_path):
    started: list[Sidecar] = []

    def start(**kw) -> Sidecar:
        sc = Sidecar(tmp_path, **kw)
        started.append(sc)
        return sc

    yield start
    for sc in started:
        sc.stop()


def _no_temp_files(shm_dir: Path) -> bool:
    return not [p for p in shm_dir.iterdir() if ".tmp-" in p.name]


def test_stage_end_to_end(ceph_s3, s3_bucket, sidecar_factory):
    config, weights = make_adapter(rank=8, hidden=64, layers=2)
    uri = put_adapter(ceph_s3.client(), s3_bucket, "adapters/acme/v1", config, weights)
    sc = sidecar_factory(allow=[f"s3://{s3_bucket}/adapters"], env=ceph_s3.env())

    staged = sc.client.stage(uri)
    assert not staged.cache_hit
    assert staged.config == json.loads(config) and staged.size_bytes == len(weights)
    assert staged.sha256 == ""  # no digest pinned: none computed
    data = Path(staged.path).read_bytes()
    assert data == weights  # the staged file is the safetensors bytes, verbatim
    # The manifest gives absolute offsets: 8 + header_len + data_offsets[0].
    header_len = struct.unpack("<Q", weights[:8])[0]
    header = json.loads(weights[8 : 8 + header_len])
    originals = load(weights)
    assert {t.name for t in staged.tensors} == set(originals)
    for t in staged.tensors:
        assert t.offset == 8 + header_len + header[t.name]["data_offsets"][0]
        assert t.dtype == "F32" and t.shape == tuple(originals[t.name].shape)
        got = torch.frombuffer(bytearray(data[t.offset : t.offset + t.nbytes]), dtype=torch.float32)
        assert torch.equal(got.view(t.shape), originals[t.name])
    assert sc.client.read(staged.lease_id, chunk_bytes=1000) == weights

    again = sc.client.stage(uri)
    assert again.cache_hit and again.path == staged.path and again.lease_id != staged.lease_id
    [entry] = sc.client.list()
    assert (entry.uri, entry.size_bytes, entry.leases, entry.hits) == (uri, len(weights), 2, 1)
    assert sc.metric("loraplex_cache_hits_total") == 1 and sc.metric("loraplex_cache_misses_total") == 1
    sc.client.release(staged.lease_id)
    sc.client.release(again.lease_id)
    with pytest.raises(NotFoundError):
        sc.client.release(again.lease_id)


def test_pinned_digest_on_a_hit_is_verified_once(ceph_s3, s3_bucket, sidecar_factory):
    """An entry staged without a digest is hashed when a caller first pins one: a wrong digest is
    INVALID_ARGUMENT and gives its lease back, the right one is recorded and reported after."""
    config, weights = make_adapter(rank=8, hidden=64, layers=2)
    uri = put_adapter(ceph_s3.client(), s3_bucket, "pinned/a", config, weights)
    sc = sidecar_factory(allow=[f"s3://{s3_bucket}/pinned"], env=ceph_s3.env())
    sc.client.release(sc.client.stage(uri).lease_id)
    with pytest.raises(InvalidArgumentError, match="sha256"):
        sc.client.stage(uri, sha256="0" * 64)
    (entry,) = sc.client.list()
    assert entry.leases == 0 and entry.sha256 == hashlib.sha256(weights).hexdigest()
    digest = hashlib.sha256(weights).hexdigest()
    staged = sc.client.stage(uri, sha256=digest)
    assert staged.cache_hit and staged.sha256 == digest
    assert sc.client.stage(uri).sha256 == digest  # recorded: later hits report it unasked
    assert sc.metric("loraplex_cache_fetch_requests_total") == 2  # config + one part: no refetch


def test_restart_drops_a_corrupted_entry_and_keeps_the_rest(sidecar_factory, tmp_path):
    """The checksum each entry is committed with is checked at restart: a flipped byte in one
    staged file drops that entry (and only it), which is then fetched again on the next Stage."""
    config, weights = make_adapter(rank=8, hidden=64, layers=2)
    files = tmp_path / "files"
    for name in ("good", "bad"):
        (files / name).mkdir(parents=True)
        (files / name / "adapter_config.json").write_bytes(config)
        (files / name / "adapter_model.safetensors").write_bytes(weights)
    shm = tmp_path / "shm"
    small_parts = ["--part-bytes", str(4 << 10)]  # several parts, so the combined checksum is exercised
    sc = sidecar_factory(allow=[f"file://{files}"], shm_dir=shm, extra=small_parts)
    paths = {}
    for name in ("good", "bad"):
        staged = sc.client.stage(f"file://{files}/{name}")
        sc.client.release(staged.lease_id)
        paths[name] = Path(staged.path)
    sc.stop()
    corrupted = bytearray(paths["bad"].read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    paths["bad"].write_bytes(corrupted)

    sc2 = sidecar_factory(allow=[f"file://{files}"], shm_dir=shm, extra=small_parts)
    assert [e.uri for e in sc2.client.list()] == [f"file://{files}/good"]
    assert not paths["bad"].exists()
    assert sc2.client.stage(f"file://{files}/good").cache_hit
    again = sc2.client.stage(f"file://{files}/bad")
    assert not again.cache_hit and Path(again.path).read_bytes() == weights


def test_single_flight_50_concurrent_stages_fetch_once(ceph_s3, s3_bucket, sidecar_factory):
    config, weights = make_adapter(rank=64, hidden=2048, layers=2)  # ~4 MiB: several ranged parts
    uri = put_adapter(ceph_s3.client(), s3_bucket, "a/cold", config, weights)
    part = 1 << 20
    sc = sidecar_factory(allow=[f"s3://{s3_bucket}/a"], env=ceph_s3.env(), extra=["--part-bytes", str(part)])
    barrier = threading.Barrier(50)
    results, errors = [], []

    def one() -> None:
        with AdapterCacheClient(sc.target) as client:
            barrier.wait()
            try:
                results.append(client.stage(uri))
            except LoraplexError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 50
    expected_gets = 1 + -(-len(weights) // part)  # the config, then the weights in parts
    assert sc.metric("loraplex_cache_fetch_requests_total") == expected_gets
    assert sc.metric("loraplex_cache_misses_total") == 1
    assert sum(not r.cache_hit for r in results) == 1
    assert len({r.path for r in results}) == 1 and len({r.lease_id for r in results}) == 50
    assert Path(results[0].path).read_bytes() == weights
    [entry] = sc.client.list()
    assert entry.leases == 50


def test_budget_leases_and_expiry(ceph_s3, s3_bucket, sidecar_factory):
    s3 = ceph_s3.client()
    uris = {}
    for name in "ABCDE":
        config, weights = make_adapter(rank=16, hidden=256, seed=ord(name))
        uris[name] = put_adapter(s3, s3_bucket, f"p/{name}", config, weights)
    size = len(weights)
    capacity = int(2.5 * size)
    sc = sidecar_factory(allow=[f"s3://{s3_bucket}/p"], env=ceph_s3.env(), capacity=capacity)

    def listed() -> set[str]:
        entries = sc.client.list()
        assert sum(e.size_bytes for e in entries) <= capacity
        assert sc.metric("loraplex_cache_bytes") <= capacity
        return {e.uri for e in entries}

    lease_a = sc.client.stage(uris["A"])  # kept leased throughout
    sc.client.release(sc.client.stage(uris["B"]).lease_id)
    lease_c = sc.client.stage(uris["C"])  # B is the only unleased entry: it goes
    assert listed() == {uris["A"], uris["C"]}
    with pytest.raises(ResourceExhaustedError):
        sc.client.stage(uris["D"])  # A and C leased: nothing may be evicted
    assert listed() == {uris["A"], uris["C"]}
    sc.client.release(lease_c.lease_id)
    sc.client.stage(uris["D"], lease_seconds=1)  # C evicted; D's lease expires soon
    assert listed() == {uris["A"], uris["D"]}
    time.sleep(1.3)
    sc.client.stage(uris["E"])  # D's lease has expired, so D is evictable; A is still leased
    assert listed() == {uris["A"], uris["E"]}
    assert sc.metric("loraplex_cache_evictions_total") == 3
    assert sc.metric("loraplex_cache_errors_total", 'reason="resource_exhausted"') == 1
    assert sc.client.stage(uris["A"]).cache_hit
    sc.client.release(lease_a.lease_id)


def test_faults_map_to_exact_codes_and_cache_nothing(ceph_s3, s3_bucket, sidecar_factory, tmp_path):
    s3 = ceph_s3.client()
    config, weights = make_adapter(rank=8, hidden=64)
    put_adapter(s3, s3_bucket, "ok/only-config", config, weights)
    s3.delete_object(Bucket=s3_bucket, Key="ok/only-config/adapter_model.safetensors")
    truncated = put_adapter(s3, s3_bucket, "ok/truncated", config, weights[: len(weights) - 100])
    good = put_adapter(s3, s3_bucket, "ok/good", config, weights)
    big_config, big_weights = make_adapter(rank=64, hidden=512)
    big = put_adapter(s3, s3_bucket, "ok/big", big_config, big_weights)
    nan_weights = bytearray(weights)
    nan_weights[-4:] = struct.pack("<f", float("nan"))
    nan = put_adapter(s3, s3_bucket, "ok/nan", config, bytes(nan_weights))
    dora = put_adapter(s3, s3_bucket, "ok/dora", json.dumps({**json.loads(config), "use_dora": True}).encode(),
                       weights)
    files = tmp_path / "files"
    (files / "adapters" / "good").mkdir(parents=True)
    (files / "adapters" / "good" / "adapter_config.json").write_bytes(config)
    (files / "adapters" / "good" / "adapter_model.safetensors").write_bytes(weights)
    (files / "secret").mkdir()
    (files / "secret" / "adapter_config.json").write_bytes(config)
    (files / "secret" / "adapter_model.safetensors").write_bytes(weights)
    os.symlink(files / "secret", files / "adapters" / "escape")
    sc = sidecar_factory(
        allow=[f"s3://{s3_bucket}/ok", f"file://{files}/adapters"], env=ceph_s3.env(),
        extra=["--max-adapter-bytes", str(len(big_weights) - 1)],
    )
    cases = [
        (f"s3://{s3_bucket}/ok/missing", "", NotFoundError),
        (f"s3://{s3_bucket}/ok/only-config", "", NotFoundError),
        (truncated, "", InvalidArgumentError),
        (good, "0" * 64, InvalidArgumentError),  # digest mismatch
        (big, "", InvalidArgumentError),  # over --max-adapter-bytes
        (nan, "", InvalidArgumentError),
        (dora, "", InvalidArgumentError),
        (f"s3://{s3_bucket}/elsewhere", "", PermissionDeniedError),
        (f"s3://{s3_bucket}/okay-not-a-sub-prefix", "", PermissionDeniedError),
        (f"s3://{s3_bucket}/ok/../elsewhere", "", PermissionDeniedError),
        (f"file://{files}/adapters/../secret", "", PermissionDeniedError),
        (f"file://{files}/adapters/escape", "", PermissionDeniedError),  # symlink out of the root
        ("http://169.254.169.254/latest/meta-data", "", PermissionDeniedError),
    ]
    for uri, digest, error in cases:
        with pytest.raises(error) as info:
            sc.client.stage(uri, sha256=digest)
        assert type(info.value) is error, (uri, info.value)
        assert sc.client.list() == [], f"{uri} left something in the cache"
        assert _no_temp_files(sc.shm_dir)
    assert not [p for p in sc.shm_dir.iterdir()]
    # The same sidecar still stages good adapters from both stores.
    assert sc.client.stage(f"file://{files}/adapters/good").size_bytes == len(weights)
    assert sc.client.stage(good, sha256=hashlib.sha256(weights).hexdigest()).size_bytes == len(weights)
    assert sc.metric("loraplex_cache_errors_total", 'reason="permission_denied"') == 6


def test_s3_endpoint_down_is_unavailable(sidecar_factory):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    env = {"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
           "AWS_DEFAULT_REGION": "us-east-1"}
    sc = sidecar_factory(allow=["s3://bucket/a"], env=env)
    with pytest.raises(UnavailableError):
        sc.client.stage("s3://bucket/a/adapter")
    assert sc.client.list() == [] and _no_temp_files(sc.shm_dir)
    assert sc.metric("loraplex_cache_fetch_requests_total") == 2  # --fetch-attempts 2: one retry


def test_sigkill_mid_stage_then_restart_serves_warm(ceph_s3, s3_bucket, sidecar_factory, tmp_path):
    s3 = ceph_s3.client()
    small_config, small = make_adapter(rank=8, hidden=64)
    survivor = put_adapter(s3, s3_bucket, "k/survivor", small_config, small)
    big_config, big = make_adapter(rank=64, hidden=4096, layers=8)  # 32 MiB in 256 KiB parts, one at a time
    victim = put_adapter(s3, s3_bucket, "k/victim", big_config, big)
    slow = ["--part-bytes", str(256 << 10), "--fetch-concurrency", "1"]
    shm = tmp_path / "shm"
    sc = sidecar_factory(allow=[f"s3://{s3_bucket}/k"], env=ceph_s3.env(), capacity=64 << 20, shm_dir=shm,
                         extra=slow)
    sc.client.release(sc.client.stage(survivor).lease_id)

    outcome: list[object] = []

    def stage_victim() -> None:
        with AdapterCacheClient(sc.target) as client:
            try:
                outcome.append(client.stage(victim))
            except LoraplexError as exc:
                outcome.append(exc)

    worker = threading.Thread(target=stage_victim)
    worker.start()
    deadline = time.monotonic() + 30
    while not [p for p in shm.iterdir() if ".tmp-" in p.name]:
        assert time.monotonic() < deadline and not outcome, "the stage never showed a temp file"
        time.sleep(0.002)
    sc.kill()  # SIGKILL while the temp file is being filled
    worker.join(timeout=30)
    assert len(outcome) == 1 and isinstance(outcome[0], UnavailableError)
    assert not _no_temp_files(shm)  # the half-written file is still there...

    sc2 = sidecar_factory(allow=[f"s3://{s3_bucket}/k"], env=ceph_s3.env(), capacity=64 << 20, shm_dir=shm,
                          extra=slow)
    assert _no_temp_files(shm)  # ...until the restarted sidecar deletes it
    assert [e.uri for e in sc2.client.list()] == [survivor]
    warm = sc2.client.stage(survivor)
    assert warm.cache_hit and Path(warm.path).read_bytes() == small
    assert sc2.metric("loraplex_cache_fetch_requests_total") == 0
    cold = sc2.client.stage(victim)
    assert not cold.cache_hit and Path(cold.path).read_bytes() == big


def test_health_and_reflection(sidecar_factory):
    sc = sidecar_factory(allow=["s3://x/y"])
    with sc.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "loraplex.v1.AdapterCacheService"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "loraplex.v1.AdapterCacheService" in services and "grpc.health.v1.Health" in services
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_ranged_reads_keep_one_connection(ceph_s3, s3_bucket, monkeypatch):
    """Parts are read from the socket straight into the caller's buffer, bypassing botocore's
    body reader; the connection must still go back to the pool (on a real store each new one
    costs a TCP and TLS handshake per part). Also checks the bytes read."""
    import urllib3

    from adapter_cache.store import S3Config, S3Store

    data = os.urandom(1 << 20)
    ceph_s3.client().put_object(Bucket=s3_bucket, Key="conn/obj", Body=data)
    for key, value in ceph_s3.env().items():
        monkeypatch.setenv(key, value)
    connects = []
    original = urllib3.connection.HTTPConnection.connect
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect",
                        lambda self: connects.append(1) or original(self))
    store = S3Store(S3Config(endpoint_url=ceph_s3.endpoint_url))
    buf = memoryview(bytearray(96 << 10))
    got = bytearray()
    for start in range(0, len(data), len(buf)):
        part = store.read_range(f"s3://{s3_bucket}/conn/obj", start, buf)
        assert part.total_size == len(data)
        got += buf[: part.nbytes]
    assert bytes(got) == data
    assert len(connects) == 1, f"{len(connects)} connections for {-(-len(data) // len(buf))} ranged reads"
