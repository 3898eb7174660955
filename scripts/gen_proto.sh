#!/usr/bin/env bash
# Regenerates the Python gRPC code from protos/: the inference API into inference_service/api/, the
# sidecar's own API into adapter_cache/api/ (the sidecar is the lower layer and imports nothing
# from inference_service).
# Usage: gen_proto.sh [OUT_DIR]   (OUT_DIR defaults to the repository; tests pass a temp dir to check freshness)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
# Mapping protos/loraplex/v1 to the import path <package>/api makes the generated modules import
# each other as `<package>.api.X_pb2` (the proto package stays loraplex.v1).
gen() {  # gen PACKAGE PROTO
  mkdir -p "$out/$1/api"
  .venv/bin/python -m grpc_tools.protoc \
    -I"$1/api=protos/loraplex/v1" \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    "protos/loraplex/v1/$2.proto"
  touch "$out/$1/api/__init__.py"
}
gen inference_service inference
gen adapter_cache adapter_cache
