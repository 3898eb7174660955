"""A request on an adapter that ends before its adapter reaches a slot leaves zero adapter
references (DESIGN.md: "after all requests end ... zero adapter references"), as
loraplex_lora_adapter_references shows.

The slot gauges (loraplex_lora_slots_referenced, pending load events) see a reference only on an
adapter in a slot: a reference held on an adapter still STAGING is invisible to them, so a leaked one
would be too. Each case ends such a request (cancelled, past its deadline, or its staging failed),
then finds the server clean (harness/isolation.assert_clean: its leak gauges include the references
gauge). No victim stream runs beside these: its own references would blur the one counted.

Real parts: a `loraplex-cache` sidecar subprocess, a `loraplex-inference` subprocess staging through
it, and a real HTTP origin on loopback; after an adapter is registered, the origin sends its weights
one byte every 50 ms (a staging that lasts until the sidecar's fetch deadline) or truncated.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import assert_clean, status_of
from harness.sidecar import RangeIgnoringOrigin, Sidecar
from harness.waiting import wait_until
from inference_service.api import inference_pb2 as pb
from inference_service.api import inference_pb2_grpc as pb_grpc
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = [pytest.mark.timeout(240)]
FETCH_DEADLINE_S = 4.0
REFS = "loraplex_lora_adapter_references"
PREFIXES = ("drip-cancel", "drip-deadline", "truncated")


class Stack:
    def __init__(self, root: Path) -> None:
        adapters = root / "adapters"
        write_peft_adapter(adapters / "model", rank=4, seed=32)
        config = (adapters / "model" / "adapter_config.json").read_bytes()
        weights = (adapters / "model" / "adapter_model.safetensors").read_bytes()
        self.truncated = weights[: len(weights) // 2]
        self.origin = RangeIgnoringOrigin()
        for prefix in PREFIXES:  # good at first: LoadAdapter stages them
            self.origin.put_adapter(prefix, config, weights)
        allow = [adapters.as_uri(), f"{self.origin.url}/"]
        self.sock_dir = Path(tempfile.mkdtemp(prefix="lpx-refs-"))  # a unix socket path must be short
        self.sidecar: Sidecar | None = None
        self.server: InferenceServer | None = None
        try:  # a failed setup stops what it started (the fixture's teardown never runs then)
            self.sidecar = Sidecar(root, allow=allow, socket=self.sock_dir / "cache.sock", extra=[
                "--fetch-deadline-seconds", str(FETCH_DEADLINE_S), "--part-bytes", str(64 << 10), "--no-mlock"])
            self.server = start_inference_server(
                ["--model", "builtin:tiny", "--cache-address", self.sidecar.target, "--max-new-tokens-limit", "1024",
                 *(a for prefix in allow for a in ("--adapter-source-allow", prefix))], log_dir=root)
            with InferenceClient(self.server.address) as c:  # registered, no copy kept: a request stages it again
                for prefix in PREFIXES:
                    c.load_adapter(prefix, f"{self.origin.url}/{prefix}", timeout=60)
        except BaseException:
            self.stop()
            raise

    def spoil(self, prefix: str, weights: bytes | None = None) -> None:
        """From now on the origin sends `prefix`'s weights one byte every 50 ms (or `weights`), and
        the sidecar has no copy left: the next request on it waits for a new staging."""
        path = f"/{prefix}/adapter_model.safetensors"
        if weights is None:
            self.origin.behaviour[path] = "drip"
        else:
            self.origin.files[path] = weights
        assert self.sidecar is not None
        self.sidecar.client.evict(f"{self.origin.url}/{prefix}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.sidecar is not None:
            self.sidecar.stop()
        self.origin.close()
        shutil.rmtree(self.sock_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("iso-refs")))
    yield s
    s.stop()


def _staging_reference_seen(server: InferenceServer) -> None:
    """While one request waits for its adapter's staging: its reference is counted, and the slot
    gauges, which the leak checks read before this gauge existed, show nothing of it."""
    wait_until(lambda: server.value(REFS) == 1, "the staging reference taken")
    samples = server.samples()
    assert samples[("loraplex_requests_waiting", (("reason", "adapter_loading"),))] == 1
    assert samples[("loraplex_lora_slots_referenced", ())] == 0
    assert samples[("loraplex_lora_pending_load_events", ())] == 0


def test_a_request_cancelled_during_staging_leaves_no_reference(stack):
    server = stack.server
    stack.spoil("drip-cancel")
    with server.channel() as ch:
        call = pb_grpc.InferenceStub(ch).Generate(
            pb.GenerateRequest(text="cancelled while staging", adapter="drip-cancel", max_new_tokens=8), timeout=60)
        wait_until(lambda: stack.origin.gets["/drip-cancel/adapter_model.safetensors"] >= 1, "the dripping fetch begun")
        _staging_reference_seen(server)
        call.cancel()
        wait_until(lambda: server.value(REFS) == 0, "the reference released")
        # The staging itself goes on (until the sidecar's deadline) with no request on it.
        assert stack.sidecar.metric("loraplex_cache_inflight_fetches") == 1
    assert_clean(server)


def test_a_request_past_its_deadline_during_staging_leaves_no_reference(stack):
    server = stack.server
    stack.spoil("drip-deadline")
    with InferenceClient(server.address) as c:
        code = status_of(lambda: list(c.generate("too slow", adapter="drip-deadline", max_new_tokens=8, timeout=1.5)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_clean(server)


def test_a_request_whose_staging_fails_leaves_no_reference(stack):
    """The request waits on its adapter's staging, which fails (truncated weights): the request
    ends with the staging's status and its reference is gone."""
    server = stack.server
    stack.spoil("truncated", stack.truncated)
    with InferenceClient(server.address) as c:
        code = status_of(lambda: list(c.generate("broken adapter", adapter="truncated", max_new_tokens=8, timeout=60)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert_clean(server)

