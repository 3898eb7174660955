"""Shared pytest fixtures. Each group lives in its own module under harness/ (shared with bench/), registered here."""

from harness.ceph import ceph_s3, s3_bucket  # noqa: F401  (real S3 server: Ceph radosgw)
from harness.inference_server import inference_server_factory  # noqa: F401  (real inference server subprocess)
from harness.prometheus import prometheus_factory  # noqa: F401  (real Prometheus server)
from harness.tools import pytest_runtest_setup  # noqa: F401  (needs_tool: fail under CI, skip locally)

pytest_plugins = [
    "harness.file_durations",  # each file's seconds at the end; budgets in tests/budget.toml
    "harness.xdist_groups",  # under `-n`: a file (the image's files together) per worker, longest first
]
