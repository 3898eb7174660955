#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh: the project's runtime dependencies that the GPU machine's image
# lacks (or holds at other versions), for its Python 3.12 on x86-64. Run it where PyPI is reachable
# (a developer's machine); the GPU machine reaches nothing, so .whl/ travels with the working tree
# (the device tool's `carry: [".whl"]`). Versions are this checkout's venv's: the generated gRPC
# code needs grpcio (and protobuf) at least at the versions it was generated with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES="grpcio|grpcio-health-checking|grpcio-reflection|protobuf|boto3|botocore|s3transfer|jmespath|tenacity|xxhash|google-re2"
mapfile -t specs < <("$PY" -m pip freeze | grep -i -E "^(${PACKAGES})==")
[ "${#specs[@]}" -ge 10 ] || { echo "expected the pinned packages in $PY's environment, found: ${specs[*]}" >&2; exit 1; }
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
ls .whl
du -sh .whl
