#!/usr/bin/env bash
# Regenerates the Python gRPC code from protos/ into inference_service/api/.
# Usage: gen_proto.sh [OUT_DIR]   (OUT_DIR defaults to the package; tests pass a temp dir to check freshness)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
mkdir -p "$out/inference_service/api"
# Mapping protos/loraplex/v1 to the import path inference_service/api makes the generated
# modules import each other as `inference_service.api.X_pb2` (the proto package stays loraplex.v1).
.venv/bin/python -m grpc_tools.protoc \
  -Iinference_service/api=protos/loraplex/v1 \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/loraplex/v1/*.proto
touch "$out/inference_service/api/__init__.py"
