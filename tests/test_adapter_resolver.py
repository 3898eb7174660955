"""--adapter-resolver: a request naming an unregistered adapter loads it on first use from the URI
template, through the allow-list. Real server subprocess, real adapter files (file:// URIs), both
front ends (gRPC Generate and the OpenAI HTTP API); and an s3:// template on a real S3 (Ceph RGW)
through the adapter-cache sidecar."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from harness.inference_server import InferenceServer, start_inference_server
from inference_service.cli import build_parser, configs_from_args
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter
from inference_service.frontend.adapter_resolver import check_template

ALLOWED = ("ok-1", "ok-2", "ok-3", "missing")  # each allowed by its own prefix; "missing" has no files
LOADS = "loraplex_lora_loads_total"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resolver")
    for i, name in enumerate(("ok-1", "ok-2", "ok-3", "outside")):
        write_peft_adapter(root / "adapters" / name, rank=4, seed=70 + i)
    return root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[InferenceServer]:
    base = (root / "adapters").as_uri()
    allow = [arg for name in ALLOWED for arg in ("--adapter-source-allow", f"{base}/{name}")]
    s = start_inference_server(["--model", "builtin:tiny", "--max-loras", "2", *allow,
                                "--adapter-resolver", base + "/{name}"], log_dir=root, http=True)
    yield s
    s.stop()


def generate(server: InferenceServer, adapter: str) -> str:
    with InferenceClient(server.address) as client:
        return client.generate_text("Hello there", adapter=adapter, max_new_tokens=4, timeout=60)


def adapters(server: InferenceServer) -> dict[str, int]:
    with InferenceClient(server.address) as client:
        return {a.name: a.version for a in client.list_adapters(timeout=30)}


def grpc_code(server: InferenceServer, adapter: str) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        generate(server, adapter)
    return info.value.code()


def http_completion(server: InferenceServer, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(server.http_url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_first_request_loads_and_completes(server: InferenceServer) -> None:
    assert "ok-1" not in adapters(server)
    loads = server.value(LOADS)
    assert generate(server, "ok-1")
    assert adapters(server)["ok-1"] == 1
    assert server.value(LOADS) == loads + 1
    assert generate(server, "ok-1")  # registered now: no second load
    assert server.value(LOADS) == loads + 1


def test_first_http_request_loads_and_completes(server: InferenceServer) -> None:
    status, body = http_completion(server, "ok-2")
    assert status == 200, body
    assert body["model"] == "ok-2" and body["usage"]["completion_tokens"] == 4
    assert adapters(server)["ok-2"] == 1


def test_outside_allow_list_is_permission_denied(server: InferenceServer) -> None:
    assert grpc_code(server, "outside") == grpc.StatusCode.PERMISSION_DENIED
    status, body = http_completion(server, "outside")
    assert status == 403, body
    assert "outside" not in adapters(server)
    assert generate(server, "ok-1")  # healthy after


def test_nonexistent_is_not_found_and_leaves_nothing(server: InferenceServer) -> None:
    assert grpc_code(server, "missing") == grpc.StatusCode.NOT_FOUND
    assert grpc_code(server, "missing") == grpc.StatusCode.NOT_FOUND  # retried, not a stuck FAILED entry
    status, body = http_completion(server, "missing")
    assert status == 404, body
    assert "missing" not in adapters(server)
    assert generate(server, "ok-1")


def test_bad_name_is_invalid_argument(server: InferenceServer) -> None:
    assert grpc_code(server, "../ok-1") == grpc.StatusCode.INVALID_ARGUMENT


def test_concurrent_first_requests_cause_one_load(server: InferenceServer) -> None:
    loads = server.value(LOADS)
    log_before = server.log().count("resolving adapter ok-3 ")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: generate(server, "ok-3"), range(8)))
    assert all(texts)
    assert adapters(server)["ok-3"] == 1
    assert server.value(LOADS) == loads + 1
    assert server.log().count("resolving adapter ok-3 ") == log_before + 1


def test_off_by_default_and_template_checked() -> None:
    def parse(args: list[str]) -> argparse.Namespace:
        return build_parser().parse_args(["--model", "builtin:tiny", *args])

    assert configs_from_args(parse([]))[1].adapter_resolver == ""
    with pytest.raises(ValueError, match="needs --adapter-source-allow"):
        configs_from_args(parse(["--adapter-resolver", "s3://b/adapters/{name}"]))
    for bad in ("s3://b/adapters/", "s3://b/{name}/{name}", "ftp://b/{name}", "s3://b/{name}/{other}"):
        with pytest.raises(ValueError, match="--adapter-resolver"):
            check_template(bad)
    assert isinstance(parse(["--adapter-resolver", "s3://b/{name}"]), argparse.Namespace)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_s3_template_through_the_sidecar(ceph_s3, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The documented shape: 's3://bucket/adapters/{name}' on a real S3 (Ceph RGW), fetched by the
    adapter-cache sidecar; a name with no objects is NOT_FOUND and leaves nothing registered."""
    from harness.sidecar import Sidecar

    root = Path(tmp_path_factory.mktemp("rs3"))  # short: unix socket paths are limited
    bucket = ceph_s3.create_bucket("resolver")
    write_peft_adapter(root / "src" / "sql", rank=4, seed=90)
    s3 = ceph_s3.client()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(root / "src" / "sql" / f), bucket, f"adapters/sql/{f}")
    sidecar = Sidecar(root, allow=[f"s3://{bucket}/"], env=ceph_s3.env(), socket=root / "c.sock")
    server = start_inference_server(
        ["--model", "builtin:tiny", "--max-loras", "2", "--cache-address", sidecar.target,
         "--adapter-source-allow", f"s3://{bucket}/adapters/",
         "--adapter-resolver", f"s3://{bucket}/adapters/{{name}}"], log_dir=root)
    try:
        assert generate(server, "sql")
        assert adapters(server) == {"sql": 1}
        assert grpc_code(server, "nope") == grpc.StatusCode.NOT_FOUND
        assert adapters(server) == {"sql": 1}
        assert generate(server, "sql")
    finally:
        server.stop()
        sidecar.stop()
