"""Shared pytest fixtures. Each group lives in its own module under tests/infra and is registered here."""

from tests.infra.ceph import ceph_s3, s3_bucket  # noqa: F401  (real S3 server: Ceph radosgw)
from tests.infra.inference_server import inference_server_factory  # noqa: F401  (real inference server subprocess)
from tests.infra.prometheus import prometheus_factory  # noqa: F401  (real Prometheus server)
from tests.infra.tools import pytest_runtest_setup  # noqa: F401  (needs_tool: fail under CI, skip locally)
