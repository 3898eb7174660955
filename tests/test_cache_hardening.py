"""Sidecar hardening, unit level: what a hostile origin, file or caller can do to one fetch, lease
or call. Origins are real HTTP servers on loopback (harness/sidecar.RangeIgnoringOrigin);
files are real FIFOs, device nodes and directories. The end-to-end cases, with a victim stream
beside each attack, are in tests/test_isolation_sidecar.py.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapter_cache import deadline as deadline_module
from adapter_cache.auth import LOCAL, CacheAuth, Caller
from adapter_cache.cli import build_parser, listen_securely, main
from adapter_cache.deadline import FetchDeadlineError
from adapter_cache.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from adapter_cache.host_cache import HostCache
from adapter_cache.shm import ShmDir, StoredMeta
from adapter_cache.stager import CacheConfig, Stager
from adapter_cache.store import FetchConfig, Fetcher, FileStore, HttpStore, Part
from adapter_cache.uri_policy import UriPolicy
from harness.sidecar import RangeIgnoringOrigin, make_adapter
from harness.tools import skip_or_fail

PART = 64 << 10
BOUND = 16 << 20  # what a bounded reader may let an origin push: one part plus loopback socket buffers


@pytest.fixture
def origin():
    o = RangeIgnoringOrigin()
    yield o
    o.close()


def _fetcher(deadline_s: float = 10.0) -> Fetcher:
    return Fetcher({"http": HttpStore(timeout_s=5)}, FetchConfig(part_bytes=PART, concurrency=2, attempts=2,
                                                                  backoff_initial_s=0.01, backoff_max_s=0.05,
                                                                  deadline_s=deadline_s))


def _fetch(fetcher: Fetcher, uri: str, max_bytes: int) -> bytes:
    out = bytearray()

    def open_sink(size: int) -> bytearray:
        out.extend(bytes(size))
        return out

    def write(sink: bytearray, data: memoryview, offset: int) -> None:
        sink[offset : offset + len(data)] = data

    deadline = fetcher.deadline(uri)
    try:
        fetcher.fetch(uri, max_bytes, open_sink, write, deadline)
    finally:
        deadline.cancel()
    return bytes(out)


# --- origins ---------------------------------------------------------------------------------

def test_range_ignoring_origin_under_the_cap_is_read_as_one_stream(origin):
    body = os.urandom(5 * PART + 123)
    origin.files["/w"] = body
    fetcher = _fetcher()
    assert _fetch(fetcher, f"{origin.url}/w", 1 << 20) == body
    assert origin.gets["/w"] == 2  # the first part's GET, then one sequential stream (not one GET per part)
    fetcher.close()


@pytest.mark.parametrize("behaviour", ["huge", "endless"])
def test_range_ignoring_origin_over_the_cap_is_cut(origin, behaviour):
    """A 1 GiB Content-Length, or a body with no length that never ends: INVALID_ARGUMENT after at
    most one part is read, and the origin could push no more than the socket buffers hold."""
    origin.behaviour["/w"] = behaviour
    fetcher = _fetcher()
    with pytest.raises(InvalidArgumentError, match="max-adapter-bytes"):  # the cap cut it, not the 10 s deadline
        _fetch(fetcher, f"{origin.url}/w", 1 << 20)
    time.sleep(0.2)  # let the origin's writer notice the hang-up
    assert origin.sent["/w"] < BOUND, origin.sent
    fetcher.close()


def test_close_delimited_body_within_one_part_is_fetched(origin):
    body = os.urandom(PART // 2)
    origin.files["/w"] = body
    origin.behaviour["/w"] = "close"
    assert _fetch(_fetcher(), f"{origin.url}/w", 1 << 20) == body


def test_small_object_read_is_bounded_too(origin):
    """adapter_config.json from an origin that streams forever: over the limit, not read whole."""
    origin.behaviour["/c"] = "endless"
    fetcher = _fetcher()
    deadline = fetcher.deadline("c")
    with pytest.raises(InvalidArgumentError, match="over the limit of 1024 bytes"):
        fetcher.get_small(f"{origin.url}/c", 1024, deadline)
    deadline.cancel()
    time.sleep(0.2)
    assert origin.sent["/c"] < BOUND


def test_dripping_origin_is_cut_at_the_fetch_deadline(origin, monkeypatch):
    """One byte every 50 ms never trips a socket read timeout; the deadline cuts the connection. The
    deadline's clock and timer are the test's (injected): the fetch runs on while the clock is short
    of the deadline, and ends, as the deadline's UNAVAILABLE, once it has passed and the timer fires.
    (A wall-clock bound on the whole fetch measured the host's speed as much as the deadline.)"""
    now = [0.0]
    timers: list[_HeldTimer] = []
    monkeypatch.setattr(deadline_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(deadline_module.threading, "Timer", lambda seconds, fire: _HeldTimer(seconds, fire, timers))
    origin.behaviour["/w"] = "drip"
    fetcher = _fetcher(deadline_s=1.0)
    failure: list[BaseException] = []

    def fetch() -> None:
        try:
            _fetch(fetcher, f"{origin.url}/w", 2 << 20)
        except BaseException as e:  # noqa: BLE001 - checked below
            failure.append(e)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    _wait_for(lambda: origin.sent["/w"] >= 3)  # bytes are dripping
    now[0] = 0.99  # just short of the deadline: the fetch goes on
    dripped = origin.sent["/w"]
    _wait_for(lambda: origin.sent["/w"] >= dripped + 3)
    assert thread.is_alive() and not failure
    [timer] = timers
    assert timer.seconds == 1.0
    now[0] = 1.0
    timer.fire()
    thread.join(30)
    assert not thread.is_alive(), "the fetch went on after its deadline"
    [error] = failure
    assert isinstance(error, FetchDeadlineError) and error.code == "UNAVAILABLE", error
    assert "fetch-deadline-seconds" in str(error)
    fetcher.close()


class _HeldTimer:
    """threading.Timer's part that Deadline uses, fired by the test instead of by time."""

    def __init__(self, seconds: float, fire, timers: list[_HeldTimer]) -> None:  # noqa: ANN001
        self.seconds, self.fire, self.daemon = seconds, fire, False
        timers.append(self)

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def _wait_for(condition, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


# --- files ------------------------------------------------------------------------------------

def _file_store(root: Path) -> FileStore:
    return FileStore(UriPolicy([root.as_uri()]))


def _read_in_thread(store: FileStore, uri: str) -> Exception | Part:
    """read_range in a thread, so a regression (a blocking open) fails the test instead of hanging it."""
    out: list[Exception | Part] = []

    def run() -> None:
        try:
            out.append(store.read_range(uri, 0, memoryview(bytearray(PART))))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(2)
    assert out, f"reading {uri} blocked"
    return out[0]


def test_file_store_refuses_fifos_devices_and_directories_at_once(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    try:
        os.mknod(tmp_path / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: never ends
    except PermissionError:
        skip_or_fail("creating a device node needs CAP_MKNOD (CI runs as root)")
    store = _file_store(tmp_path)
    for name, kind in (("fifo", "FIFO"), ("zero", "device"), ("dir", "directory")):
        exc = _read_in_thread(store, (tmp_path / name).as_uri())
        assert isinstance(exc, InvalidArgumentError) and f"is a {kind}, not a regular file" in str(exc), exc
    (tmp_path / "ok").write_bytes(b"abc")
    part = _read_in_thread(store, (tmp_path / "ok").as_uri())
    assert isinstance(part, Part) and (part.nbytes, part.total_size) == (3, 3)


# --- stager: followers, leases, modes ----------------------------------------------------------

class _StuckStore:
    """A store whose reads hang until released and ignore the fetch deadline, as a hung NFS read
    would: a leader stuck past its deadline cannot be produced with a real origin once the
    deadline works, so this is the one fake here."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def read_range(self, uri, start, buf, etag=None, deadline=None) -> Part:  # noqa: ANN001
        self.entered.set()
        self.release.wait(30)
        raise NotFoundError(f"{uri}: gone")


def _stager(tmp_path: Path, allow: str, **cfg) -> Stager:
    return Stager(CacheConfig(shm_dir=str(tmp_path / "shm"), capacity_bytes=16 << 20, allow_prefixes=[allow],
                              lock_memory=False, fetch=FetchConfig(part_bytes=PART, concurrency=2), **cfg))


def test_follower_of_a_stuck_flight_times_out(tmp_path):
    store = _StuckStore()
    stager = Stager(CacheConfig(shm_dir=str(tmp_path / "shm"), capacity_bytes=1 << 20,
                                allow_prefixes=["s3://b/"], lock_memory=False, follower_grace_s=0.3,
                                fetch=FetchConfig(deadline_s=0.2)), stores={"s3": store})
    leader_error: list[Exception] = []

    def lead() -> None:
        try:
            stager.stage("s3://b/a", owner="x")
        except Exception as exc:  # noqa: BLE001
            leader_error.append(exc)

    leader = threading.Thread(target=lead)
    leader.start()
    assert store.entered.wait(5)
    try:
        with pytest.raises(UnavailableError, match="another call that has not finished within 0.2s"):
            stager.stage("s3://b/a", owner="y", wait_s=0.2)  # its caller's own RPC deadline
        with pytest.raises(UnavailableError, match="within 0.5s"):  # no RPC deadline: deadline + grace
            stager.stage("s3://b/a", owner="y", wait_s=1e9)
        # Both answered at their own bounds, not at the leader's end: it is still stuck (its store
        # call returns after 30 s at most, a hang bound, and then with NotFoundError).
        assert leader.is_alive() and not leader_error
        assert stager.metrics.followers._value.get() == 0
    finally:
        store.release.set()
        leader.join(10)
    assert isinstance(leader_error[0], NotFoundError)
    stager.close()


def test_lease_cap_per_caller_owner_only_release_and_max_lease(tmp_path):
    config, weights = make_adapter()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_bytes(config)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(weights)
    uri = (tmp_path / "a").as_uri()
    stager = _stager(tmp_path, tmp_path.as_uri(), max_leases_per_client=3, max_lease_s=60)
    leases = [stager.stage(uri, owner="greedy", lease_seconds=10**6).lease for _ in range(3)]
    assert all(lease.expires_at <= time.time() + 60 for lease in leases)  # cut to --max-lease-seconds
    with pytest.raises(ResourceExhaustedError, match="max-leases-per-client"):
        stager.stage(uri, owner="greedy")
    other = stager.stage(uri, owner="other").lease  # another caller is not affected
    with pytest.raises(NotFoundError):
        stager.release(leases[0].lease_id, owner="other")  # nor can it touch the greedy caller's leases
    with pytest.raises(NotFoundError):
        list(stager.read(leases[0].lease_id, 1024, owner="other"))
    stager.release(leases[0].lease_id, owner="greedy")
    stager.stage(uri, owner="greedy")
    stager.release(other.lease_id, owner="other")
    stager.close()


def test_host_cache_counts_leases_per_owner_and_expires_them():
    now = [0.0]
    cache = HostCache(1 << 20, clock=lambda: now[0])
    cache.reserve("u", 10)
    from adapter_cache.host_cache import Entry

    cache.commit(Entry("u", 10, "", 0.0))
    a = cache.acquire("u", 5, hit=False, owner="a")
    cache.acquire("u", 50, hit=True, owner="a")
    assert (cache.leases_of("a"), cache.leases_of("b"), cache.lease_count) == (2, 0, 2)
    now[0] = 10
    assert [lease.lease_id for lease in cache.expire()] == [a.lease_id]
    assert cache.leases_of("a") == 1


@pytest.mark.parametrize("group", [None, os.getgid()])
def test_staged_files_are_not_readable_by_other_users(tmp_path, group):
    old = os.umask(0)  # the modes must not depend on the umask
    try:
        shm = ShmDir(tmp_path / "shm", lock_memory=False, group=group)
        pending = shm.create("s3://b/a", 4)
        pending.pwrite(b"abcd", 0)
        data = pending.commit(StoredMeta("s3://b/a", "x", 4, "", 4, "{}", 0.0))
    finally:
        os.umask(old)
    want = 0o600 if group is None else 0o640
    assert stat.S_IMODE((tmp_path / "shm").stat().st_mode) == (0o700 if group is None else 0o750)
    for path in (data, shm.meta_path(pending.key)):
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == want, (path, oct(st.st_mode))
        if group is not None:
            assert st.st_gid == group


# --- auth ---------------------------------------------------------------------------------------

def _md(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


def test_auth_tokens_and_admin_calls():
    auth = CacheAuth(client_tokens=["c1", "c2"], admin_tokens=["adm"])
    c1, c2 = auth.caller(_md("c1")), auth.caller(_md("c2"))
    assert not c1.admin and c1.name.startswith("token:") and c1.name != c2.name  # separate lease owners
    assert auth.caller(_md("adm"), admin=True).admin and auth.caller(_md("adm")).admin
    for md, admin, exc in ((_md(None), False, UnauthenticatedError), (_md("nope"), False, UnauthenticatedError),
                           ([("authorization", "Basic eA==")], False, UnauthenticatedError),
                           (_md(None), True, UnauthenticatedError), (_md("c1"), True, PermissionDeniedError)):
        with pytest.raises(exc):
            auth.caller(md, admin=admin)


def test_auth_without_tokens_lets_the_socket_decide_but_admin_calls_are_refused():
    auth = CacheAuth()
    assert auth.caller(_md(None)) == Caller(LOCAL, admin=False)
    with pytest.raises(PermissionDeniedError, match="no --admin-token-file"):
        auth.caller(_md(None), admin=True)


def test_tcp_listen_needs_a_token_file(capsys):
    with pytest.raises(SystemExit):
        main(["--listen", "127.0.0.1:0", "--shm-dir", "/nonexistent"])
    assert "give --token-file" in capsys.readouterr().err
    assert build_parser().parse_args([]).max_lease_seconds == 900


def test_a_socket_path_longer_than_sun_path_is_a_usage_error(capsys, tmp_path):
    """One line naming the limit (exit 2), not gRPC's bind traceback after the stager started."""
    long = tmp_path / ("d" * 120) / "cache.sock"
    with pytest.raises(SystemExit) as exited:
        main(["--listen", f"unix://{long}", "--shm-dir", str(tmp_path / "shm")])
    assert exited.value.code == 2
    assert "holds at most 107 bytes" in capsys.readouterr().err
    assert not (tmp_path / "shm").exists()


@pytest.mark.parametrize("group", [None, os.getgid()])
def test_socket_mode_and_directory(tmp_path, group):
    stager = Stager(CacheConfig(shm_dir=str(tmp_path / "shm"), capacity_bytes=1 << 20, allow_prefixes=[],
                                lock_memory=False))
    sock = tmp_path / "run" / "cache.sock"
    server, _ = listen_securely(stager, f"unix://{sock}", CacheAuth(), group)
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == (0o600 if group is None else 0o660)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == (0o700 if group is None else 0o750)
        if group is not None:
            assert sock.stat().st_gid == group
    finally:
        server.stop(None)
        stager.close()


def test_inference_cli_checks_its_cache_token_file(tmp_path):
    """An empty or missing --cache-token-file is a usage error at start-up, not at the first load."""
    from inference_service import cli

    (tmp_path / "empty").write_text("\n")
    for path, error in ((tmp_path / "empty", ValueError), (tmp_path / "missing", OSError)):
        with pytest.raises(error):
            cli.configs_from_args(cli.build_parser().parse_args(["--model", "builtin:tiny",
                                                                 "--cache-token-file", str(path)]))
    (tmp_path / "token").write_text("s3cret\n")
    engine_cfg, _ = cli.configs_from_args(cli.build_parser().parse_args(
        ["--model", "builtin:tiny", "--cache-token-file", str(tmp_path / "token")]))
    assert engine_cfg.cache_token_file == str(tmp_path / "token")
