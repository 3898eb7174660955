"""Faults a real S3 server cannot be made to produce on demand, injected in front of moto.

Ceph answers every well-formed GET; to check the retry path (jittered backoff on 503
SlowDown, then success) and its exhaustion (UNAVAILABLE, nothing cached) we need a server
that throttles on command, so a WSGI middleware in front of moto's ThreadedMotoServer
answers the first N ranged GETs of the weights with 503 SlowDown. The same middleware drips
the body of any `.../drip/adapter_model.safetensors` one byte at a time, for the fetch deadline.
"""

from __future__ import annotations

import threading
import time

import boto3
import pytest
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

from adapter_cache.errors import UnavailableError
from harness.ports import free_port
from harness.sidecar import Sidecar, make_adapter, put_adapter

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class ThrottlingMotoServer(ThreadedMotoServer):
    """moto, except that the next `fail_next` GETs of a weights file get 503 SlowDown."""

    def __init__(self, port: int) -> None:
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self.fail_next = 0
        self.failed = 0
        self._lock = threading.Lock()

    def _server_entry(self) -> None:
        moto_app = DomainDispatcherApplication(create_backend_app)

        def app(environ, start_response):
            if environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"].endswith("/drip/adapter_model.safetensors"):
                size = 1 << 20
                start_response("206 Partial Content", [("Content-Length", str(size)),
                                                       ("Content-Range", f"bytes 0-{size - 1}/{size}")])
                return self._drip(size)
            if environ["REQUEST_METHOD"] == "GET" and environ["PATH_INFO"].endswith(".safetensors"):
                with self._lock:
                    throttle = self.fail_next > 0
                    if throttle:
                        self.fail_next -= 1
                        self.failed += 1
                if throttle:
                    start_response("503 Slow Down", [("Content-Type", "application/xml")])
                    return [_SLOWDOWN]
            return moto_app(environ, start_response)

        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server.daemon_threads = True
        self._server_ready_event.set()
        self._server.serve_forever()


    def _drip(self, size: int):
        for _ in range(size):
            time.sleep(0.05)
            yield b"\0"


@pytest.fixture(scope="module")
def moto_s3():
    server = ThrottlingMotoServer(free_port())
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    s3.create_bucket(Bucket="throttled")
    yield server, s3, env
    server.stop()


def test_transient_503s_are_retried_with_backoff(moto_s3, tmp_path):
    server, s3, env = moto_s3
    config, weights = make_adapter(rank=8, hidden=64)
    uri = put_adapter(s3, "throttled", "a/retry", config, weights)
    sc = Sidecar(tmp_path, allow=["s3://throttled/a"], env=env, extra=["--fetch-attempts", "4"])
    try:
        server.fail_next, server.failed = 2, 0
        staged = sc.client.stage(uri)
        assert server.failed == 2
        assert open(staged.path, "rb").read() == weights
        assert sc.metric("loraplex_cache_fetch_requests_total") == 1 + 2 + 1  # config, 2 throttled, success
    finally:
        sc.stop()


def test_persistent_503s_become_unavailable_and_cache_nothing(moto_s3, tmp_path):
    server, s3, env = moto_s3
    config, weights = make_adapter(rank=8, hidden=64)
    uri = put_adapter(s3, "throttled", "a/down", config, weights)
    sc = Sidecar(tmp_path, allow=["s3://throttled/a"], env=env, extra=["--fetch-attempts", "3"])
    try:
        server.fail_next, server.failed = 100, 0
        with pytest.raises(UnavailableError):
            sc.client.stage(uri)
        assert server.failed == 3
        assert sc.client.list() == [] and not list(sc.shm_dir.iterdir())
        assert sc.metric("loraplex_cache_errors_total", 'reason="unavailable"') == 1
    finally:
        server.fail_next = 0
        sc.stop()


def test_dripping_s3_body_is_cut_at_the_fetch_deadline(moto_s3, tmp_path):
    """A byte every 50 ms never trips the 5 s read timeout; the deadline shuts the connection
    down under boto3 and the Stage is UNAVAILABLE, with nothing cached."""
    _, s3, env = moto_s3
    config, _ = make_adapter(rank=8, hidden=64)
    s3.put_object(Bucket="throttled", Key="a/drip/adapter_config.json", Body=config)
    sc = Sidecar(tmp_path, allow=["s3://throttled/a"], env=env, extra=["--fetch-deadline-seconds", "2"])
    try:
        # The deadline's own error: a read under boto3 that the deadline did not shut down would drip
        # on for good (how soon after 2 s it is cut is the host's speed; tests/test_cache_hardening.py
        # fires the deadline by an injected clock).
        with pytest.raises(UnavailableError, match="fetch-deadline-seconds"):
            sc.client.stage("s3://throttled/a/drip")
        assert sc.client.list() == [] and not list(sc.shm_dir.iterdir())
    finally:
        sc.stop()
