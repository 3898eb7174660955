"""A real S3 server for tests and benches: Ceph's RADOS Gateway on loopback.

One monitor, one memstore OSD and one radosgw, all in a temp dir with free ports, each
daemon in the foreground under `timeout` so nothing outlives a crashed test run. The
recipe and why each config line is there: /work/shared/TOOLS.md ("S3: Ceph RADOS Gateway").

Pytest fixtures (registered in tests/conftest.py):
- `ceph_s3` (session, lazy): a `CephS3` with `endpoint_url`, `access_key`, `secret_key`,
  `client()` and `create_bucket(prefix)`.
- `s3_bucket` (function): a fresh, empty bucket name on that server.

Standalone (e.g. for a bench): `python -m harness.ceph` starts one and prints its endpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.ports import free_port

ACCESS_KEY = "loraplextestaccess"
SECRET_KEY = "loraplextestsecretkey0123456789"
_DAEMON_MAX_S = 3 * 3600  # hard upper bound on a daemon's life, in case the parent dies


def ceph_available() -> bool:
    return all(shutil.which(b) for b in ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool"))


@dataclass
class CephS3:
    """A running single-node Ceph with radosgw; `stop()` tears it down in the order that works."""

    root: Path
    endpoint_url: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = "us-east-1"
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def client(self, **config_kwargs):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, **config_kwargs),
        )

    def create_bucket(self, prefix: str = "b") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should reach this server through the standard chain."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def stop(self) -> None:
        # radosgw ignores SIGTERM once the monitor is gone: stop it first, then the OSD, then the mon.
        for name in ("radosgw", "osd", "mon"):
            proc = self._procs.pop(name, None)
            if proc is None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _run(cmd: list[str], timeout: float = 60) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout


def _daemon(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen(
            ["timeout", str(_DAEMON_MAX_S), *cmd], stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait(pred, what: str, timeout: float, procs: dict[str, subprocess.Popen], root: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(
                    f"ceph {name} exited ({p.returncode}) while waiting for {what}; logs in {root}"
                )
        if pred():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}; logs in {root}")


def start_ceph(memstore_bytes: int = 3 << 30) -> CephS3:
    """Start mon, OSD and radosgw; return once an S3 user can list buckets (about 15 s cold)."""
    if not ceph_available():
        raise RuntimeError("Ceph is not installed: run scripts/install_test_tools.sh")
    root = Path(tempfile.mkdtemp(prefix="loraplex-ceph-"))
    mon_port, rgw_port = free_port(), free_port()
    fsid = str(uuid.uuid4())
    conf = root / "ceph.conf"
    for d in ("mon/ceph-a", "osd/ceph-0", "run", "log", "rgw"):
        (root / d).mkdir(parents=True)
    conf.write_text(
        f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000
mon allow pool delete = true
# The monitor's store is a few MB here; its default guard (exit at under 5% of the disk free) stopped a
# test run on a 252 GB disk with 12 GB free ("ceph mon exited (28)", ENOSPC).
mon data avail crit = 0
osd objectstore = memstore
memstore device bytes = {memstore_bytes}
run dir = {root}/run
admin socket = {root}/run/$name.asok
log file = {root}/log/$name.log
mon data = {root}/mon/$cluster-$id
osd data = {root}/osd/$cluster-$id
pid file = {root}/run/$name.pid
[client.rgw.test]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {root}/rgw
"""
    )
    c = ["-c", str(conf)]
    ceph = CephS3(root=root, endpoint_url=f"http://127.0.0.1:{rgw_port}")
    try:
        _run(["monmaptool", "--create", "--fsid", fsid, "--addv", "a", f"[v2:127.0.0.1:{mon_port}]",
              str(root / "monmap")])
        _run(["ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", str(root / "monmap")])
        ceph._procs["mon"] = _daemon(["ceph-mon", *c, "-f", "-i", "a"], root / "log/mon.out")
        _wait(lambda: subprocess.run(["ceph", *c, "--connect-timeout", "3", "mon", "stat"],
                                     capture_output=True).returncode == 0,
              "the monitor", 60, ceph._procs, root)
        osd_id = _run(["ceph", *c, "osd", "create"]).strip()
        _run(["ceph-osd", *c, "-i", osd_id, "--mkfs"])
        ceph._procs["osd"] = _daemon(["ceph-osd", *c, "-f", "-i", osd_id], root / "log/osd.out")
        _wait(lambda: '"num_up_osds":1' in _run(["ceph", *c, "osd", "stat", "-f", "json"]).replace(" ", ""),
              "the OSD", 60, ceph._procs, root)
        ceph._procs["radosgw"] = _daemon(["radosgw", *c, "-f", "-n", "client.rgw.test"], root / "log/rgw.out")
        _run(["radosgw-admin", *c, "user", "create", "--uid", "loraplex", "--display-name", "loraplex",
              "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY], timeout=120)

        def s3_ready() -> bool:
            try:
                ceph.client(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}).list_buckets()
                return True
            except Exception:
                return False

        _wait(s3_ready, "radosgw", 90, ceph._procs, root)
    except BaseException:
        ceph.stop()
        raise
    return ceph


# --- pytest fixtures -------------------------------------------------------------------------

@pytest.fixture(scope="session")
def ceph_s3() -> Iterator[CephS3]:
    """A real S3 server (Ceph radosgw), started once per session on first use."""
    if not ceph_available():
        pytest.fail("Ceph is not installed: run scripts/install_test_tools.sh (make test does)")
    ceph = start_ceph()
    try:
        yield ceph
    finally:
        ceph.stop()


@pytest.fixture
def s3_bucket(ceph_s3: CephS3) -> str:
    """A fresh bucket on the session's Ceph server."""
    return ceph_s3.create_bucket("t")


if __name__ == "__main__":
    started = start_ceph()
    print(f"endpoint={started.endpoint_url} access_key={started.access_key} secret_key={started.secret_key}",
          flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        started.stop()
        os._exit(0)
