"""The inference server staging adapters through the adapter-cache sidecar.

Real Ceph radosgw (harness/ceph.py), a real `loraplex-cache` subprocess on a unix socket, a
real `loraplex-inference` subprocess with `--cache-address` and `--max-loras 2` (three adapters,
so adapters go cold and are staged again), real gRPC clients. Outputs are compared with the
in-process Engine reading the same adapters from file://.

The tests share one server and run in file order; each leaves the stack serving with a healthy
sidecar on the same socket.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from harness.devices import SERVER_DEVICE
from harness.inference_server import InferenceServer, start_inference_server
from harness.ports import free_port
from harness.sidecar import Sidecar
from harness.tools import skip_or_fail
from inference_service.api import inference_pb2 as pb
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ADAPTERS = {"c0": dict(rank=4, seed=700), "c1": dict(rank=8, seed=701), "c2": dict(rank=16, seed=702),
            "c3": dict(rank=8, seed=703), "c4": dict(rank=4, seed=704)}
RESIDENT = ("c0", "c1", "c2")  # loaded by the fixture; c3 and c4 are new URIs for the fault tests
PROMPTS = ("Hello there", "Once upon a time")
MAX_NEW = 10
SLOT_GAUGES = ("loraplex_lora_slots_total", "loraplex_lora_slots_occupied", "loraplex_lora_slots_referenced",
               "loraplex_lora_slots_pinned", "loraplex_lora_pending_load_events")


class Stack:
    """The sidecar (replaceable on the same socket) and the inference server pointed at it."""

    def __init__(self, root: Path, bucket: str, ceph_env: dict[str, str]) -> None:
        self.root, self.bucket, self.ceph_env = root, bucket, ceph_env
        self.socket = root / "cache.sock"
        self.loaded: dict[str, pb.Adapter] = {}
        self.sidecar = self.start_sidecar()
        self.server: InferenceServer = start_inference_server(
            ["--model", "builtin:tiny", "--max-loras", "2", "--cache-address", f"unix://{self.socket}",
             "--adapter-source-allow", f"s3://{bucket}/"],
            log_dir=root,
        )

    def start_sidecar(self, env: dict[str, str] | None = None, shm_dir: Path | None = None,
                      wrapper: list[str] | None = None) -> Sidecar:
        return Sidecar(self.root, allow=[f"s3://{self.bucket}/"], env=env or self.ceph_env,
                       shm_dir=shm_dir or self.root / "shm", socket=self.socket, wrapper=wrapper)

    def replace_sidecar(self, **kw) -> Sidecar:
        self.sidecar.kill()
        self.sidecar = self.start_sidecar(**kw)
        return self.sidecar

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/adapters/{name}"

    def client(self) -> InferenceClient:
        return InferenceClient(self.server.address)

    def generate(self, adapter: str | None, prompt: str) -> list[int]:
        with self.client() as c:
            return [t for d in c.generate(prompt, adapter=adapter, max_new_tokens=MAX_NEW, timeout=60)
                    for t in d.token_ids]

    def states(self) -> dict[str, str]:
        with self.client() as c:
            return {a.name: pb.AdapterState.Name(a.state) for a in c.list_adapters()}

    def make_cold(self, name: str) -> None:
        """Generate on the two other resident adapters, one after the other: `name` loses its slot."""
        for other in (n for n in RESIDENT if n != name):
            self.generate(other, PROMPTS[0])
        assert self.states()[name] != "ADAPTER_STATE_LOADED", self.states()

    def wait_no_leases(self, timeout: float = 10) -> None:
        """Leases are released off the scheduler thread once the slot copy is done."""
        deadline = time.monotonic() + timeout
        while (held := {e.uri: e.leases for e in self.sidecar.client.list() if e.leases}):
            assert time.monotonic() < deadline, f"leases still held: {held}"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()


@pytest.fixture(scope="module")
def local_adapters(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache-int-adapters")
    for name, kw in ADAPTERS.items():
        write_peft_adapter(root / name, **kw)
    return root


@pytest.fixture(scope="module")
def expected(local_adapters) -> dict[tuple[str | None, str], list[int]]:
    """Greedy token ids of every (adapter, prompt) from the in-process Engine, adapters from file://."""
    from inference_service.engine.config import EngineConfig
    from inference_service.engine.in_process import Engine
    from inference_service.engine.request import SamplingParams

    engine = Engine(EngineConfig(model="builtin:tiny", device=SERVER_DEVICE, max_loras=4))  # as the server
    engine.start()
    try:
        for name in ADAPTERS:
            engine.load_adapter(name, (local_adapters / name).as_uri()).result(60)
        out = {}
        for adapter in (None, *ADAPTERS):
            for prompt in PROMPTS:
                stream = engine.add_request(engine.tokenizer.encode(prompt),
                                            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW), adapter=adapter)
                out[adapter, prompt] = [t for o in stream for t in o.new_token_ids]
        return out
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def stack(ceph_s3, local_adapters, tmp_path_factory):
    bucket = ceph_s3.create_bucket("cache-int")
    s3 = ceph_s3.client()
    for name in ADAPTERS:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            s3.upload_file(str(local_adapters / name / f), bucket, f"adapters/{name}/{f}")
    # A short root: unix socket paths are limited to 107 bytes.
    s = Stack(Path(tmp_path_factory.mktemp("ci")), bucket, ceph_s3.env())
    with s.client() as c:
        for name in RESIDENT:
            s.loaded[name] = c.load_adapter(name, s.uri(name), timeout=60)
    yield s
    s.stop()


def _assert_unavailable(call) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()


def _eventually(call, timeout: float = 30.0):
    """Retries `call` while it fails with UNAVAILABLE (the documented retryable code)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_s3_adapters_through_sidecar_equal_file_adapters(stack, expected):
    for name in RESIDENT:
        assert stack.loaded[name].uri == stack.uri(name)
    cases = [(a, p) for a in (None, *RESIDENT) for p in PROMPTS] * 2
    # All at once: three adapters over two slots, so some wait for a slot and some go cold again.
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(lambda case: stack.generate(*case), cases))
    for case, ids in zip(cases, got, strict=True):
        assert ids == expected[case], f"{case}: via sidecar {ids} != file:// {expected[case]}"
    assert expected[None, PROMPTS[0]] != expected["c0", PROMPTS[0]]  # the adapters change the output

    with stack.client() as c:
        listed = {a.name: a for a in c.list_adapters()}
    assert set(listed) == set(RESIDENT)
    assert {n: (a.uri, a.rank) for n, a in listed.items()} == {
        n: (stack.uri(n), ADAPTERS[n]["rank"]) for n in RESIDENT}
    stack.wait_no_leases()  # every lease released once its slot copy finished
    cached = {e.uri for e in stack.sidecar.client.list()}
    assert cached == {stack.uri(n) for n in RESIDENT}
    assert stack.server.value("loraplex_lora_slots_total") == 2


def test_cold_adapter_is_staged_again(stack, expected):
    stack.make_cold("c2")
    hits = stack.sidecar.metric("loraplex_cache_hits_total")
    assert stack.generate("c2", PROMPTS[1]) == expected["c2", PROMPTS[1]]
    assert stack.sidecar.metric("loraplex_cache_hits_total") > hits  # staged again, from the host cache
    assert stack.states()["c2"] == "ADAPTER_STATE_LOADED"
    stack.wait_no_leases()


def test_sidecar_down_then_back(stack, expected):
    stack.make_cold("c2")  # c0 and c1 resident, c2 cold
    stack.wait_no_leases()
    before = stack.states()
    stack.sidecar.kill()

    assert stack.generate("c1", PROMPTS[0]) == expected["c1", PROMPTS[0]]  # resident: keeps serving
    _assert_unavailable(lambda: stack.generate("c2", PROMPTS[0]))  # cold: needs Stage
    with stack.client() as c:
        _assert_unavailable(lambda: c.load_adapter("c3", stack.uri("c3"), timeout=30))
    assert stack.states() == before  # nothing half-loaded, the cold adapter still registered

    stack.sidecar = stack.start_sidecar()  # same socket: the server reconnects by itself
    assert _eventually(lambda: stack.generate("c2", PROMPTS[0])) == expected["c2", PROMPTS[0]]
    with stack.client() as c:
        assert _eventually(lambda: c.load_adapter("c3", stack.uri("c3"), timeout=30)).name == "c3"
    assert stack.generate("c3", PROMPTS[1]) == expected["c3", PROMPTS[1]]
    with stack.client() as c:
        c.unload_adapter("c3", timeout=30)
    stack.wait_no_leases()


def test_object_store_down(stack, expected, tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    stack.replace_sidecar(env={**stack.ceph_env, "AWS_ENDPOINT_URL": closed}, shm_dir=tmp_path / "shm")
    before_states = stack.states()
    before_gauges = {g: stack.server.value(g) for g in SLOT_GAUGES}
    with stack.client() as c:
        # UNAVAILABLE is the server's own answer: a load left to hang would end DEADLINE_EXCEEDED.
        _assert_unavailable(lambda: c.load_adapter("c4", stack.uri("c4"), preload=True, timeout=60))
    assert stack.states() == before_states
    assert {g: stack.server.value(g) for g in SLOT_GAUGES} == before_gauges
    assert stack.sidecar.client.list() == []  # the sidecar kept nothing either
    resident = next(n for n, state in before_states.items() if state == "ADAPTER_STATE_LOADED")
    assert stack.generate(resident, PROMPTS[0]) == expected[resident, PROMPTS[0]]  # resident ones serve on

    stack.replace_sidecar()  # the store is back
    with stack.client() as c:
        assert c.load_adapter("c4", stack.uri("c4"), timeout=60).name == "c4"
        c.unload_adapter("c4", timeout=30)


def test_read_fallback_when_staged_file_is_not_visible(stack, expected, tmp_path):
    """The sidecar in its own mount namespace with a private tmpfs over its shm dir: the server
    (like a container without the shared emptyDir) cannot see the staged path and must stream the
    bytes over Read instead. Under CI a machine without mount namespaces fails it: the fallback is
    the only path a pod without the shared emptyDir has."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode:
        skip_or_fail(f"no unprivileged mount namespaces here: {probe.stderr.decode().strip()}")
    shm = tmp_path / "private-shm"
    shm.mkdir()
    hide = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
            'mount -t tmpfs -o size=64m loraplex-private "$0" && exec "$@"', str(shm)]
    stack.replace_sidecar(shm_dir=shm, wrapper=hide)
    stack.make_cold("c2")
    assert stack.generate("c2", PROMPTS[1]) == expected["c2", PROMPTS[1]]
    [entry] = [e for e in stack.sidecar.client.list() if e.uri == stack.uri("c2")]
    assert entry.path.startswith(str(shm)) and not os.path.exists(entry.path)  # invisible from here
    assert list(shm.iterdir()) == []
    stack.wait_no_leases()
    stack.replace_sidecar()
