"""The real server in a subprocess, real gRPC clients, compared with the in-process Engine."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import grpc
import pytest

from harness.devices import SERVER_DEVICE
from harness.inference_server import start_inference_server
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = pytest.mark.slow
TOKEN = "integration-admin-token"
ADAPTERS = {f"ad{i}": dict(rank=(4, 8, 16)[i % 3], seed=100 + i) for i in range(5)}
CASES = [  # (adapter, prompt, temperature, seed, max_new_tokens)
    (None, "Hello there", 0.0, None, 12),
    ("ad0", "Hello there", 0.0, None, 12),
    ("ad1", "The quick brown fox", 0.0, None, 16),
    ("ad2", "The quick brown fox", 0.8, 7, 16),
    ("ad3", "Once upon a time", 1.0, 11, 10),
    ("ad4", "Once upon a time", 0.0, None, 20),
    ("ad0", "Once upon a time", 0.7, 3, 14),
    (None, "The quick brown fox", 0.9, 5, 9),
]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for name, kw in ADAPTERS.items():
        write_peft_adapter(root / name, **kw)
    return root


@pytest.fixture(scope="module")
def server(adapter_dir, tmp_path_factory):
    s = start_inference_server(
        ["--model", "builtin:tiny", "--max-loras", "4", "--adapter-source-allow", adapter_dir.as_uri()],
        env={"LORAPLEX_ADMIN_TOKEN": TOKEN},
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    with InferenceClient(s.address, token=TOKEN) as c:
        for name in ADAPTERS:
            c.load_adapter(name, (adapter_dir / name).as_uri())
    yield s
    s.stop()


def _inprocess_outputs(adapter_dir) -> list[tuple[list[int], str, str]]:
    from inference_service.engine.config import EngineConfig
    from inference_service.engine.in_process import Engine
    from inference_service.engine.request import SamplingParams

    engine = Engine(EngineConfig(model="builtin:tiny", device=SERVER_DEVICE, max_loras=4))  # as the server
    engine.start()
    try:
        for name in ADAPTERS:
            engine.load_adapter(name, (adapter_dir / name).as_uri()).result(60)
        results = []
        for adapter, prompt, temp, seed, n in CASES:
            params = SamplingParams(temperature=temp, seed=seed, max_new_tokens=n)
            stream = engine.add_request(engine.tokenizer.encode(prompt), params, adapter=adapter)
            ids, text, reason = [], "", None
            for out in stream:
                ids += out.new_token_ids
                text += out.text
                if out.finished:
                    reason = out.finish_reason.value
            results.append((ids, text, reason))
        return results
    finally:
        engine.shutdown()


def _grpc_output(address, case) -> tuple[list[int], str, str]:
    adapter, prompt, temp, seed, n = case
    with InferenceClient(address) as c:
        ids, text, last = [], "", None
        for d in c.generate(prompt, adapter=adapter, temperature=temp, seed=seed, max_new_tokens=n, timeout=60):
            ids += d.token_ids
            text += d.text
            last = d
    reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    return ids, text, reason


def test_streaming_generate_equals_inprocess_engine(server, adapter_dir):
    expected = _inprocess_outputs(adapter_dir)
    # All cases at once, several times over: adapters share batches on the server.
    with concurrent.futures.ThreadPoolExecutor(len(CASES) * 2) as pool:
        futures = [pool.submit(_grpc_output, server.address, case) for case in CASES * 2]
        got = [f.result() for f in futures]
    for i, (case, want) in enumerate(zip(CASES * 2, expected * 2, strict=True)):
        assert got[i] == want, f"case {case}: grpc {got[i]} != in-process {want}"
    # adapters matter: the same prompt differs between base and adapter
    assert expected[0][0] != expected[1][0]


def test_usage_timings_and_list(server):
    with InferenceClient(server.address, token=TOKEN) as c:  # an admin: ListAdapters shows URIs
        msgs = list(c.generate("Hi", adapter="ad1", max_new_tokens=5, ignore_eos=True))
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.generated_tokens == 5 == sum(len(m.token_ids) for m in msgs)
        assert last.usage.prompt_tokens >= 2
        t = last.timings
        assert 0 <= t.queue_seconds <= t.total_seconds and 0 < t.time_to_first_token_seconds <= t.total_seconds
        adapters = {a.name: a for a in c.list_adapters()}
        assert set(adapters) == set(ADAPTERS)
        assert adapters["ad2"].rank == 16 and adapters["ad2"].uri.startswith("file://")
        assert all(a.active_requests == 0 for a in adapters.values())
        info = c.model_info()
        assert info.max_loras == 4 and info.vocab_size > 0 and info.max_context > 0


def test_stop_strings_and_request_id(server):
    with InferenceClient(server.address) as c:
        full = c.generate_text("Once upon a time", adapter="ad4", max_new_tokens=20, ignore_eos=True)
        assert len(full) >= 4
        stop = full[2:4]
        msgs = list(c.generate("Once upon a time", adapter="ad4", max_new_tokens=20, ignore_eos=True,
                               stop=[stop], request_id="my-id-1"))
        assert all(m.request_id == "my-id-1" for m in msgs)
        assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
        text = "".join(m.text for m in msgs)
        assert stop not in text and full.startswith(text)


def test_version_swap_and_unload(server, adapter_dir, tmp_path):
    new = write_peft_adapter(adapter_dir / "ad0-v2", rank=8, seed=999)
    with InferenceClient(server.address, token=TOKEN) as c:
        before = c.generate_text("Hello there", adapter="ad0", max_new_tokens=8)
        a = c.load_adapter("swap", (adapter_dir / "ad0").as_uri())
        assert c.generate_text("Hello there", adapter="swap", max_new_tokens=8) == before
        a2 = c.load_adapter("swap", new.as_uri())
        assert a2.version > a.version and a2.uri == new.as_uri()
        after = c.generate_text("Hello there", adapter="swap", max_new_tokens=8)
        assert after != before
        c.unload_adapter("swap")
        with pytest.raises(grpc.RpcError) as e:
            c.generate_text("Hello there", adapter="swap", max_new_tokens=8)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "swap" not in {x.name for x in c.list_adapters()}


def test_client_cli_against_server(server, adapter_dir):
    env_args = ["--address", server.address]
    r = subprocess.run([sys.executable, "-m", "inference_service.client_cli", *env_args, "generate", "--adapter",
                        "ad1", "--stream", "--max-new-tokens", "6", "Hello"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "finish=" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "inference_service.client_cli", *env_args, "list"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ad3" in r.stdout
    r = subprocess.run([sys.executable, "-m", "inference_service.client_cli", *env_args, "load", "x",
                        (adapter_dir / "ad1").as_uri()], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    r = subprocess.run([sys.executable, "-m", "inference_service.client_cli", *env_args, "--token", TOKEN,
                        "load", "x", (adapter_dir / "ad1").as_uri(), "--preload"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "LOADED" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "inference_service.client_cli", *env_args, "--token", TOKEN,
                        "unload", "x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_request_outcome_logged(server):
    with InferenceClient(server.address) as c:
        c.generate_text("log me", adapter="ad2", max_new_tokens=3, request_id="logged-req-1", ignore_eos=True)

    for _ in range(50):
        if "loraplex.server: request logged-req-1" in server.log():
            break
        time.sleep(0.1)
    line = next(ln for ln in server.log().splitlines() if "loraplex.server: request logged-req-1" in ln)
    assert "adapter=ad2" in line and "finish=length" in line and "code=OK" in line and "tokens=3" in line
    assert line.endswith(" tenant=anonymous"), line  # no credential: the anonymous tenant
