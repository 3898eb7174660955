"""Tenant isolation at the adapter-cache sidecar, end to end.

A real `loraplex-cache` subprocess (token-authenticated, 1 MiB adapter cap, 4 s fetch deadline,
4 leases per caller) and a real `loraplex-inference` subprocess staging through it with
`--cache-token-file`; hostile origins are real HTTP servers on loopback that ignore Range
(harness/sidecar.RangeIgnoringOrigin); hostile files are real FIFOs and device nodes.
Each attack runs beside a victim stream (harness/isolation.py) on an adapter staged through the
same sidecar and resident in a slot: the victim must keep its solo tokens, its stream never
stalling, across the whole attack, and the server must be clean afterwards. The sidecar's
memory is measured as the growth of its peak RSS (VmHWM).
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from adapter_cache.api import adapter_cache_pb2 as cpb
from adapter_cache.api import adapter_cache_pb2_grpc as cpb_grpc
from harness.inference_server import InferenceServer, start_inference_server
from harness.isolation import VictimResult, resident_adapter, solo_run, status_of, victim_beside
from harness.sidecar import RangeIgnoringOrigin, Sidecar, write_token
from harness.tools import skip_or_fail
from harness.waiting import wait_until
from inference_service.client import InferenceClient
from inference_service.demo_adapters import write_peft_adapter

pytestmark = [pytest.mark.timeout(240)]
DEADLINE_S = 4.0
MAX_LEASES = 4
MAX_LEASE_S = 120
MAX_ADAPTER_BYTES = 1 << 20
PART_BYTES = 64 << 10
VICTIM_TOKENS = 384
HWM_BOUND = 32 << 20  # the sidecar's peak RSS may grow by at most this (one part, buffers, allocator slack)


class Stack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.adapters = root / "adapters"
        for i in range(6):
            write_peft_adapter(self.adapters / f"good{i}", rank=4, seed=900 + i)
        write_peft_adapter(self.adapters / "victim", rank=4, seed=899)
        self._hostile_files()
        self.origin = RangeIgnoringOrigin()
        good = self.adapters / "good0"
        config = (good / "adapter_config.json").read_bytes()
        self.weights = (good / "adapter_model.safetensors").read_bytes()
        assert len(self.weights) > PART_BYTES  # so a range-ignoring origin is read as a stream of parts
        self.origin.put_adapter("ok", config, self.weights)
        for behaviour in ("huge", "endless", "drip"):
            self.origin.put_adapter(behaviour, config, weights_behaviour=behaviour)
        self.origin.put_adapter("drip2", config, weights_behaviour="drip")
        self.server_token, self.tenant_token = secrets.token_hex(16), secrets.token_hex(16)
        tokens = write_token(root / "client-tokens", self.server_token, self.tenant_token)
        server_token_file = write_token(root / "server-token", self.server_token)
        # A socket directory other users may enter, so only the socket's own mode keeps them out.
        self.sock_dir = Path(tempfile.mkdtemp(prefix="lpx-iso-"))
        self.sock_dir.chmod(0o755)
        allow = [self.adapters.as_uri(), f"{self.origin.url}/"]
        self.sidecar = Sidecar(root, allow=allow, socket=self.sock_dir / "cache.sock", extra=[
            "--token-file", str(tokens), "--max-adapter-bytes", str(MAX_ADAPTER_BYTES),
            "--part-bytes", str(PART_BYTES), "--fetch-deadline-seconds", str(DEADLINE_S),
            "--max-leases-per-client", str(MAX_LEASES), "--max-lease-seconds", str(MAX_LEASE_S),
            "--read-timeout-seconds", "30", "--no-mlock"])
        self.server: InferenceServer = start_inference_server(
            ["--model", "builtin:tiny", "--cache-address", self.sidecar.target, "--cache-token-file",
             str(server_token_file), "--max-new-tokens-limit", "1024",
             *(a for prefix in allow for a in ("--adapter-source-allow", prefix))],
            log_dir=root)
        try:
            resident_adapter(self.server, "victim", (self.adapters / "victim").as_uri())
        except BaseException:
            self.stop()  # the fixture's teardown does not run when its setup raises
            raise

    @property
    def base(self) -> VictimResult:
        """The victim's solo tokens and time, measured just before each attack: on a shared
        machine the background load drifts over the minute this file takes."""
        return solo_run(self.server, adapter="victim", max_new_tokens=VICTIM_TOKENS)

    def _hostile_files(self) -> None:
        good = self.adapters / "good0"
        for name in ("fifo", "device"):
            d = self.adapters / name
            d.mkdir()
            (d / "adapter_config.json").write_bytes((good / "adapter_config.json").read_bytes())
        os.mkfifo(self.adapters / "fifo" / "adapter_model.safetensors")
        try:  # /dev/zero's numbers: a device that never ends
            os.mknod(self.adapters / "device" / "adapter_model.safetensors", stat.S_IFCHR | 0o600, os.makedev(1, 5))
            self.has_device = True
        except PermissionError:
            self.has_device = False

    def load(self, name: str, uri: str, timeout: float = 60):
        with InferenceClient(self.server.address) as c:
            return c.load_adapter(name, uri, timeout=timeout)

    def stub(self) -> cpb_grpc.AdapterCacheServiceStub:
        return cpb_grpc.AdapterCacheServiceStub(self.sidecar.channel())

    def hwm(self) -> int:
        """The sidecar's peak resident set (VmHWM), bytes."""
        for line in Path(f"/proc/{self.sidecar.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()
        self.origin.close()
        for p in self.sock_dir.iterdir():
            p.unlink()
        self.sock_dir.rmdir()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(Path(tmp_path_factory.mktemp("iso-sidecar")))
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def sidecar_clean(stack):
    """After each attack the sidecar is clean too: no fetch or follower left, no half-written
    file, still SERVING, no traceback in its log."""
    yield
    wait_until(lambda: stack.sidecar.metric("loraplex_cache_inflight_fetches") == 0, "no fetch in flight",
               poll_s=0.02)
    assert stack.sidecar.metric("loraplex_cache_stage_followers") == 0
    assert not [p.name for p in stack.sidecar.shm_dir.iterdir() if ".tmp-" in p.name]
    stack.sidecar.wait_healthy(timeout=5)
    assert "Traceback" not in stack.sidecar.log.read_text()


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _load_code(stack: Stack, name: str, uri: str) -> tuple[grpc.StatusCode, str, float]:
    start = time.monotonic()
    try:
        stack.load(name, uri)
    except grpc.RpcError as e:
        return e.code(), e.details(), time.monotonic() - start
    raise AssertionError(f"loading {uri} succeeded")


def test_range_ignoring_origin_under_the_cap_loads(stack):
    """A legitimate origin without Range support still works: read as one counted stream."""
    with victim_beside(stack.server, stack.base):
        adapter = stack.load("from-http", f"{stack.origin.url}/ok")
    assert adapter.name == "from-http"
    assert stack.origin.gets["/ok/adapter_model.safetensors"] == 2  # first part, then one stream


@pytest.mark.parametrize("behaviour", ["huge", "endless"])
def test_range_ignoring_origin_over_the_cap_is_cut_with_bounded_memory(stack, behaviour):
    """1 GiB announced, or zeros with no length and no end: INVALID_ARGUMENT, and the sidecar's
    peak memory grows by less than HWM_BOUND (it read one 64 KiB part, not the body)."""
    before = stack.hwm()
    sent = stack.origin.sent[f"/{behaviour}/adapter_model.safetensors"]
    with victim_beside(stack.server, stack.base):
        code, details, _ = _load_code(stack, f"mem-{behaviour}", f"{stack.origin.url}/{behaviour}")
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "max-adapter-bytes" in details  # cut at the size cap, not at the fetch deadline
    growth = stack.hwm() - before
    assert growth < HWM_BOUND, f"sidecar peak RSS grew by {growth / 2**20:.1f} MiB"
    assert stack.origin.sent[f"/{behaviour}/adapter_model.safetensors"] - sent < HWM_BOUND


def test_never_ending_slow_origin_hits_the_fetch_deadline_while_others_load(stack):
    """One byte every 50 ms forever: UNAVAILABLE at --fetch-deadline-seconds; meanwhile other
    adapters load while it drips (not after it) and the victim streams on."""
    result: list[tuple[grpc.StatusCode, str, float]] = []
    drips = stack.origin.gets["/drip/adapter_model.safetensors"]
    with victim_beside(stack.server, stack.base):
        slow = threading.Thread(target=lambda: result.append(
            _load_code(stack, "slow", f"{stack.origin.url}/drip")))
        slow.start()
        wait_until(lambda: stack.origin.gets["/drip/adapter_model.safetensors"] > drips, "the dripping fetch begun",
                   poll_s=0.02)
        stack.load("beside-slow", (stack.adapters / "good1").as_uri())
        assert not result, "another adapter's load waited for the slow origin's fetch to end"
        slow.join(DEADLINE_S + 10)
    [(code, details, seconds)] = result
    assert code == grpc.StatusCode.UNAVAILABLE and "fetch-deadline-seconds" in details, details
    assert seconds > DEADLINE_S - 0.5, seconds  # not cut before its deadline (its time after it: host speed)


def test_follower_of_a_stuck_flight_times_out(stack):
    """A second Stage of a uri whose fetch is stuck gives up at its own deadline (UNAVAILABLE,
    explained), and its handler really returns: the sidecar's follower gauge drops to 0 while the
    leader is still fetching."""
    uri = f"{stack.origin.url}/drip2"
    leader: list[grpc.StatusCode] = []

    def lead() -> None:
        leader.append(status_of(lambda: stack.stub().Stage(cpb.StageRequest(uri=uri), metadata=_md(stack.tenant_token),
                                                           timeout=30)))

    with victim_beside(stack.server, stack.base):
        t = threading.Thread(target=lead)
        t.start()
        wait_until(lambda: stack.sidecar.metric("loraplex_cache_inflight_fetches") == 1, "one fetch in flight",
                   poll_s=0.02)
        with pytest.raises(grpc.RpcError) as info:
            stack.stub().Stage(cpb.StageRequest(uri=uri), metadata=_md(stack.tenant_token), timeout=2.0)
        # its own deadline, explained (the client's would be DEADLINE_EXCEEDED)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert "being fetched by another call" in info.value.details()
        assert stack.sidecar.metric("loraplex_cache_stage_followers") == 0
        assert stack.sidecar.metric("loraplex_cache_inflight_fetches") == 1  # the leader is still stuck
        t.join(DEADLINE_S + 10)
    assert leader == [grpc.StatusCode.UNAVAILABLE]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_fifo_or_device_in_place_of_weights_is_refused_at_once(stack, kind):
    if kind == "device" and not stack.has_device:
        skip_or_fail("creating a device node needs CAP_MKNOD (CI runs as root)")
    with victim_beside(stack.server, stack.base):
        code, details, _ = _load_code(stack, f"file-{kind}", (stack.adapters / kind).as_uri())
        # refused before any read (reading a FIFO without a writer would block until the deadline)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a regular file" in details, details
        stack.load(f"after-{kind}", (stack.adapters / "good2").as_uri(), timeout=10)  # loaders not wedged


def test_unauthenticated_calls_are_refused(stack):
    stub = stack.stub()
    good = (stack.adapters / "good3").as_uri()
    with victim_beside(stack.server, stack.base):
        for md in ((), _md("not-a-token"), (("authorization", "Basic eDp5"),)):
            calls = (lambda md=md: stub.Stage(cpb.StageRequest(uri=good), metadata=md, timeout=10),
                     lambda md=md: list(stub.Read(cpb.ReadRequest(lease_id="x"), metadata=md, timeout=10)),
                     lambda md=md: stub.Release(cpb.ReleaseRequest(lease_id="x"), metadata=md, timeout=10))
            assert [status_of(c) for c in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 3, md
    assert good not in {e.uri for e in stack.sidecar.client.list()}  # nothing was fetched for them


def test_list_and_evict_are_admin_only(stack):
    stub = stack.stub()
    with victim_beside(stack.server, stack.base):
        for call in (lambda md: stub.List(cpb.ListRequest(), metadata=md, timeout=10),
                     lambda md: stub.Evict(cpb.EvictRequest(), metadata=md, timeout=10)):
            codes = [status_of(lambda call=call, md=md: call(md))
                     for md in (_md(stack.tenant_token), _md(stack.server_token), ())]
            assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 2 + [grpc.StatusCode.UNAUTHENTICATED]
        assert stack.sidecar.client.list()  # the admin token lists


def test_lease_cap_per_caller_and_lease_time(stack):
    """One tenant takes MAX_LEASES leases of an hour-plus and is refused more; the leases are cut to
    --max-lease-seconds, another tenant's lease is out of its reach, and the inference server
    (another caller) still stages new adapters."""
    stub = stack.stub()
    uri = (stack.adapters / "good4").as_uri()
    md = _md(stack.tenant_token)
    with victim_beside(stack.server, stack.base):
        leases = [stub.Stage(cpb.StageRequest(uri=uri, lease_seconds=10**7), metadata=md, timeout=30)
                  for _ in range(MAX_LEASES)]
        assert all(r.lease_expires_at <= time.time() + MAX_LEASE_S + 1 for r in leases)
        assert status_of(lambda: stub.Stage(cpb.StageRequest(uri=uri), metadata=md, timeout=30)) \
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        stack.load("beside-greedy", (stack.adapters / "good5").as_uri(), timeout=10)  # not refused, not queued
        other = _md(stack.server_token)
        assert status_of(lambda: stub.Release(cpb.ReleaseRequest(lease_id=leases[0].lease_id), metadata=other,
                                              timeout=10)) == grpc.StatusCode.NOT_FOUND
        for r in leases:
            stub.Release(cpb.ReleaseRequest(lease_id=r.lease_id), metadata=md, timeout=10)


def test_socket_and_staged_files_are_the_sidecar_users_alone(stack):
    """Mode 0600 on the socket, 0700 on the directory the sidecar made, 0600 on every staged file;
    another user cannot connect even where it can enter the socket's directory."""
    sock = stack.sidecar.socket
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(stack.sidecar.shm_dir.stat().st_mode) == 0o700
    staged = list(stack.sidecar.shm_dir.iterdir())
    assert staged and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in staged), \
        {p.name: oct(p.stat().st_mode) for p in staged}
    if os.geteuid() != 0:
        skip_or_fail("connecting as another user needs root (CI runs as root)")
    assert _connect_as(65534, sock) == "refused", "another user connected to the sidecar's socket"
    assert _connect_as(os.geteuid(), sock) == "connected"  # the probe itself works


def _connect_as(uid: int, path: Path) -> str:
    """Connect to a unix socket from a forked child running as `uid` (the child only calls
    setuid, socket and _exit: safe after fork in a threaded process)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                try:
                    s.connect(str(path))
                    code = 0
                except PermissionError:
                    code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "connected", 3: "refused"}.get(os.waitstatus_to_exitcode(status), "probe failed")


